"""The step's noise is drawn by one function (opacus_rc/optimizers/noise.py), placed per topology.

* one path: every registered randomized-clipping optimizer's ``add_noise`` is the one of
  ``RandomizedClipOptimizer`` (which calls ``add_gaussian_noise``), no other module of the
  package calls the noise generator, and a generator that raises makes the step raise;
* equivalence: with a seeded generator the released gradient is bit for bit Opacus' own
  ``DPOptimizerFastGradientClipping.add_noise`` (what the single-process optimizer inherited
  before the noise path was its own), in secure mode too, and the numbers recorded on the main
  branch before the refactor (fingerprints, to float32 tolerance: CPUs differ in last bits);
* placements: DDP rank 0 draws as one process, other ranks pass their clipped sums on (a copy,
  no draw); the FSDP2 placement is checked with two processes in tests/distributed/.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from opacus.optimizers import DPOptimizerFastGradientClipping
from torch import nn

import opacus_rc.optimizers.noise as noise_module
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.optimizers import (
    DistributedRandomizedClipOptimizer,
    DPLossRandomizedClipping,
    FSDPRandomizedClipOptimizer,
    RandomizedClipOptimizer,
)
from opacus_rc.optimizers.noise import NOISE_PLACEMENTS, add_gaussian_noise

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")

PACKAGE = Path(noise_module.__file__).resolve().parents[1]


def setup(*, secure_mode: bool, bookkeeping: bool, reduction: str, seed: int = 7) -> Any:
    """The configuration whose released gradients were recorded on main before the refactor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=0.7,
        sketch_dim=4,
        loss_reduction=reduction,
        sketch_generator=torch.Generator().manual_seed(123),
        bookkeeping=bookkeeping,
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.5),
        grad_sample_module=gsm,
        noise_multiplier=1.3,
        expected_batch_size=8,
        loss_reduction=reduction,
        generator=torch.Generator().manual_seed(seed),
        secure_mode=secure_mode,
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(reduction=reduction), reduction)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 5, 6, generator=g)
    y = torch.randint(0, 4, (8,), generator=g)
    crit(gsm(x).mean(1), y).backward()
    return opt


def released(opt: RandomizedClipOptimizer) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    opt.attach_step_hook(lambda o: seen.append(torch.cat([p.grad.flatten() for p in o.params])))
    opt.step()
    return seen[0].clone()


def fingerprint(flat: torch.Tensor) -> torch.Tensor:
    """(sum, sum of squares, position-weighted sum) of a released gradient, in float64."""
    f = flat.detach().double()
    w = torch.arange(1, f.numel() + 1, dtype=torch.float64) / f.numel()
    return torch.stack([f.sum(), (f * f).sum(), (f * w).sum()])


# Recorded from main at dc844e0 (before the noise and clip-factor paths were owned here, with
# the noise of Opacus' inherited add_noise): (secure_mode, bookkeeping, reduction) ->
# fingerprint. On the machine that recorded them the current code's released gradients were
# bit for bit dc844e0's in all eight cases; a SHA-256 of the bytes is not portable (an AMD EPYC
# and an Intel Xeon give different last bits: the matmul kernels sum in another order), so the
# test compares fingerprints. Tolerance: each of the 76 float32 coordinates is a short
# reduction whose value may move by a few float32 ulps between CPUs (relative 2**-23 each, a
# few times: < 1e-6); the sums then move by < 76 * 1e-6 * max|g| <= 1e-4 * ||g||_2, which is
# the tolerance (a changed formula, e.g. the divisor or the noise scale, moves them by >= 1%).
MAIN_FINGERPRINTS = {
    (False, True, "mean"): (-0.18089726567268372, 1.313419574526561, 0.062430296255194584),
    (False, True, "sum"): (-1.4471781253814697, 84.05885276969991, 0.49944237004155667),
    (False, False, "mean"): (-0.18089724704623222, 1.3134195723788715, 0.06243031138918648),
    (False, False, "sum"): (-1.4471779763698578, 84.05885263224778, 0.4994424911134918),
    (True, True, "mean"): (-0.0034940745681524277, 1.006866699378128, 0.09086804085856548),
    (True, True, "sum"): (-0.02795259654521942, 64.43946876020019, 0.7269443268685238),
    (True, False, "mean"): (-0.0034940512850880623, 1.0068666995943218, 0.0908680635443686),
    (True, False, "sum"): (-0.0279524102807045, 64.4394687740366, 0.7269445083549488),
}


@pytest.mark.parametrize(("secure_mode", "bookkeeping", "reduction"), sorted(MAIN_FINGERPRINTS))
def test_released_gradient_equals_main_before_the_refactor(
    secure_mode: bool, bookkeeping: bool, reduction: str
) -> None:
    out = released(setup(secure_mode=secure_mode, bookkeeping=bookkeeping, reduction=reduction))
    want = torch.tensor(
        MAIN_FINGERPRINTS[(secure_mode, bookkeeping, reduction)], dtype=torch.float64
    )
    got = fingerprint(out)
    tol = 1e-4 * want[1].sqrt().item()
    assert torch.allclose(got, want, rtol=0, atol=tol), (got.tolist(), want.tolist())


@pytest.mark.parametrize("secure_mode", [False, True])
def test_noise_is_opacus_add_noise_bit_for_bit(secure_mode: bool) -> None:
    """Same clipped sums, same seed: ours equals Opacus' own DPOptimizerFastGradientClipping.
    add_noise, called unbound on a twin optimizer ("sum": no scaling after the noise)."""
    ours = released(setup(secure_mode=secure_mode, bookkeeping=True, reduction="sum"))
    twin = setup(secure_mode=secure_mode, bookkeeping=True, reduction="sum")
    twin.check_step_allowed()
    twin.accumulate()
    summed = torch.cat([p.summed_grad.flatten() for p in twin.params]).clone()
    DPOptimizerFastGradientClipping.add_noise(twin)
    opacus = torch.cat([p.grad.flatten() for p in twin.params])
    assert torch.equal(ours, opacus)
    # The noise is there: sd sigma * C = 0.91 over 76 coordinates (not a zero draw).
    assert (ours - summed).std().item() > 0.5


def test_every_randomized_optimizer_uses_the_one_noise_path() -> None:
    classes = [
        RandomizedClipOptimizer,
        DistributedRandomizedClipOptimizer,
        FSDPRandomizedClipOptimizer,
    ]  # one process, DDP, FSDP2
    placements = set()
    for cls in classes:
        assert cls.add_noise is RandomizedClipOptimizer.add_noise, cls
        assert cls.noise_placement in NOISE_PLACEMENTS, cls
        placements.add(cls.noise_placement)
    assert placements == set(NOISE_PLACEMENTS)


def test_no_other_module_calls_the_noise_generator() -> None:
    """``generate_noise`` (Opacus' draw, through the adapter) is named in noise.py only."""
    users = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("_compat/") or rel == "optimizers/noise.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else None
            )
            if name in ("generate_noise", "_generate_noise") or (
                isinstance(node, ast.alias) and node.name.endswith("generate_noise")
            ):
                users.append(f"{rel}:{node.lineno}")
            # A draw with torch's own samplers outside noise.py would be a second noise path.
            if name in ("normal", "normal_", "randn", "randn_like") and rel.startswith(
                "optimizers/"
            ):
                users.append(f"{rel}:{node.lineno}")
    assert users == []


def test_a_failing_draw_makes_the_step_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**kwargs: Any) -> torch.Tensor:
        raise RuntimeError("drawn here")

    opt = setup(secure_mode=False, bookkeeping=True, reduction="sum")
    monkeypatch.setattr(noise_module, "generate_noise", refuse)
    with pytest.raises(RuntimeError, match="drawn here"):
        opt.step()


def summed_pair(seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(5))]
    sums = [torch.randn(p.shape, generator=g) for p in params]
    return params, sums


def noise_in_one_process(
    params: list[nn.Parameter], sums: list[torch.Tensor], *, std: float, seed: int
) -> None:
    """``add_gaussian_noise`` of one process, from a generator seeded with ``seed``."""
    add_gaussian_noise(
        params,
        sums,
        std=std,
        placement="single_process",
        generator=torch.Generator().manual_seed(seed),
        secure_mode=False,
    )


def test_ddp_rank0_draws_as_one_process_other_ranks_pass_on() -> None:
    params, sums = summed_pair()
    noise_in_one_process(params, sums, std=2.0, seed=5)
    single = [p.grad.clone() for p in params]

    params, sums = summed_pair()
    gen = torch.Generator().manual_seed(5)
    add_gaussian_noise(
        params, sums, std=2.0, placement="ddp_rank0", generator=gen, secure_mode=False, rank=0
    )
    assert all(torch.equal(p.grad, s) for p, s in zip(params, single))
    # The draw in order, parameter by parameter: N(0, 4) of each shape from the one generator.
    gen = torch.Generator().manual_seed(5)
    expected = [s + torch.normal(0, 2.0, s.shape, generator=gen) for s in sums]
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))

    params, sums = summed_pair()
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    add_gaussian_noise(
        params, sums, std=2.0, placement="ddp_rank0", generator=gen, secure_mode=False, rank=1
    )
    assert torch.equal(gen.get_state(), state)  # rank 1 draws nothing
    for p, s in zip(params, sums):
        assert torch.equal(p.grad, s) and p.grad.data_ptr() != s.data_ptr()  # a copy


def test_the_clipped_sums_are_left_as_opacus_leaves_them() -> None:
    """After the noise, ``p.summed_grad`` still holds the clean clipped sum, as in Opacus:
    hooks read it (the spectral-denoising tutorial compares it with the released gradient),
    so the noise must not be added to it in place, however much an allocation would cost."""
    params, sums = summed_pair()
    before = [s.clone() for s in sums]
    noise_in_one_process(params, sums, std=1.0, seed=2)
    for p, s, b in zip(params, sums, before):
        assert torch.equal(s, b)
        assert p.grad.data_ptr() != s.data_ptr() and not torch.equal(p.grad, s)


def test_a_clipped_sum_is_noised_once() -> None:
    params, sums = summed_pair()
    kwargs: dict[str, Any] = {"std": 1.0, "placement": "single_process", "secure_mode": False}
    add_gaussian_noise(params, sums, generator=None, **kwargs)
    with pytest.raises(ValueError):  # Opacus' processed flag
        add_gaussian_noise(params, sums, generator=None, **kwargs)


def test_bad_arguments_are_refused() -> None:
    params, sums = summed_pair()
    with pytest.raises(
        ValueError,
        match=r"noise_placement must be one of \('single_process', 'ddp_rank0', "
        r"'fsdp2_shard'\), got 'tpu'",
    ):
        add_gaussian_noise(
            params, sums, std=1.0, placement="tpu", generator=None, secure_mode=False
        )
    with pytest.raises(ValueError, match="one per parameter"):
        add_gaussian_noise(
            params, sums[:1], std=1.0, placement="single_process", generator=None,
            secure_mode=False,
        )  # fmt: skip
