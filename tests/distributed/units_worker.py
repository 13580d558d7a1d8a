"""Two-process unit-level randomized clipping under DDP and FSDP2 (gloo, CPU), run by
test_units_distributed.py.

``python units_worker.py OUT.json ddp|fsdp`` spawns 2 processes with
``torch.multiprocessing.spawn``; each runs the scenarios of that wrapper and asserts; rank 0
writes a JSON summary. A script (not a pytest
module) so that spawned children can import it as ``__mp_main__``.

The oracle (float64, one process) sums each sampled unit's per-sequence gradients with one
autograd call per unit. Tolerances:

* update at sigma = 0: the released parameters are ``theta - lr sum_u c_u g_u / E`` over the
  units of *both* ranks, with ``c_u = min(1, C / (n_hat_u + 1e-6))`` from the run's own
  sketched norms (gathered) and ``E`` the expected number of units per step; the only gap is
  float32 against float64 arithmetic (``< 1e-5``);
* sketched norms at k = 4096: each ``n_hat_u`` within ``RTOL = 0.06`` of the exact
  ``||g_u||``, more than five standard deviations of the norm's relative error (``<= sqrt(2 /
  k) / 2 = 0.011``, tests/units/test_unit_clipping.py); the per-sequence norm it replaces,
  ``sqrt(sum_j ||g_j||^2)``, is more than ``RTOL`` away (the sequences of a unit are close
  copies, so their gradients add up), so the check can fail;
* noise at sigma = 1: ``(theta_released - theta_formula) E / lr`` is the all-reduced noise
  alone, ``N(0, sigma^2 C^2)`` per coordinate if drawn once (``sqrt(2) sigma C`` if every rank
  drew its own). Over 2 steps of ``P = 579`` coordinates (570 under FSDP2: 1140 values at
  least) the sample sd has relative standard error ``<= 1 / sqrt(2 * 1140) = 0.021``; the band
  0.15 is seven of them and excludes ``sqrt(2) = 1.41``.
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
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP  # noqa: N817
from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset
from worker_common import CLASSES, WORLD, D, SeqMLP, T, free_port, gather  # noqa: E402

import opacus_rc  # noqa: F401  (registers the "rc" accountant)
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.grad_sample.fsdp import GradSampleModuleRandomizedClippingFSDP
from opacus_rc.optimizers import (
    DistributedRandomizedClipOptimizer,
    DPLossRandomizedClipping,
    FSDPRandomizedClipOptimizer,
)
from opacus_rc.privacy_engine import PrivacyEngine
from opacus_rc.units import DistributedUnitDataLoader, UnitDataLoader, UnitSplit

H = 64  # 5 * 64 + 64 + 64 * 3 + 3 = 579 parameters
LR = 0.5
K = 4096
RTOL = 0.06
N_SEQ, N_UNITS, Q = 30, 8, 0.5


def flat(model: nn.Module) -> torch.Tensor:
    """All parameters, unsharded (a collective for FSDP2's sharded ones)."""
    return torch.cat(
        [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
            for p in model.parameters()
        ]
    )


class CheckpointedSeqMLP(SeqMLP):
    """SeqMLP with its layers under activation checkpointing (``torch.utils.checkpoint``,
    non-reentrant): the hooks see the recomputed forward in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = super(SeqMLP, self).forward
        return checkpoint(inner, x, use_reentrant=False).mean(1)


def at(base: nn.Module, theta: torch.Tensor) -> nn.Module:
    """A plain copy of ``base`` with the parameters ``theta`` (no hooks)."""
    model = copy.deepcopy(base)
    nn.utils.vector_to_parameters(theta.clone(), model.parameters())
    return model


def unit_dataset() -> tuple[TensorDataset, torch.Tensor]:
    """30 sequences of 8 units (3 or 4 each, interleaved: unit of sequence i is i % 8); a
    unit's sequences are close copies of one base sequence, so their gradients add up."""
    g = torch.Generator().manual_seed(0)
    unit_of = torch.arange(N_SEQ) % N_UNITS
    base = 3 * torch.randn(N_UNITS, T, D, generator=g)
    x = base[unit_of] + 0.3 * torch.randn(N_SEQ, T, D, generator=g)
    y = torch.randint(0, CLASSES, (N_UNITS,), generator=g)[unit_of]
    return TensorDataset(x, y, torch.arange(N_SEQ)), unit_of


def unit_loader(rank: int, *, seed: int, steps: int = 2) -> DistributedUnitDataLoader:
    ds, unit_of = unit_dataset()
    return DistributedUnitDataLoader(
        ds,
        unit_of=unit_of,
        sample_rate=Q,
        steps=steps,
        num_replicas=WORLD,
        rank=rank,
        generator=torch.Generator().manual_seed(seed),  # the same on both ranks
        expected_batch_size=int(N_UNITS * Q),  # public: of both ranks together (issue 30)
    )


def oracle_unit_grads(model: nn.Module, units: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U, P)`` float64 summed gradient of each unit in ``units`` (global unit indices) and
    ``(U,)`` the per-sequence norms ``sqrt(sum_j ||g_j||^2)`` (no cross terms)."""
    ds, unit_of = unit_dataset()
    x, y, _ = ds.tensors
    ref = copy.deepcopy(model).double()
    params = list(ref.parameters())
    rows, naive = [], []
    for u in units:
        idx = torch.nonzero(unit_of == u).flatten()
        per_seq = nn.functional.cross_entropy(ref(x[idx].double()), y[idx], reduction="none")
        grads = torch.autograd.grad(per_seq.sum(), params, retain_graph=True)
        rows.append(torch.cat([g.flatten() for g in grads]))
        sq = 0.0
        for j in range(len(idx)):
            gj = torch.autograd.grad(per_seq[j], params, retain_graph=True)
            sq += sum(float(g.pow(2).sum()) for g in gj)
        naive.append(math.sqrt(sq))
    return torch.stack(rows), torch.tensor(naive, dtype=torch.float64)


def step_on_units(gsm: Any, opt: Any, crit: Any, batch: Any) -> tuple[list[int], torch.Tensor]:
    """One private step on this rank's batch; returns its global unit indices (in the order
    of ``units``) and its ``(U_rank,)`` sketched norms."""
    x, y, index, units = batch
    loss = crit(gsm(x), y, units=units)
    assert loss.loss_per_sample.shape == (int(units.numel() and units.max() + 1),)
    loss.backward()
    norms = gsm.per_sample_gradient_norms.detach().double().clone()
    _, unit_of = unit_dataset()
    mine = [int(unit_of[index[units == u][0]]) for u in range(norms.numel())]
    opt.step()
    opt.zero_grad()
    return mine, norms


def gather_units(mine: list[int], norms: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Every rank's units and norms, rank 0's first."""
    both: list[Any] = [None] * WORLD
    dist.all_gather_object(both, (mine, norms.tolist()))
    units = [u for m, _ in both for u in m]
    return units, torch.tensor([n for _, ns in both for n in ns], dtype=torch.float64)


def check_step(
    theta0: torch.Tensor, theta: torch.Tensor, base: nn.Module, units: list[int],
    norms: torch.Tensor, *, C: float, E: float,
) -> dict[str, Any]:  # fmt: skip
    """The released step against the oracle (module docstring); returns the numbers."""
    G, naive = oracle_unit_grads(base, units)
    exact = G.norm(dim=1)
    c = (C / (norms + 1e-6)).clamp(max=1.0)
    expected = theta0.double() - LR * (c[:, None] * G).sum(0) / E
    rel = ((norms - exact).abs() / exact).max().item()
    naive_gap = ((naive - exact).abs() / exact).max().item()
    return {
        "units": units,
        "residual": (theta.double() - expected),
        "norm_rel_err": rel,
        "naive_rel_gap": naive_gap,
        "clipped_units": int((c < 1).sum()),
    }


def scenario_raw(
    rank: int, wrapper: type, *, bookkeeping: bool = True, checkpointed: bool = False
) -> dict[str, Any]:
    """The module and distributed optimizer by hand (DPDDP, torch DDP or FSDP2), sigma 0: the
    update equals the oracle's per-unit clipped sum over both ranks' units, the norms the exact
    ones; each unit on one rank, the union the single-process batch of the seed."""
    torch.manual_seed(1)
    sharded = wrapper is FSDP2Wrapper
    model_class = CheckpointedSeqMLP if checkpointed else SeqMLP
    base = model_class(H - 1 if sharded else H)  # odd hidden size: FSDP2 pads uneven shards
    C = 0.05
    E = int(N_UNITS * Q)  # expected units per step (8 * 0.5 = 4); per rank E / WORLD
    module_class = (
        GradSampleModuleRandomizedClippingFSDP if sharded else (GradSampleModuleRandomizedClipping)
    )
    gsm = module_class(
        wrapper(copy.deepcopy(base)),
        max_grad_norm=C,
        sketch_dim=K,
        sketch_generator=torch.Generator().manual_seed(10 + rank),
        bookkeeping=bookkeeping,
    )
    optimizer_class = (
        FSDPRandomizedClipOptimizer if sharded else (DistributedRandomizedClipOptimizer)
    )
    opt = optimizer_class(
        torch.optim.SGD(gsm.parameters(), lr=LR),
        grad_sample_module=gsm,
        noise_multiplier=0.0,
        max_grad_norm=C,
        expected_batch_size=E / WORLD,
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
    loader = unit_loader(rank, seed=3)
    ds, unit_of = unit_dataset()
    single = UnitDataLoader(
        ds, unit_of=unit_of, sample_rate=Q, steps=2, generator=torch.Generator().manual_seed(3)
    )
    out: dict[str, Any] = {"steps": []}
    for batch, (_, _, idx_single, _) in zip(loader, single):
        theta0 = flat(gsm)
        model_now = at(base, theta0)
        mine, norms = step_on_units(gsm, opt, crit, batch)
        units, all_norms = gather_units(mine, norms)
        assert all(u % WORLD == r for r, m in enumerate(gather_objects(mine)) for u in m)
        assert sorted(units) == sorted(set(unit_of[idx_single].tolist())), "not the same batch"
        res = check_step(theta0, flat(gsm), model_now, units, all_norms, C=C, E=E)
        diff = res.pop("residual").abs().max().item()
        assert diff < 1e-5, f"{wrapper.__name__}: update off the oracle by {diff}"
        assert res["norm_rel_err"] < RTOL, res
        assert res["naive_rel_gap"] > RTOL, res
        assert res["clipped_units"] >= 2, res
        out["steps"].append({**res, "max_abs_diff": diff})
    ranks = gather(flat(gsm))
    assert torch.equal(ranks[0], ranks[1]), "ranks diverged"
    out["split_refused"] = split_is_refused(gsm, crit, next(iter(unit_loader(rank, seed=3))))
    return out


def split_is_refused(gsm: Any, crit: Any, batch: Any) -> bool:
    """A cut unit (unit_split=) with a distributed model raises NotImplementedError naming what
    to do, before any backward (the last thing a scenario does with its module)."""
    x, y, _, units = batch
    try:
        crit(gsm(x), y, units=units, unit_split=UnitSplit(False, True))
    except NotImplementedError as e:
        msg = str(e)
        assert "not supported for a distributed model" in msg and "whole units" in msg, msg
        return True
    return False


def gather_objects(obj: Any) -> list[Any]:
    both: list[Any] = [None] * WORLD
    dist.all_gather_object(both, obj)
    return both


def scenario_engine(rank: int, sigma: float, wrapper: type = DPDDP) -> dict[str, Any]:
    """PrivacyEngine.make_private with a DPDDP (or FSDP2) model and a DistributedUnitDataLoader:
    used as it is, the per-rank divisor int(N_units q) / world, the accountant at the unit rate.
    At sigma = 0 the update is the oracle's; at sigma = 1 the gap to it is the noise, drawn
    once."""
    torch.manual_seed(2)
    sharded = wrapper is FSDP2Wrapper
    base = SeqMLP(H - 1 if sharded else H)
    model = wrapper(copy.deepcopy(base))
    C = 0.05
    loader = unit_loader(rank, seed=4, steps=2)
    engine = PrivacyEngine()
    module, opt, crit, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=C,
        clipping="randomized",
        criterion=nn.CrossEntropyLoss(),
        sketch_dim=K,
    )
    assert dl is loader
    assert type(opt) is (
        FSDPRandomizedClipOptimizer if sharded else DistributedRandomizedClipOptimizer
    )
    E = int(N_UNITS * Q)  # the loader's public expected_batch_size, per rank E / WORLD
    assert opt.expected_batch_size == E / WORLD, opt.expected_batch_size
    steps, residuals, out = 0, [], {}
    for batch in dl:
        theta0 = flat(module)
        model_now = at(base, theta0)
        mine, norms = step_on_units(module, opt, crit, batch)
        units, all_norms = gather_units(mine, norms)
        res = check_step(theta0, flat(module), model_now, units, all_norms, C=C, E=E)
        residuals.append(res["residual"])
        assert res["norm_rel_err"] < RTOL, res
        steps += 1
    ranks = gather(flat(module))
    assert torch.equal(ranks[0], ranks[1]), "ranks diverged"
    ((s, q, n, _spec),) = [tuple(h) for h in engine.accountant.history]
    assert (s, q, n) == (sigma, 1 / len(loader), steps) and steps == 2
    if sigma == 0:
        out["max_abs_diff"] = max(r.abs().max().item() for r in residuals)
        assert out["max_abs_diff"] < 1e-5, out
    else:
        noise = torch.cat(residuals) * E / LR  # released minus noiseless: the noise
        out["noise_sd_over_sigma_C"] = noise.std().item() / (sigma * C)
        assert abs(out["noise_sd_over_sigma_C"] - 1.0) < 0.15, out
    out["expected_batch_size"] = opt.expected_batch_size
    out["accountant_steps"] = len(engine.accountant)
    return out


def run(rank: int, port: int, out: str, which: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        if which == "ddp":
            results = {
                "raw_dpddp": scenario_raw(rank, DPDDP),
                "raw_ddp": scenario_raw(rank, DDP),
                "raw_dpddp_checkpointed": scenario_raw(rank, DPDDP, checkpointed=True),
                "engine_sigma0": scenario_engine(rank, 0.0),
                "engine_sigma1": scenario_engine(rank, 1.0),
            }
        else:  # "fsdp" (checked before spawning)
            results = {
                "raw_fsdp_bk": scenario_raw(rank, FSDP2Wrapper),
                "raw_fsdp_two_pass": scenario_raw(rank, FSDP2Wrapper, bookkeeping=False),
                "engine_sigma0": scenario_engine(rank, 0.0, FSDP2Wrapper),
                "engine_sigma1": scenario_engine(rank, 1.0, FSDP2Wrapper),
            }
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


SCENARIOS = ("ddp", "fsdp")

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[2] not in SCENARIOS:
        sys.exit(f"usage: units_worker.py OUT.json {'|'.join(SCENARIOS)}")
    mp.spawn(run, args=(free_port(), sys.argv[1], sys.argv[2]), nprocs=WORLD, join=True)
