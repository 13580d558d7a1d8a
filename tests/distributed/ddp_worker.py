"""Two-process randomized clipping under torch.distributed (gloo, CPU), run by test_ddp.py.

``python ddp_worker.py OUT.json`` spawns 2 processes with ``torch.multiprocessing.spawn`` on a
free port of 127.0.0.1; each runs every scenario below and asserts; rank 0 writes a JSON summary.
A script (not a pytest module) so that spawned children can import it as ``__mp_main__``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP  # noqa: N817
from opacus.utils.batch_memory_manager import BatchMemoryManager
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import DataLoader, TensorDataset
from worker_common import (  # noqa: E402  (the script's folder)
    CLASSES,
    WORLD,
    B,
    D,
    FlatMLP,
    SeqMLP,
    T,
    free_port,
    gather,
    global_batch,
)

import opacus_rc  # noqa: F401  (registers the "rc" accountant)
import opacus_rc.optimizers.noise as noise_module
from opacus_rc.accountants import RCAccountant
from opacus_rc.data_loader import DistributedDPDataLoader
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.optimizers import (
    DistributedRandomizedClipOptimizer,
    DPLossRandomizedClipping,
    RandomizedClipOptimizer,
    attach_post_processing_hook,
)
from opacus_rc.privacy_engine import PrivacyEngine

H = 6


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rc_pieces(model: nn.Module, *, distributed: bool, C: float, sigma: float, reduction: str,
              sketch_dim: int = 8, bookkeeping: bool = True,
              sketch_generator: torch.Generator | None = None) -> tuple[Any, Any, Any]:  # fmt: skip
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=C,
        sketch_dim=sketch_dim,
        loss_reduction=reduction,
        bookkeeping=bookkeeping,
        sketch_generator=sketch_generator,
    )
    assert gsm.bookkeeping is bookkeeping
    cls = DistributedRandomizedClipOptimizer if distributed else RandomizedClipOptimizer
    opt = cls(
        torch.optim.SGD(gsm.parameters(), lr=0.5),
        grad_sample_module=gsm,
        noise_multiplier=sigma,
        max_grad_norm=C,
        expected_batch_size=B // WORLD if distributed else B,
        loss_reduction=reduction,
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(reduction=reduction), reduction)
    return gsm, opt, crit


def scenario_parity_exact(
    rank: int, wrapper: type, reduction: str, *, bookkeeping: bool = True
) -> dict[str, Any]:
    """sigma = 0, exact norms, clipping active: 2 steps under DDP == 1 process, global batch
    (book-keeping: each rank's one-pass clipped sum, all-reduced once; or two passes)."""
    torch.manual_seed(0)
    base = FlatMLP(H)
    C = 0.5
    gsm, opt, crit = rc_pieces(
        wrapper(copy.deepcopy(base)),
        distributed=True,
        C=C,
        sigma=0.0,
        reduction=reduction,
        bookkeeping=bookkeeping,
    )
    if wrapper is DDP:
        assert gsm._module.require_backward_grad_sync is False  # the reducer is off
    clipped = 0
    for step in range(2):
        x, y = global_batch(False, step)
        crit(gsm(x[rank::WORLD]), y[rank::WORLD]).backward()
        clipped += int((gsm.per_sample_gradient_norms > C).sum())
        opt.step()
        opt.zero_grad()
    theta = flat(gsm)
    ranks = gather(theta)
    assert torch.equal(ranks[0], ranks[1]), "ranks diverged"
    ref, ref_opt, ref_crit = rc_pieces(
        copy.deepcopy(base), distributed=False, C=C, sigma=0.0, reduction=reduction
    )
    for step in range(2):
        x, y = global_batch(False, step)
        # Same per-rank row order: the update is a sum, but keep it identical anyway.
        order = torch.cat([torch.arange(r, B, WORLD) for r in range(WORLD)])
        ref_crit(ref(x[order]), y[order]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = (theta - flat(ref)).abs().max().item()
    assert diff < 1e-6, f"DDP vs single process: max |diff| = {diff}"
    total_clipped = int(sum(gather(torch.tensor([clipped]))).item())
    assert total_clipped >= 4, total_clipped
    assert (theta - flat(base)).abs().max() > 1e-3
    return {"max_abs_diff": diff, "clipped_samples": total_clipped}


def scenario_parity_sketched(rank: int, wrapper: type, *, bookkeeping: bool) -> dict[str, Any]:
    """sigma = 0, sketched norms (k = 8): the DDP update equals theta - lr sum_i c_i g_i / B
    over the global batch, with c_i = min(1, C / (n_hat_i + 1e-6)) from the ranks' own sketches
    and g_i exact per-sample gradients.

    Each rank's probes come from a fixed, rank-seeded sketch generator, so the book-keeping
    and two-pass runs draw the same probes, hence the same n_hat and clip factors, and their
    updates must agree to float rounding (returned as "update", compared by the caller). A
    single process on the global batch would draw different probes, so the comparison with it
    is through the formula above, evaluated with this run's own n_hat (exact in the clipping
    step, the only random part being n_hat itself)."""
    torch.manual_seed(1)
    base = SeqMLP(H)
    C = 0.5
    gsm, opt, crit = rc_pieces(
        wrapper(copy.deepcopy(base)),
        distributed=True,
        C=C,
        sigma=0.0,
        reduction="mean",
        bookkeeping=bookkeeping,
        sketch_generator=torch.Generator().manual_seed(10 + rank),
    )
    x, y = global_batch(True, 5)
    crit(gsm(x[rank::WORLD]), y[rank::WORLD]).backward()
    n_hat = torch.cat(gather(gsm.per_sample_gradient_norms.double()))
    opt.step()
    order = torch.cat([torch.arange(r, B, WORLD) for r in range(WORLD)])
    grads = []
    for i in order.tolist():
        ref = copy.deepcopy(base)
        nn.functional.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in ref.parameters()]))
    c = (C / (n_hat.double() + 1e-6)).clamp(max=1.0).float()
    expected = flat(base) - 0.5 * (c[:, None] * torch.stack(grads)).sum(0) / B
    diff = (flat(gsm) - expected).abs().max().item()
    assert diff < 1e-5, f"sketched DDP update off by {diff}"
    assert (c < 1).sum() >= 4
    return {"max_abs_diff": diff, "update": flat(gsm)}


def scenario_bookkeeping_vs_two_pass(rank: int) -> dict[str, Any]:
    """Sketched norms under DPDDP and torch DDP: the book-keeping update (one pass, the clipped
    sum all-reduced once) equals the two-pass update with the same probes, on every rank."""
    out: dict[str, Any] = {}
    for name, wrapper in (("dpddp", DPDDP), ("ddp", DDP)):
        bk = scenario_parity_sketched(rank, wrapper, bookkeeping=True)
        two = scenario_parity_sketched(rank, wrapper, bookkeeping=False)
        diff = (bk["update"] - two["update"]).abs().max().item()
        assert diff < 1e-6, f"{name}: book-keeping vs two passes off by {diff}"
        out[name] = {
            "bk_vs_two_pass": diff,
            "vs_formula": max(bk["max_abs_diff"], two["max_abs_diff"]),
        }
    return out


class WideSeq(nn.Module):
    """Sequence model for the FLOP count: sketched Linear layers whose GEMMs dominate the sketch
    (k (p + d) << 2 p d) behind a cheap input layer (a transformer's embedding), as in
    transformers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(8, 128)
        self.lin1 = nn.Linear(128, 128)
        self.lin2 = nn.Linear(128, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(torch.tanh(self.lin0(x))))).mean(1)


def _step_flops(gsm: Any, opt: Any, crit: Any, x: torch.Tensor, y: torch.Tensor) -> int:
    """Matmul FLOPs (torch's FlopCounterMode) of one whole step: forward, backward, step."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        crit(gsm(x), y).backward()
        opt.step()
    opt.zero_grad()
    return counter.get_total_flops()


def scenario_flops(rank: int) -> dict[str, Any]:
    """FLOPs per step per rank: torch DDP (and DPDDP) with book-keeping vs one process with
    book-keeping on the same (local) batch. A count, not a time: deterministic.

    Collectives are not matmuls and count 0, so book-keeping under DDP must cost the
    single-process count (asserted <= 1.05x). So that the count can tell the paths apart, the
    fallback that ran before (two passes, the first through every leaf because DDP's reducer
    expected every gradient) is re-created by turning the reducer back on, and must count
    >= 1.5x: it computes every weight gradient twice."""
    torch.manual_seed(9)
    base = WideSeq()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, 16, 8, generator=g)
    y = torch.randint(0, CLASSES, (B,), generator=g)
    xl, yl = x[rank::WORLD], y[rank::WORLD]
    counts = {}
    for name, wrapper, bookkeeping in (
        ("ddp_bookkeeping", DDP, True),
        ("dpddp_bookkeeping", DPDDP, True),
        ("single_bookkeeping", None, True),
        ("ddp_two_pass", DDP, False),
        ("ddp_old_fallback", DDP, False),
    ):
        model = copy.deepcopy(base)
        gsm, opt, crit = rc_pieces(
            model if wrapper is None else wrapper(model),
            distributed=wrapper is not None,
            C=0.5,
            sigma=0.0,
            reduction="mean",
            bookkeeping=bookkeeping,
        )
        if name == "ddp_old_fallback":
            gsm._module.require_backward_grad_sync = True
        _step_flops(gsm, opt, crit, xl, yl)  # warm-up (lazy generators)
        counts[name] = _step_flops(gsm, opt, crit, xl, yl)
        gsm.cleanup()
        if wrapper is DDP:  # cleanup() gives DDP its reducer back
            assert gsm._module.require_backward_grad_sync is True
    single = counts["single_bookkeeping"]
    ratios = {k: v / single for k, v in counts.items()}
    assert ratios["ddp_bookkeeping"] <= 1.05, ratios
    assert ratios["dpddp_bookkeeping"] <= 1.05, ratios
    assert ratios["ddp_old_fallback"] >= 1.5, ratios
    return {"flops": counts, "ratios": ratios}


def scenario_noise_once(rank: int) -> dict[str, Any]:
    """Zero data gradients, sigma = 1, C = 1, sum reduction: the released gradient is the noise
    alone. Noise is drawn on rank 0 only; the step hook (post-processing position) sees the
    all-reduced gradient, identical on both ranks, with sd sigma * C (not sqrt(2) sigma C)."""
    calls: list[int] = []
    original = noise_module.generate_noise

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    noise_module.generate_noise = counting  # the one noise path (optimizers/noise.py)
    try:
        torch.manual_seed(2)
        model = nn.Linear(64, 64, bias=False)
        gsm, opt, crit = rc_pieces(
            DPDDP(model), distributed=True, C=1.0, sigma=1.0, reduction="sum"
        )
        opt.generator = torch.Generator().manual_seed(100 + rank)
        seen: list[torch.Tensor] = []
        attach_post_processing_hook(opt, lambda o: seen.append(o.params[0].grad.clone()))
        x = torch.zeros(B // WORLD, T, 64)
        target = torch.zeros(B // WORLD, dtype=torch.long)

        class Pick(nn.Module):
            reduction = "sum"

            def forward(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                per = out.sum((1, 2))
                return per if self.reduction == "none" else per.sum()

        crit = DPLossRandomizedClipping(gsm, opt, Pick(), "sum")
        crit(gsm(x), target).backward()
        opt.step()
    finally:
        noise_module.generate_noise = original
    noise = seen[0]
    both = gather(noise)
    assert torch.equal(both[0], both[1]), "step hook saw a rank-local gradient"
    sd = noise.std().item()
    # 4096 coordinates: the sample sd of N(0, 1) is within 1 +- 0.05 (4.5 standard errors).
    assert abs(sd - 1.0) < 0.05, sd
    n_calls = gather(torch.tensor([len(calls)]))
    assert n_calls[0].item() == 1 and n_calls[1].item() == 0, n_calls
    return {"noise_sd": sd, "noise_calls": [int(n.item()) for n in n_calls]}


def scenario_engine(rank: int) -> dict[str, Any]:
    """PrivacyEngine.make_private with a DPDDP model: distributed Poisson loader, the registry's
    distributed optimizer, per-rank expected batch size; each rank's accountant counts each
    step once and reports the single-process epsilon; the ranks stay in sync."""
    torch.manual_seed(3)
    model = DPDDP(SeqMLP(H))
    g = torch.Generator().manual_seed(4)
    data = TensorDataset(
        torch.randn(32, T, D, generator=g), torch.randint(0, 3, (32,), generator=g)
    )
    engine = PrivacyEngine()
    module, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=32,
    )
    assert type(opt) is DistributedRandomizedClipOptimizer
    assert isinstance(loader, DistributedDPDataLoader)
    assert opt.expected_batch_size == 4
    steps = 0
    for x, y in loader:
        crit(module(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    assert steps == len(loader) == 4
    assert len(engine.accountant) == steps
    eps = engine.get_epsilon(1e-5)
    single = RCAccountant()
    single.history = [(1.0, 0.25, steps, module.sketch_spec.to_dict())]
    assert eps == single.get_epsilon(1e-5)
    ranks = gather(flat(module))
    assert torch.equal(ranks[0], ranks[1])
    return {"epsilon": eps, "accountant_steps": len(engine.accountant)}


def scenario_batch_memory_manager(rank: int) -> dict[str, Any]:
    """DPDDP + BatchMemoryManager with physical batches of 1: the ranks split their Poisson
    batches into different numbers of physical batches and one rank draws an empty batch, yet
    they meet at every logical step (no deadlock, no misaligned all-reduce), stay in sync, and
    each accountant counts one step per logical batch."""
    torch.manual_seed(6)
    model = DPDDP(SeqMLP(H))
    g = torch.Generator().manual_seed(8)
    data = TensorDataset(
        torch.randn(24, T, D, generator=g), torch.randint(0, 3, (24,), generator=g)
    )
    engine = PrivacyEngine()
    # The sampler derives each rank's generator from one draw of the global RNG at
    # construction (opacus_rc.data_loader.DistributedPoissonSampler); with seed 1 here rank 1's
    # first Poisson batch is empty.
    torch.manual_seed(1)
    module, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=32,
    )
    physical = empty = 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=1, optimizer=opt) as bmm:
        for x, y in bmm:
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
            physical += 1
            empty += int(len(x) == 0)
    counts = [int(c.item()) for c in gather(torch.tensor([physical]))]
    empties = [int(c.item()) for c in gather(torch.tensor([empty]))]
    # A rank draws an empty Poisson batch with these seeds: Opacus' distributed sampler would
    # skip it, leaving rank 0 one step short (2 accounted steps, misaligned all-reduces).
    assert sum(empties) >= 1, empties
    assert len(engine.accountant) == len(loader) == 3, (len(engine.accountant), counts, empties)
    ranks = gather(flat(module))
    assert torch.equal(ranks[0], ranks[1])
    return {
        "physical_batches_per_rank": counts,
        "empty_batches_per_rank": empties,
        "accountant_steps": len(engine.accountant),
    }


def scenario_failure_on_one_rank(rank: int) -> dict[str, Any]:
    """A NaN on rank 1 only: both ranks raise in backward (no hang), no rank steps or accounts,
    and both continue with the next batch."""
    torch.manual_seed(5)
    gsm, opt, crit = rc_pieces(
        DPDDP(SeqMLP(H)), distributed=True, C=1.0, sigma=1.0, reduction="mean"
    )
    hook_calls: list[int] = []
    opt.attach_step_hook(lambda o: hook_calls.append(1))
    theta = flat(gsm)
    x, y = global_batch(True, 7)
    mine = x[rank::WORLD].clone()
    if rank == 1:
        mine[0, 0, 0] = float("nan")
    errors = {0: "failed on another rank", 1: "NaN or inf"}
    try:
        crit(gsm(mine), y[rank::WORLD]).backward()
    except (RuntimeError, FloatingPointError) as err:
        assert errors[rank] in str(err), str(err)
    else:
        raise AssertionError("backward did not raise")
    try:
        opt.step()
    except RuntimeError as err:
        assert "no step is taken" in str(err)
    else:
        raise AssertionError("step after a failed backward did not raise")
    assert torch.equal(flat(gsm), theta) and not hook_calls
    opt.zero_grad()
    crit(gsm(x[rank::WORLD]), y[rank::WORLD]).backward()
    opt.step()
    assert hook_calls == [1]
    return {"recovered": True}


def run(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        results = {
            "parity_dpddp_mean": scenario_parity_exact(rank, DPDDP, "mean"),
            "parity_dpddp_sum": scenario_parity_exact(rank, DPDDP, "sum"),
            "parity_dpddp_mean_two_pass": scenario_parity_exact(
                rank, DPDDP, "mean", bookkeeping=False
            ),
            "parity_torch_ddp_mean_two_pass": scenario_parity_exact(
                rank, DDP, "mean", bookkeeping=False
            ),
            "bookkeeping_vs_two_pass": scenario_bookkeeping_vs_two_pass(rank),
            "flops": scenario_flops(rank),
            "noise_once": scenario_noise_once(rank),
            "engine": scenario_engine(rank),
            "failure_on_one_rank": scenario_failure_on_one_rank(rank),
            "batch_memory_manager": scenario_batch_memory_manager(rank),
            "parity_torch_ddp_mean": scenario_parity_exact(rank, DDP, "mean"),
        }
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(free_port(), sys.argv[1]), nprocs=WORLD, join=True)
