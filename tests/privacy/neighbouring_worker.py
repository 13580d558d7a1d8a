"""One rank of the distributed neighbouring-dataset harness (2 processes, gloo, CPU), run by
test_neighbouring_distributed.py under ``torchrun --standalone --nproc-per-node 2``.

``python -m torch.distributed.run --standalone --nproc-per-node 2 neighbouring_worker.py OUT``
runs every case below on each rank, one process group for all of them (the imports dominate
the cost), and rank 0 writes ``OUT/results.json``: per case, per dataset (``D`` and ``D-1``,
the last record or unit removed) the mechanism's quantities and the released noisy sums. The
worker asserts nothing about the guarantee itself: the test reads the numbers, so that each
case passes or fails (or is an expected failure) on its own.

Each case runs the same first step on D and on D-1 with the same seeds:

* sigma = 1 (with and without a public ``dataset_size=`` where the path has one): the
  accounted sampling rate, the steps of an epoch, the divisor of the noisy sum (per rank and
  global) and the sd of the update of a trainable parameter that receives zero gradient (the
  noise alone: ``sigma C / divisor``);
* sigma = 0: the released noisy sum, the all-reduced gradient (SGD with lr 1: the update)
  times the run's global divisor, and whether the removed record (unit) was sampled.

The samplers couple the runs: with the same seed the first step's mask of D-1 is that of D
without its last entry (``torch.rand(n)`` is a prefix of ``torch.rand(n + 1)`` from the same
generator state; the worker records both batches and the test checks that they differ by the
removed record only). The engine's distributed Poisson sampler shuffles its shards by default
(a permutation of ``N`` indices, different for ``N - 1``), so the harness turns shuffling off.

``fsdp2-tied-llama-*`` (issue 35): the engine with a one-block tied Llama under FSDP2 (each
decoder layer ``fully_shard``-ed, then the root, which owns the tied embedding / LM head),
every weight trainable, sketched norms at ``k = 4096``.

``fixed_batches`` (issue 30, Opacus PR #745) checks one step of ``poisson_sampling=False`` with
a ``DistributedSampler`` loader of per-rank batch 4 (and the same loader with Poisson
sampling) against the single-process clipped sum of the global batch divided by the global
batch, 8.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integrations"))
sys.path.insert(0, str(HERE.parent))  # tiny_hf_models

import opacus_rc  # noqa: E402,F401  (registers the "rc" accountant)
from opacus_rc.privacy_engine import PrivacyEngine  # noqa: E402
from opacus_rc.units import DistributedUnitDataLoader  # noqa: E402

WORLD = 2
D_IN, CLASSES, T = 5, 3, 4
H = 6
DEAD = 400  # the zero-gradient layer: D_IN * DEAD = 2000 weights
C = 0.5
LR = 1.0  # SGD with lr 1: the update is the released gradient

# Records: N records, loader batch 8 (the engine's global expected batch; 4 per rank).
N_RECORDS, BATCH = 40, 8
# Units: 12 units, rate 0.25; units 0-10 of 3 sequences, the last one of 12 (unit_data).
N_UNITS, SEQ_PER_UNIT, LAST_UNIT_SEQ, UNIT_RATE, K_UNITS, C_UNITS = 12, 3, 12, 0.25, 4096, 7.0


class DeadMLP(nn.Module):
    """Two layers that learn plus ``dead``, a layer used with weight 0: its gradient is exactly
    zero for every sample, so its update is the noise alone. Rank-2 inputs give exact norms;
    rank-3 (``seq=True``) inputs are averaged over the sequence (sketched norms)."""

    def __init__(self, *, seq: bool = False) -> None:
        super().__init__()
        self.seq = seq
        self.lin1 = nn.Linear(D_IN, H)
        self.lin2 = nn.Linear(H, CLASSES)
        self.dead = nn.Linear(D_IN, DEAD, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin2(torch.tanh(self.lin1(x))) + 0.0 * self.dead(x).sum(-1, keepdim=True)
        return out.mean(1) if self.seq else out


def named_full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded (a collective for FSDP2), by its name without wrappers."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[".".join(name.split(".")[-2:])] = full.detach().clone()
    return out


def gather_objects(obj: Any) -> list[Any]:
    both: list[Any] = [None] * WORLD
    dist.all_gather_object(both, obj)
    return both


def released(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], divisor: float
) -> dict[str, Any]:
    """The released noisy sum (update / lr times the global divisor) of the learning layers,
    and the sd of the dead layer's update (the noise over the divisor)."""
    live = torch.cat(
        [(before[k] - after[k]).flatten() for k in sorted(before) if not k.startswith("dead")]
    )
    dead = (before["dead.weight"] - after["dead.weight"]).flatten() / LR
    return {
        "release": (live / LR * divisor).tolist(),
        "dead_sd": dead.std().item(),
        "dead_coords": dead.numel(),
    }


def record_data(n: int) -> TensorDataset:
    """The first ``n`` of ``N_RECORDS`` fixed records ``(x, y, index)``."""
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(N_RECORDS, D_IN, generator=g)
    y = torch.randint(0, CLASSES, (N_RECORDS,), generator=g)
    return TensorDataset(x[:n], y[:n], torch.arange(n))


def engine_records(
    rank: int, wrapper: Any, *, n: int, sigma: float, dataset_size: int | None, seed: int = 0
) -> dict[str, Any]:
    """One step of ``PrivacyEngine.make_private`` (DDP or FSDP2, per-record Poisson loader)."""
    torch.manual_seed(1)
    model = wrapper(DeadMLP())
    engine = PrivacyEngine()
    loader = DataLoader(
        record_data(n),
        batch_size=BATCH,
        generator=torch.Generator().manual_seed(30 + 2 * seed + rank),
    )
    module, opt, crit, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=C,
        clipping="randomized",
        criterion=nn.CrossEntropyLoss(),
        sketch_dim=8,
        noise_generator=torch.Generator().manual_seed(7),
        dataset_size=dataset_size,
    )
    dl.batch_sampler.shuffle = False  # the coupling of D and D-1 (module docstring)
    before = named_full(module)
    x, y, index = next(iter(dl))
    crit(module(x), y).backward()
    opt.step()
    after = named_full(module)
    divisor = float(opt.expected_batch_size) * WORLD
    ((s, q, steps, _spec),) = [tuple(h) for h in engine.accountant.history]
    batch = sorted(i for part in gather_objects(index.tolist()) for i in part)
    return {
        "sample_rate": q,
        "steps_per_epoch": len(dl),
        "accounted_steps": steps,
        "divisor_rank": float(opt.expected_batch_size),
        "divisor_global": divisor,
        "batch": batch,
        "removed_sampled": (N_RECORDS - 1) in batch,
        **released(before, after, divisor),
    }


# The tied Llama under FSDP2 (issue 35): records are token sequences of LM_T tokens; sketched
# norms at k = LM_K (the bound of tests/privacy/neighbouring.py::sensitivity_bound); C_LM below
# every record's norm, so every sampled record is clipped.
LM_V, LM_T, LM_K, C_LM = 29, 6, 4096, 0.1


class SeqCE(nn.Module):
    """Each record's mean next-token cross-entropy (``reduction="none"``: ``(B,)``)."""

    reduction = "mean"

    def forward(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        per = nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
        ).mean(1)
        if self.reduction == "none":
            return per
        return per.mean() if self.reduction == "mean" else per.sum()


class DeadTiedLlama(nn.Module):
    """A one-block tied ``LlamaForCausalLM`` (every weight trainable, RMSNorms included) plus
    ``dead``, a layer used with weight 0 (its gradient is exactly zero: the noise alone)."""

    def __init__(self) -> None:
        super().__init__()
        import tiny_hf_models as hf

        self.lm = hf.llama(vocab=LM_V, tie=True, seed=0).train()
        assert self.lm.lm_head.weight is self.lm.model.embed_tokens.weight
        self.dead = nn.Linear(D_IN, DEAD, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids).logits
        ones = torch.ones(ids.shape[0], 1, D_IN)
        return logits + 0.0 * self.dead(ones).sum(-1, keepdim=True)


def shard_tied_llama(model: DeadTiedLlama) -> nn.Module:
    """Each decoder layer ``fully_shard``-ed, then the root: the root's group owns the tied
    embedding / LM head, the final RMSNorm and ``dead``."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.lm.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def lm_record_data(n: int) -> TensorDataset:
    """The first ``n`` of ``N_RECORDS`` fixed token records ``(ids, index)``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, LM_V, (N_RECORDS, LM_T), generator=g)
    return TensorDataset(ids[:n], torch.arange(n))


def engine_tied_llama(
    rank: int, *, n: int, sigma: float, dataset_size: int | None, seed: int = 0
) -> dict[str, Any]:
    """One step of ``make_private`` with the tied Llama under FSDP2 (per-record Poisson)."""
    model = shard_tied_llama(DeadTiedLlama())
    engine = PrivacyEngine()
    loader = DataLoader(
        lm_record_data(n),
        batch_size=BATCH,
        generator=torch.Generator().manual_seed(30 + 2 * seed + rank),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=loader,
            noise_multiplier=sigma,
            max_grad_norm=C_LM,
            clipping="randomized",
            criterion=SeqCE(),
            sketch_dim=LM_K,
            sketch_generator=torch.Generator().manual_seed(60 + rank),
            noise_generator=torch.Generator().manual_seed(7),
            dataset_size=dataset_size,
        )
    dl.batch_sampler.shuffle = False  # the coupling of D and D-1 (module docstring)
    before = named_full(module)
    ids, index = next(iter(dl))
    crit(module(ids), ids).backward()
    opt.step()
    after = named_full(module)
    divisor = float(opt.expected_batch_size) * WORLD
    ((s, q, steps, _spec),) = [tuple(h) for h in engine.accountant.history]
    batch = sorted(i for part in gather_objects(index.tolist()) for i in part)
    return {
        "sample_rate": q,
        "steps_per_epoch": len(dl),
        "accounted_steps": steps,
        "divisor_rank": float(opt.expected_batch_size),
        "divisor_global": divisor,
        "batch": batch,
        "removed_sampled": (N_RECORDS - 1) in batch,
        "tied_routes": sorted(
            name for name, r in module.norm_routes.items() if r.path.value == "tied"
        ),
        **released(before, after, divisor),
    }


def unit_data(n_units: int) -> tuple[TensorDataset, torch.Tensor]:
    """The sequences of the first ``n_units`` of ``N_UNITS`` units: units 0-10 have
    ``SEQ_PER_UNIT`` sequences each, the last unit (the one removed) ``LAST_UNIT_SEQ``; a unit's
    sequences are close copies, so their gradients add up and the last unit's gradient is the
    largest (the sigma = 0 comparison needs it clipped and the others not: see the test)."""
    g = torch.Generator().manual_seed(0)
    n_first = (N_UNITS - 1) * SEQ_PER_UNIT
    unit_of = torch.cat(
        [torch.arange(n_first) % (N_UNITS - 1), torch.full((LAST_UNIT_SEQ,), N_UNITS - 1)]
    )
    n_seq = len(unit_of)
    base = 3 * torch.randn(N_UNITS, T, D_IN, generator=g)
    x = base[unit_of] + 0.3 * torch.randn(n_seq, T, D_IN, generator=g)
    y = torch.randint(0, CLASSES, (N_UNITS,), generator=g)[unit_of]
    keep = unit_of < n_units
    return TensorDataset(x[keep], y[keep], torch.arange(n_seq)[keep]), unit_of[keep]


def engine_units(
    rank: int, *, n: int, sigma: float, dataset_size: int | None, seed: int = 0
) -> dict[str, Any]:
    """One step of ``make_private`` with a DDP model and a ``DistributedUnitDataLoader``."""
    torch.manual_seed(2)
    model = DDP(DeadMLP(seq=True))
    ds, unit_of = unit_data(n)
    loader = DistributedUnitDataLoader(
        ds,
        unit_of=unit_of,
        sample_rate=UNIT_RATE,
        num_replicas=WORLD,
        rank=rank,
        generator=torch.Generator().manual_seed(50 + seed),  # the same on both ranks
    )
    engine = PrivacyEngine()
    module, opt, crit, dl = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=loader,
        noise_multiplier=sigma,
        max_grad_norm=C_UNITS,
        clipping="randomized",
        criterion=nn.CrossEntropyLoss(),
        sketch_dim=K_UNITS,
        noise_generator=torch.Generator().manual_seed(7),
        dataset_size=dataset_size,
    )
    before = named_full(module)
    x, y, index, units = next(iter(dl))
    crit(module(x), y, units=units).backward()
    norms = module.per_sample_gradient_norms.tolist()  # one per unit, in units' order
    opt.step()
    after = named_full(module)
    divisor = float(opt.expected_batch_size) * WORLD
    ((s, q, steps, _spec),) = [tuple(h) for h in engine.accountant.history]
    full_unit_of = unit_data(N_UNITS)[1]
    mine = [int(full_unit_of[index[units == j][0]]) for j in range(len(norms))]
    both = gather_objects((mine, norms))
    batch = sorted(u for m, _ in both for u in m)
    unit_norms = {u: v for m, ns in both for u, v in zip(m, ns)}
    return {
        "sample_rate": q,
        "steps_per_epoch": len(dl),
        "accounted_steps": steps,
        "divisor_rank": float(opt.expected_batch_size),
        "divisor_global": divisor,
        "batch": batch,
        "removed_sampled": (N_UNITS - 1) in batch,
        "max_norm_of_others": max(
            [v for u, v in unit_norms.items() if u != N_UNITS - 1], default=0.0
        ),
        "norm_of_removed": unit_norms.get(N_UNITS - 1),
        **released(before, after, divisor),
    }


# DPTrainer: tiny GPT-2 with exact per-example norms (tests/integrations/trainer_helpers.py);
# the examples are 4-11 tokens long, so rows 12-31 of the learned position embedding (20 x 16 =
# 320 coordinates) never receive a gradient: their update is the noise alone. C = 1.5 is below
# every example's norm (1.9-4.0), so every sampled example is clipped.
TRAINER_N, TRAINER_E, TRAINER_C, TRAINER_DEAD_ROWS = 40, 8, 1.5, 12


def trainer_run(
    rank: int, out: Path, *, n: int, sigma: float, seed: int = 0, packed: bool = False
) -> dict[str, Any]:
    """One step of ``DPTrainer`` (the launch makes it DDP) on the first ``n`` examples;
    ``packed``: with a ``PackingCollator`` (each rank's sampled examples packed into rows of
    16 tokens, per-record clipping through ``record_ids=``, issue 32; positions restart at each
    record, so the dead position rows stay dead)."""
    import trainer_helpers as th

    from opacus_rc.integrations.train_data import trainer_schedule
    from opacus_rc.integrations.transformers import DPTrainer, LogicalBatch, PrivacyArguments
    from opacus_rc.packing import PackingCollator

    shares: list[int] = []

    class Recording(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            assert isinstance(inputs, LogicalBatch)
            shares.append(inputs.num_examples)
            return super().training_step(model, inputs, num_items_in_batch)

    model = th.tiny_gpt2_exact()
    before = {k: v.double() for k, v in th.params(model).items()}
    trainer = Recording(
        model=model,
        args=th.training_args(
            out,
            max_steps=1,
            per_device_train_batch_size=2,
            optim="sgd",
            learning_rate=LR,
            lr_scheduler_type="constant",
            weight_decay=0.0,
        ),  # fmt: skip
        train_dataset=th.token_examples(TRAINER_N)[:n],
        data_collator=PackingCollator(max_length=16, pad_token_id=th.PAD)
        if packed
        else th.pad_collate,
        privacy_args=PrivacyArguments(
            noise_multiplier=sigma,
            max_grad_norm=TRAINER_C,
            expected_batch_size=TRAINER_E,
            target_delta=1e-3,
            seed=3 + seed,
        ),
    )
    trainer.train()
    after = {k: v.double() for k, v in th.params(trainer.model).items()}
    divisor_rank = float(trainer.dp_optimizer.expected_batch_size)
    divisor = divisor_rank * trainer.args.world_size
    ((s, q, steps, _spec),) = [tuple(h) for h in trainer.privacy_engine.accountant.history]
    wpe = "transformer.wpe.weight"
    dead = (before[wpe] - after[wpe])[TRAINER_DEAD_ROWS:].flatten() / LR
    live = torch.cat(
        [(before[k] - after[k])[: TRAINER_DEAD_ROWS if k == wpe else None].flatten()
         for k in sorted(before)]
    )  # fmt: skip
    total = sum(gather_objects(shares[0]))
    return {
        "sample_rate": q,
        "steps_per_epoch": trainer_schedule(n, expected_batch_size=TRAINER_E).sizes.steps_per_epoch,
        "accounted_steps": steps,
        "divisor_rank": divisor_rank,
        "divisor_global": divisor,
        "batch": total,  # a count: the examples of the first step, over both ranks
        "release": (live / LR * divisor).tolist(),
        "dead_sd": dead.std().item(),
        "dead_coords": dead.numel(),
    }


# DPTrainer under FSDP2 (TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2}), a launch
# of its own, which leaves the first launch's cases as they were). GPT-2's Conv1D takes
# functorch, which FSDP2 refuses; the model is an untied Llama whose only trainable weight is
# the input embedding (exact per-example norms) with 128 rows for tokens 1-63: rows 64-127
# (1024 coordinates) never receive a gradient, so their update is the noise alone.
TRAINER_FSDP_VOCAB, TRAINER_FSDP_C, TRAINER_FSDP_DEAD_ROW = 128, 0.05, 64


def trainer_fsdp_model() -> nn.Module:
    """The Llama of :func:`trainer_fsdp_run`: only its (untied) input embedding trainable."""
    import tiny_hf_models as hf
    import trainer_helpers as th

    model = hf.llama(
        vocab=TRAINER_FSDP_VOCAB, tie=False, intermediate_size=32, seed=0, pad_token_id=th.PAD
    )
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("embed_tokens.weight"))
    return model


def trainer_fsdp_run(rank: int, out: Path, *, n: int, sigma: float, seed: int = 0) -> dict:
    """One step of ``DPTrainer`` under FSDP2 on the first ``n`` examples."""
    import trainer_helpers as th

    from opacus_rc.integrations.train_data import trainer_schedule
    from opacus_rc.integrations.transformers import DPTrainer, LogicalBatch, PrivacyArguments

    shares: list[int] = []

    class Recording(DPTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            assert isinstance(inputs, LogicalBatch)
            shares.append(inputs.num_examples)
            return super().training_step(model, inputs, num_items_in_batch)

    model = trainer_fsdp_model()
    before = {k: v.double() for k, v in th.params(model).items()}
    trainer = Recording(
        model=model,
        args=th.training_args(
            out,
            max_steps=1,
            per_device_train_batch_size=2,
            optim="sgd",
            learning_rate=LR,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            fsdp=True,
            fsdp_config={"fsdp_version": 2},
        ),  # fmt: skip
        train_dataset=th.token_examples(TRAINER_N)[:n],
        data_collator=th.pad_collate,
        privacy_args=PrivacyArguments(
            noise_multiplier=sigma,
            max_grad_norm=TRAINER_FSDP_C,
            expected_batch_size=TRAINER_E,
            target_delta=1e-3,
            seed=3 + seed,
        ),
    )
    trainer.train()
    assert type(trainer.dp_optimizer).__name__ == "FSDPRandomizedClipOptimizer"
    after = {
        k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double()
        for k, p in trainer.model.named_parameters()
        if p.requires_grad
    }
    divisor_rank = float(trainer.dp_optimizer.expected_batch_size)
    divisor = divisor_rank * trainer.args.world_size
    ((s, q, steps, _spec),) = [tuple(h) for h in trainer.privacy_engine.accountant.history]
    emb = "model.embed_tokens.weight"
    dead = (before[emb] - after[emb])[TRAINER_FSDP_DEAD_ROW:].flatten() / LR
    live = (before[emb] - after[emb])[:TRAINER_FSDP_DEAD_ROW].flatten()
    total = sum(gather_objects(shares[0]))
    return {
        "sample_rate": q,
        "steps_per_epoch": trainer_schedule(n, expected_batch_size=TRAINER_E).sizes.steps_per_epoch,
        "accounted_steps": steps,
        "divisor_rank": divisor_rank,
        "divisor_global": divisor,
        "batch": total,  # a count: the examples of the first step, over both ranks
        "release": (live / LR * divisor).tolist(),
        "dead_sd": dead.std().item(),
        "dead_coords": dead.numel(),
    }


def fixed_batches(rank: int, *, poisson: bool) -> dict[str, Any]:
    """One step at sigma = 0 with a ``DistributedSampler`` loader of per-rank batch 4 (global
    8): the update against the single-process clipped sum of the global batch over 8."""
    torch.manual_seed(4)
    base = DeadMLP()
    model = DDP(copy.deepcopy(base))
    data = record_data(N_RECORDS)
    loader = DataLoader(
        data,
        batch_size=BATCH // WORLD,
        sampler=DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=False),
        generator=torch.Generator().manual_seed(40 + rank),
    )
    engine = PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module, opt, crit, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=C,
            clipping="randomized",
            criterion=nn.CrossEntropyLoss(),
            sketch_dim=8,
            poisson_sampling=poisson,
        )
    if poisson:
        dl.batch_sampler.shuffle = False
    before = named_full(module)
    x, y, index = next(iter(dl))
    crit(module(x), y).backward()
    opt.step()
    after = named_full(module)
    batch = sorted(i for part in gather_objects(index.tolist()) for i in part)
    # The oracle: each record's gradient alone (float64), clipped at C, summed, over 8.
    ref = copy.deepcopy(base).double()
    x_all, y_all, _ = data.tensors
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in before.items()}
    clipped = 0
    for i in batch:
        ref.zero_grad()
        nn.functional.cross_entropy(ref(x_all[i : i + 1].double()), y_all[i : i + 1]).backward()
        grads = dict(ref.named_parameters())
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in grads.values()))
        factor = min(1.0, C / (float(norm) + 1e-6))
        clipped += int(factor < 1)
        for k in total:
            total[k] += factor * grads[k].grad
    diffs = [
        ((before[k].double() - after[k].double()) - LR * total[k] / BATCH).abs().max().item()
        for k in total
    ]
    update = torch.cat([(before[k] - after[k]).flatten() for k in sorted(total)]).double()
    oracle = torch.cat([(LR * total[k] / BATCH).flatten() for k in sorted(total)])
    return {
        "batch": batch,
        "clipped": clipped,
        "divisor_rank": float(opt.expected_batch_size),
        "accounted_rate": float(engine.accountant.history[0][1]),
        "steps_per_epoch": len(dl),
        "max_abs_diff": max(diffs),
        "update_over_oracle": float(update.norm() / oracle.norm()),
    }


def plain_loader_refusal(rank: int) -> str | None:
    """``poisson_sampling=False`` with a plain ``DataLoader(dataset, batch_size=4)`` under DDP:
    every rank would iterate the whole dataset (each record W times in a step's sum)."""
    del rank
    model = DDP(DeadMLP())
    try:
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(record_data(N_RECORDS), batch_size=BATCH // WORLD),
            noise_multiplier=0.0,
            max_grad_norm=C,
            clipping="randomized",
            criterion=nn.CrossEntropyLoss(),
            sketch_dim=8,
            poisson_sampling=False,
        )
    except ValueError as error:
        return str(error)
    return None


def neighbours(run: Any, removed: int, *, seeds: int = 8) -> dict[str, Any]:
    """``run`` on D and on D minus its last record (unit) ``removed``.

    The mechanism at sigma 1 (seed 0); the releases at sigma 0 for seeds 0, 1, ... up to the
    first whose first step samples the removed record (``run`` returns ``removed_sampled``, or
    for the Trainer the count of examples, one more on D when it is sampled).
    """
    out: dict[str, Any] = {}
    for label, n in (("D", removed + 1), ("D-1", removed)):
        noisy = run(n=n, sigma=1.0)
        out[label] = {k: v for k, v in noisy.items() if k != "release"}
    pairs = []
    for seed in range(seeds):
        a = run(n=removed + 1, sigma=0.0, seed=seed)
        b = run(n=removed, sigma=0.0, seed=seed)
        sampled = a.get("removed_sampled", a["batch"] != b["batch"])
        delta = torch.tensor(a.pop("release"), dtype=torch.float64) - torch.tensor(
            b.pop("release"), dtype=torch.float64
        )
        pairs.append(
            {"seed": seed, "delta_norm": delta.norm().item(), "removed_sampled": sampled,
             "D": a, "D-1": b}
        )  # fmt: skip
        if sampled:
            break
    out["pairs"] = pairs
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    try:
        if sys.argv[2:] == ["trainer-fsdp2"]:  # a launch of its own
            results = {
                "trainer-fsdp2": neighbours(
                    lambda *, n, sigma, seed=0: trainer_fsdp_run(
                        rank, out / f"r{rank}-{n}-{sigma}-{seed}", n=n, sigma=sigma, seed=seed
                    ),
                    TRAINER_N - 1,
                )
            }
            if rank == 0:
                (out / "results_trainer_fsdp2.json").write_text(json.dumps(results))
            return
        results: dict[str, Any] = {}
        for name, wrapper in (("ddp", DDP), ("fsdp2", FSDP2Wrapper)):
            for size in (None, N_RECORDS):
                results[f"{name}-records-{'size' if size else 'nosize'}"] = neighbours(
                    lambda *, w=wrapper, s=size, **kw: engine_records(
                        rank, w, dataset_size=s, **kw
                    ),
                    N_RECORDS - 1,
                )
        for size in (None, N_RECORDS):
            results[f"fsdp2-tied-llama-{'size' if size else 'nosize'}"] = neighbours(
                lambda *, s=size, **kw: engine_tied_llama(rank, dataset_size=s, **kw),
                N_RECORDS - 1,
            )
        results["ddp-units-size"] = neighbours(
            lambda **kw: engine_units(rank, dataset_size=N_UNITS, **kw), N_UNITS - 1
        )
        # Without a public number of units the divisor could only come from the private
        # count: make_private refuses, on D and on D-1 alike.
        refusals = []
        for n in (N_UNITS, N_UNITS - 1):
            try:
                engine_units(rank, dataset_size=None, n=n, sigma=1.0)
                refusals.append(None)
            except ValueError as error:
                refusals.append(str(error))
        results["ddp-units-nosize-refusals"] = refusals
        results["plain-loader-poisson-false"] = plain_loader_refusal(rank)
        results["fixed_batches"] = {
            "poisson_false": fixed_batches(rank, poisson=False),
            "poisson_true": fixed_batches(rank, poisson=True),
        }
        results["trainer-ddp"] = neighbours(
            lambda *, n, sigma, seed=0: trainer_run(
                rank, out / f"r{rank}-{n}-{sigma}-{seed}", n=n, sigma=sigma, seed=seed
            ),
            TRAINER_N - 1,
        )
        results["trainer-packed-ddp"] = neighbours(
            lambda *, n, sigma, seed=0: trainer_run(
                rank, out / f"r{rank}-p-{n}-{sigma}-{seed}", n=n, sigma=sigma, seed=seed,
                packed=True,
            ),
            TRAINER_N - 1,
        )  # fmt: skip
        if rank == 0:
            (out / "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
