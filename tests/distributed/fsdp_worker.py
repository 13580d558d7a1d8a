"""Two-process randomized clipping of FSDP2-sharded models (gloo, CPU), run by test_fsdp.py.

``python fsdp_worker.py OUT.json`` spawns 2 processes with ``torch.multiprocessing.spawn`` (or
run it under ``torchrun --nproc-per-node 2 fsdp_worker.py OUT.json``); each runs every scenario
and asserts; rank 0 writes a JSON summary. A script, not a pytest module, so that spawned
children can import it as ``__mp_main__``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from worker_common import (  # noqa: E402  (the script's folder)
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
from opacus_rc.accountants import RCAccountant
from opacus_rc.data_loader import DistributedDPDataLoader
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.grad_sample.fsdp import GradSampleModuleRandomizedClippingFSDP
from opacus_rc.optimizers import (
    DPLossRandomizedClipping,
    FSDPRandomizedClipOptimizer,
    RandomizedClipOptimizer,
)
from opacus_rc.privacy_engine import PrivacyEngine

H = 7  # H odd: FSDP2 pads the uneven shards of lin1
LR = 0.5


def full(model: nn.Module) -> torch.Tensor:
    """All parameters, unsharded (a collective for sharded ones)."""
    return torch.cat(
        [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
            for p in model.parameters()
        ]
    )


ORDER = torch.cat([torch.arange(r, B, WORLD) for r in range(WORLD)])


def fsdp_pieces(base: nn.Module, *, C: float, sigma: float, reduction: str = "mean",
                sketch_dim: int = 8, bookkeeping: bool = True,
                sketch_generator: torch.Generator | None = None
                ) -> tuple[Any, Any, Any]:  # fmt: skip
    model = FSDP2Wrapper(copy.deepcopy(base))
    gsm = GradSampleModuleRandomizedClippingFSDP(
        model,
        max_grad_norm=C,
        sketch_dim=sketch_dim,
        loss_reduction=reduction,
        bookkeeping=bookkeeping,
        sketch_generator=sketch_generator,
    )
    assert gsm.bookkeeping is bookkeeping
    opt = FSDPRandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=LR),
        grad_sample_module=gsm,
        noise_multiplier=sigma,
        max_grad_norm=C,
        expected_batch_size=B // WORLD,
        loss_reduction=reduction,
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(reduction=reduction), reduction)
    return gsm, opt, crit


def single_pieces(base: nn.Module, *, C: float, sigma: float, reduction: str = "mean",
                  sketch_dim: int = 8) -> tuple[Any, Any, Any]:  # fmt: skip
    gsm = GradSampleModuleRandomizedClipping(
        copy.deepcopy(base), max_grad_norm=C, sketch_dim=sketch_dim, loss_reduction=reduction
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=LR),
        grad_sample_module=gsm,
        noise_multiplier=sigma,
        max_grad_norm=C,
        expected_batch_size=B,
        loss_reduction=reduction,
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(reduction=reduction), reduction)
    return gsm, opt, crit


def scenario_parity_exact(rank: int, *, reduction: str, bookkeeping: bool) -> dict[str, Any]:
    """sigma = 0, exact norms, clipping active: 2 FSDP2 steps == 1 process on the global batch."""
    torch.manual_seed(0)
    base = FlatMLP(H)
    C = 0.5
    gsm, opt, crit = fsdp_pieces(base, C=C, sigma=0.0, reduction=reduction, bookkeeping=bookkeeping)
    clipped = 0
    for step in range(2):
        x, y = global_batch(False, step)
        crit(gsm(x[rank::WORLD]), y[rank::WORLD]).backward()
        clipped += int((gsm.per_sample_gradient_norms > C).sum())
        opt.step()
        opt.zero_grad()
    theta = full(gsm)
    ranks = gather(theta)
    assert torch.equal(ranks[0], ranks[1]), "ranks diverged"
    ref, ref_opt, ref_crit = single_pieces(base, C=C, sigma=0.0, reduction=reduction)
    for step in range(2):
        x, y = global_batch(False, step)
        ref_crit(ref(x[ORDER]), y[ORDER]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    diff = (theta - full(ref)).abs().max().item()
    assert diff < 1e-6, f"FSDP vs single process: max |diff| = {diff}"
    total_clipped = int(sum(gather(torch.tensor([clipped]))).item())
    assert total_clipped >= 4, total_clipped
    assert (theta - full(base)).abs().max() > 1e-3
    return {"max_abs_diff": diff, "clipped_samples": total_clipped}


def _per_sample_grads(base: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    grads = []
    for i in range(len(x)):
        ref = copy.deepcopy(base)
        nn.functional.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in ref.parameters()]))
    return torch.stack(grads).double()


def scenario_parity_sketched(rank: int, *, bookkeeping: bool) -> dict[str, Any]:
    """sigma = 0, sketched norms.

    (a) k = 8, this run's own n_hat: the FSDP update is theta - lr sum_i c_i g_i / B over the
    global batch with c_i = min(1, C / (n_hat_i + 1e-6)) and exact per-sample g_i (exact; the
    only randomness is n_hat).

    (b) k = 512 against a single process on the same global batch, which draws other probes.
    Tolerance from the sketch variance: for the Gaussian Hutchinson estimate,
    n_hat^2 / n^2 has variance <= 2 / k (rank-one per-sample gradients are the worst case,
    docs/privacy/estimators.md), so ln n_hat has sd <= sqrt(2 / k) / 2 and the difference of
    two independent estimates sd <= 1 / sqrt(k) = 0.044. Since c = min(1, C / n_hat),
    |c_a - c_b| <= max(c_a, c_b) |ln n_hat_a - ln n_hat_b| (mean value theorem, plus clamping
    only shrinking it), bounded at 6 sd by 0.27 max(c). Coordinate-wise,
    |theta_a - theta_b| <= lr / B sum_i |c_a,i - c_b,i| |g_i|, asserted with that bound (both
    runs' c_i known). A wrong clip factor (e.g. a world-size factor in n_hat) breaks it.
    """
    torch.manual_seed(1)
    base = SeqMLP(H)
    C = 0.5
    x, y = global_batch(True, 5)
    g = _per_sample_grads(base, x[ORDER], y[ORDER])
    theta0 = full(base).double()
    out: dict[str, Any] = {}
    for k in (8, 512):
        gsm, opt, crit = fsdp_pieces(
            base,
            C=C,
            sigma=0.0,
            sketch_dim=k,
            bookkeeping=bookkeeping,
            sketch_generator=torch.Generator().manual_seed(10 + rank),
        )
        crit(gsm(x[rank::WORLD]), y[rank::WORLD]).backward()
        n_hat = torch.cat(gather(gsm.per_sample_gradient_norms.double()))
        opt.step()
        theta = full(gsm).double()
        c = (C / (n_hat + 1e-6)).clamp(max=1.0)
        assert (c < 1).sum() >= 4
        if k == 8:
            expected = theta0 - LR * (c[:, None] * g).sum(0) / B
            out["k8_vs_formula"] = (theta - expected).abs().max().item()
            assert out["k8_vs_formula"] < 1e-5, out
            continue
        ref, ref_opt, ref_crit = single_pieces(base, C=C, sigma=0.0, sketch_dim=k)
        ref_crit(ref(x[ORDER]), y[ORDER]).backward()
        c_ref = (C / (ref.per_sample_gradient_norms.double() + 1e-6)).clamp(max=1.0)
        ref_opt.step()
        bound = LR / B * (0.27 * torch.maximum(c, c_ref)[:, None] * g.abs()).sum(0) + 1e-6
        gap = (theta - full(ref).double()).abs()
        assert bool((gap <= bound).all()), (gap - bound).max()
        out["k512_gap_over_bound"] = (gap / bound).max().item()
        out["k512_max_abs_diff"] = gap.max().item()
    return out


class ViewNet(FlatMLP):
    """The two causes of PyTorch's "FSDP2-wrapped module (...) returned a view tensor" warning
    in the FSDP2 tutorial: ``lin1`` on a rank-3 input (``F.linear`` returns a view of its 2-D
    product) and the model's output, the output of ``lin2``, which the per-sample backward
    hook (``register_full_backward_hook``) returns as a view. ``inplace=True`` adds 1 to
    ``lin1``'s output in place."""

    def __init__(self, hidden: int, *, inplace: bool = False) -> None:
        super().__init__(hidden)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin1(x)
        if self.inplace:
            h += 1
        return self.lin2(torch.tanh(h).mean(1))


VIEW_WARNING = "returned a view tensor"


def scenario_view_warning(rank: int) -> dict[str, Any]:
    """PyTorch's FSDP2 view-tensor warning (issue 20 item 11) does not apply to the modules it
    names in an opacus_rc model: each is a trainable (hooked) layer or the root returning one's
    output.

    (a) The warning fires for the root ``FSDPViewNet`` and, up to torch 2.14, ``FSDPLinear``
    (``lin1``), nothing else. (b) The danger it describes, an in-place op on the view silently
    dropping FSDP2's pre-backward hook, cannot happen: ``lin1``'s caller never sees the flagged
    view (the per-sample hook returns its own output) and an in-place op on that raises the module's
    explained ``RuntimeError``; an in-place op on the root's output raises PyTorch's
    "BackwardHookFunction is a view" error. (c) The update, in the run that raised the
    warnings, equals ``theta - lr sum_i c_i g_i / B`` over the global batch with exact
    single-process per-sample gradients ``g_i`` and this run's clip factors (sigma = 0, k = 8;
    exact up to float32 rounding, as scenario_parity_sketched (a)), with clipping active.
    """
    torch.manual_seed(2)
    base = ViewNet(H)
    C = 0.5
    x, y = global_batch(True, 6)
    # Contiguous: F.linear folds a contiguous rank-3 input into one addmm and views it back
    # (the tutorial's embeddings are contiguous); a strided slice takes matmul's copy instead.
    mine = x[rank::WORLD].contiguous()
    g = _per_sample_grads(base, x[ORDER], y[ORDER])
    theta0 = full(base).double()
    gsm, opt, crit = fsdp_pieces(
        base, C=C, sigma=0.0, sketch_generator=torch.Generator().manual_seed(30 + rank)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gsm(mine)
    flagged = sorted(
        {
            str(w.message).split("(")[1].split(")")[0]
            for w in caught
            if VIEW_WARNING in str(w.message)
        }
    )
    # torch 2.13 and 2.14 name both; torch 2.15 no longer names FSDPLinear (issue 33's
    # compatibility run). Either way nothing else is named, and (b) and (c) hold.
    assert "FSDPViewNet" in flagged and set(flagged) <= {"FSDPLinear", "FSDPViewNet"}, flagged
    crit(out, y[rank::WORLD]).backward()
    n_hat = torch.cat(gather(gsm.per_sample_gradient_norms.double()))
    opt.step()
    opt.zero_grad()
    c = (C / (n_hat + 1e-6)).clamp(max=1.0)
    assert (c < 1).sum() >= 4
    diff = (full(gsm).double() - (theta0 - LR * (c[:, None] * g).sum(0) / B)).abs().max().item()
    assert diff < 1e-5, diff
    root_out = gsm(mine)
    try:
        root_out += 1
    except RuntimeError as err:
        assert "BackwardHookFunction is a view" in str(err), err
    else:
        raise AssertionError("an in-place op on the root's output did not raise")
    gsm.private_step.reset()
    inplace, _, _ = fsdp_pieces(ViewNet(H, inplace=True), C=C, sigma=0.0)
    try:
        inplace(mine)
    except RuntimeError as err:
        assert "an in-place operation modified the output" in str(err), err
    else:
        raise AssertionError("an in-place op on lin1's output did not raise")
    return {
        "flagged": flagged,
        "vs_formula": diff,
        "clipped_samples": int((c < 1).sum()),
        "inplace_root_raises": True,
        "inplace_layer_raises": True,
    }


def scenario_noise_once(rank: int, *, bookkeeping: bool) -> dict[str, Any]:
    """Zero data gradients, sigma = 1, C = 1, sum reduction: the released gradient is the noise.

    Same noise seed on both ranks: the unsharded noisy gradient equals the single-process
    noise of that seed exactly (one global draw, each rank keeping its shard). Different seeds:
    still identical on both ranks once unsharded, with sd sigma * C = 1 (noise on each shard
    once; twice would give sqrt(2)); 64 x 64 coordinates: the sample sd of N(0, 1) lies in
    1 +- 0.05 (4.5 standard errors of 1 / sqrt(2 * 4096) = 0.011)."""

    class Pick(nn.Module):
        reduction = "sum"

        def forward(self, out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            per = out.sum((1, 2))
            return per if self.reduction == "none" else per.sum()

    results = {}
    x = torch.zeros(B // WORLD, T, 64)
    target = torch.zeros(B // WORLD, dtype=torch.long)
    for name, seed in (("same_seed", 100), ("rank_seed", 100 + rank)):
        torch.manual_seed(2)
        base = nn.Sequential(nn.Linear(64, 64, bias=False))
        gsm, opt, _ = fsdp_pieces(base, C=1.0, sigma=1.0, reduction="sum", bookkeeping=bookkeeping)
        opt.generator = torch.Generator().manual_seed(seed)
        seen: list[torch.Tensor] = []
        opt.attach_step_hook(
            lambda o, seen=seen: seen.append(o.params[0].grad.full_tensor().clone())
        )
        crit = DPLossRandomizedClipping(gsm, opt, Pick(), "sum")
        crit(gsm(x), target).backward()
        opt.step()
        noise = seen[0]
        both = gather(noise)
        assert torch.equal(both[0], both[1])
        sd = noise.std().item()
        assert abs(sd - 1.0) < 0.05, sd
        results[name] = {"noise_sd": sd}
        if name == "same_seed":
            ref, ref_opt, _ = single_pieces(base, C=1.0, sigma=1.0, reduction="sum")
            ref_opt.generator = torch.Generator().manual_seed(seed)
            ref_seen: list[torch.Tensor] = []
            ref_opt.attach_step_hook(lambda o, s=ref_seen: s.append(o.params[0].grad.clone()))
            ref_loss = DPLossRandomizedClipping(ref, ref_opt, Pick(), "sum")
            ref_loss(ref(torch.zeros(B, T, 64)), target).backward()
            ref_opt.step()
            assert torch.equal(noise, ref_seen[0]), "not the single-process noise"
            results[name]["equals_single_process"] = True
    return results


def scenario_engine(rank: int) -> dict[str, Any]:
    """PrivacyEngine.make_private with an FSDP2 model and a small sample rate: the distributed
    Poisson loader (empty batches kept), the FSDP optimizer, one accountant step per step on
    each rank, the single-process epsilon; a rank with an empty batch stays in step (its
    collectives line up, the ranks' parameters stay identical)."""
    torch.manual_seed(3)
    model = FSDP2Wrapper(SeqMLP(H))
    g = torch.Generator().manual_seed(4)
    data = TensorDataset(
        torch.randn(16, T, D, generator=g), torch.randint(0, 3, (16,), generator=g)
    )
    engine = PrivacyEngine()
    module, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=2),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=32,
    )
    assert type(opt) is FSDPRandomizedClipOptimizer
    assert type(module) is GradSampleModuleRandomizedClippingFSDP and module.bookkeeping
    assert isinstance(loader, DistributedDPDataLoader)
    assert opt.expected_batch_size == 1
    # Each rank's sampler derived its own generator at construction, so the ranks' masks are
    # independent although the ranks are seeded alike (opacus_rc.data_loader); this seed only
    # varies what the rest of the step draws.
    torch.manual_seed(20 + rank)
    steps = 0
    empty: list[int] = []
    for x, y in loader:
        crit(module(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps += 1
        empty.append(int(len(x) == 0))
    per_step = torch.stack(gather(torch.tensor(empty)))  # (WORLD, steps)
    # With these seeds, at some step exactly one rank's Poisson batch is empty
    # (P = (7/8)^8 = 0.34 per rank and step).
    one_empty = int((per_step.sum(0) == 1).sum())
    assert one_empty >= 1, per_step
    empties = per_step.sum(1).tolist()
    assert steps == len(loader) == 8
    assert len(engine.accountant) == steps
    eps = engine.get_epsilon(1e-5)
    single = RCAccountant()
    single.history = [(1.0, 1 / 8, steps, module.sketch_spec.to_dict())]
    assert eps == single.get_epsilon(1e-5)
    ranks = gather(full(module))
    assert torch.equal(ranks[0], ranks[1])
    return {
        "epsilon": eps,
        "accountant_steps": len(engine.accountant),
        "empties": empties,
        "steps_with_one_empty_rank": one_empty,
    }


def scenario_denoise_refused(rank: int) -> dict[str, Any]:
    """denoise= under FSDP2 is refused before any hook is attached."""
    model = FSDP2Wrapper(SeqMLP(H))
    data = TensorDataset(torch.randn(8, T, D), torch.randint(0, 3, (8,)))
    try:
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=2),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
            denoise="spectral",
        )
    except NotImplementedError as err:
        assert "does not support distributed training" in str(err), err
    else:
        raise AssertionError("denoise under FSDP was not refused")
    assert not hasattr(model, "autograd_grad_sample_hooks")
    return {"refused": True}


def run(rank: int, port: int | None, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if port is not None:  # spawned; torchrun sets the environment itself
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(WORLD)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        results = {
            "parity_exact_mean_bk": scenario_parity_exact(rank, reduction="mean", bookkeeping=True),
            "parity_exact_sum_bk": scenario_parity_exact(rank, reduction="sum", bookkeeping=True),
            "parity_exact_mean_two_pass": scenario_parity_exact(
                rank, reduction="mean", bookkeeping=False
            ),
            "parity_sketched_bk": scenario_parity_sketched(rank, bookkeeping=True),
            "parity_sketched_two_pass": scenario_parity_sketched(rank, bookkeeping=False),
            "noise_once_bk": scenario_noise_once(rank, bookkeeping=True),
            "noise_once_two_pass": scenario_noise_once(rank, bookkeeping=False),
            "engine": scenario_engine(rank),
            "denoise_refused": scenario_denoise_refused(rank),
            "view_warning": scenario_view_warning(rank),
        }
        assert math.isfinite(results["engine"]["epsilon"])
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # torchrun --nproc-per-node 2 fsdp_worker.py OUT.json
        run(int(os.environ["RANK"]), None, sys.argv[1])
    else:
        mp.spawn(run, args=(free_port(), sys.argv[1]), nprocs=WORLD, join=True)
