"""A neighbouring-dataset harness: run one DP step on ``D`` and on ``D`` minus one record (or
unit), with the same seeds, and compare what the two runs release (issue 30, item 1).

Two properties are checked on every path the library supports (``tests/privacy/``):

* **The mechanism is the same for neighbours** (:class:`Mechanism`): the rate the records are
  drawn at, the rate and number of steps the accountant records, the steps of an epoch, the
  divisor of the noisy sum (the expected batch size) and the noise standard deviation,
  *measured* on a trainable parameter that receives no gradient (a module that exists but is
  not used in the forward, which the library noises as a zero gradient; its update under SGD at
  ``lr = 1`` is the noise divided by the divisor, of standard deviation ``sigma C / divisor``).
  None of them may depend on the private number of records.
* **One record moves the release by at most C** (:class:`Release`): at ``sigma = 0`` the
  released sum (the SGD ``lr = 1`` update times the divisor: the clipped sum) of ``D`` and of
  ``D`` minus its last record differ by at most ``C`` in L2 norm over all parameters, plus the
  sketch's error where norms are sketched (:func:`sensitivity_bound`).

The last record (or unit) is the one removed, so that the Poisson masks drawn from one seeded
generator (``torch.rand(N) < q``, the first ``N - 1`` draws the same) sample the same other
records in both runs.

Each path is a function ``run(*, neighbour, noise_multiplier, public_size) -> Release`` in
:data:`PATHS`; the distributed paths can reuse :class:`Mechanism`, :class:`Release`,
:func:`mechanism_differences`, :func:`release_distance`, :func:`sensitivity_bound`,
:func:`noise_sd_rtol`, :func:`add_probe`, :func:`trainable` and :func:`release_of_sgd_step`.
"""

from __future__ import annotations

import math
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from opacus_rc import PrivacyEngine
from opacus_rc.integrations.per_sample_loss import per_sample_cross_entropy
from opacus_rc.units import (
    DistributedUnitDataLoader,
    UnitBatchMemoryManager,
    UnitDataLoader,
)

__all__ = [
    "PATHS",
    "PROBE",
    "Mechanism",
    "add_probe",
    "Release",
    "left_position_ids",
    "mechanism_differences",
    "noise_sd_rtol",
    "release_distance",
    "release_of_sgd_step",
    "sensitivity_bound",
    "trainable",
]

#: The name of the zero-gradient probe module every harness model carries.
PROBE = "dp_probe"
#: The probe's width: a ``PROBE_WIDTH x PROBE_WIDTH`` weight plus bias (65,792 noise draws).
PROBE_WIDTH = 256
#: ``k`` of the paths whose norms are sketched (nn.Linear): the sketch's error then is small
#: (:func:`sensitivity_bound`).
LARGE_K = 4096


# ---------------------------------------------------------------------------------------------
# Records and comparisons (general: reused by the distributed paths)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mechanism:
    """The quantities of one run's mechanism, read after its first step.

    Attributes:
        sample_rate: ``q``, the rate each record (or unit) is drawn at.
        accounted_rate: The rate the accountant recorded.
        accounted_steps: The steps the accountant recorded (1 after one step).
        steps_per_epoch: The loader's (or sampler's) steps per epoch.
        divisor: The divisor of the noisy sum (the optimizer's ``expected_batch_size``).
        noise_multiplier: ``sigma`` the optimizer noises with.
        max_grad_norm: ``C``.
        noise_sd: The standard deviation of the probe's update (SGD, ``lr = 1``), measured as
            ``sqrt(mean(update^2))`` (the noise has mean 0); NaN at ``sigma = 0``.
    """

    sample_rate: float
    accounted_rate: float
    accounted_steps: int
    steps_per_epoch: int
    divisor: float
    noise_multiplier: float
    max_grad_norm: float
    noise_sd: float

    @property
    def expected_noise_sd(self) -> float:
        """``sigma C / divisor``: the standard deviation the probe's update should have."""
        return self.noise_multiplier * self.max_grad_norm / self.divisor


@dataclass(frozen=True)
class Release:
    """What one run released at its first step.

    Attributes:
        mechanism: The run's :class:`Mechanism`.
        noisy_sum: Per trainable parameter (the probe excluded), the released sum: the update of
            SGD at ``lr = 1`` times the divisor (float64). At ``sigma = 0`` the clipped sum.
        sampled: The records (or units) in the step, by their index in the dataset (units:
            ``0..U-1`` in dataset order).
        sketch_dim: ``k`` of the sketched norms, or None if every norm is exact.
        removed: The index of ``D``'s last record (or unit): the one its neighbour lacks (the
            same in both runs).
    """

    mechanism: Mechanism
    noisy_sum: dict[str, torch.Tensor]
    sampled: tuple[int, ...]
    sketch_dim: int | None
    removed: int


def noise_sd_rtol(n: int, *, z: float = 6.0) -> float:
    """The relative tolerance of a standard deviation measured from ``n`` zero-mean draws.

    ``n s^2 / sd^2`` is chi-square with ``n`` degrees of freedom: ``s^2 / sd^2`` has mean 1 and
    variance ``2 / n``, so ``s / sd`` has standard deviation ``sqrt(1 / (2 n))`` to first
    order (delta method). ``z`` of them: at ``n = 65,792`` (the probe) and ``z = 6``, 1.65%.
    A divisor that differs by one record at the harness' sizes (3 vs 2, 4 vs 3) moves the sd
    by 33-50%.

    Args:
        n: The number of draws (>= 1).
        z: Standard deviations allowed.

    Returns:
        The relative tolerance.
    """
    return z / math.sqrt(2 * n)


def mechanism_differences(a: Mechanism, b: Mechanism, *, sd_rtol: float) -> list[str]:
    """Where two runs' mechanisms differ (for ``D`` and its neighbour: nowhere).

    Every quantity but the noise is compared exactly; the measured noise standard deviations
    are compared with each other and with ``sigma C / divisor``, within ``sd_rtol``.

    Args:
        a: The mechanism of ``D``.
        b: The mechanism of the neighbour.
        sd_rtol: Relative tolerance of a measured sd (:func:`noise_sd_rtol`).

    Returns:
        One line per difference (empty: the same mechanism).
    """
    out = []
    for name in (
        "sample_rate",
        "accounted_rate",
        "accounted_steps",
        "steps_per_epoch",
        "divisor",
        "noise_multiplier",
        "max_grad_norm",
    ):
        if getattr(a, name) != getattr(b, name):
            out.append(f"{name}: {getattr(a, name)} vs {getattr(b, name)}")
    for which, m in (("D", a), ("D-1", b)):
        if m.noise_multiplier > 0:
            want = m.expected_noise_sd
            if not abs(m.noise_sd - want) <= sd_rtol * want:
                out.append(
                    f"noise sd of {which}: measured {m.noise_sd:.6g}, sigma C / divisor = "
                    f"{want:.6g}"
                )
    if a.noise_multiplier > 0 and not abs(a.noise_sd - b.noise_sd) <= sd_rtol * a.noise_sd:
        out.append(f"noise sd: {a.noise_sd:.6g} vs {b.noise_sd:.6g}")
    return out


def release_distance(a: Release, b: Release) -> float:
    """``||a.noisy_sum - b.noisy_sum||_2`` over all parameters (float64).

    Raises:
        ValueError: If the two releases are not of the same parameters.
    """
    if a.noisy_sum.keys() != b.noisy_sum.keys():
        raise ValueError(
            f"the releases are of different parameters: {sorted(a.noisy_sum)} vs "
            f"{sorted(b.noisy_sum)}"
        )
    sq = sum(float(((a.noisy_sum[n] - b.noisy_sum[n]) ** 2).sum()) for n in a.noisy_sum)
    return math.sqrt(sq)


def sensitivity_bound(
    *, max_grad_norm: float, sketch_dim: int | None, others: int, z: float = 5.0
) -> float:
    """The largest ``||release(D) - release(D - 1)||`` at ``sigma = 0`` that is not a violation.

    Exact norms: ``C`` (each record's clipped gradient ``min(1, C / (n + 1e-6)) g`` has norm
    below ``C``, and the other records' contributions are the same in both runs), times
    ``1 + 1e-4`` for float32 rounding.

    Sketched norms (Hutchinson, ``k`` columns): the estimate of a squared norm is
    ``sum_i s_i^2 X_i / k`` with ``X_i`` iid chi2_k (docs/privacy/estimators.md), of relative
    variance ``2 sum s_i^4 / (k (sum s_i^2)^2) <= 2 / k`` (over layers, a sum of independent
    such terms and exact ones: again ``<= 2 / k``), so the estimated norm ``n_hat`` has relative
    standard deviation at most ``sqrt(2 / k) / 2 = 1 / sqrt(2 k)`` (delta method; 0.011 at
    ``k = 4096``, where chi2_k is close to normal). Within ``z`` of them,
    ``n_hat / n`` is in ``[1 - e, 1 + e]`` with ``e = z / sqrt(2 k)`` (at ``z = 5`` a two-sided
    normal tail of ``6e-7`` per estimate; the sketch generator is seeded, so each test is
    deterministic). A record's contribution ``min(1, C / n_hat) n`` is then at most
    ``C / (1 - e)`` (removed record), and a record present in both runs, whose probes are
    drawn afresh in each (the probes of a layer are drawn for the whole batch, so one record
    fewer shifts every later draw), changes its contribution by at most
    ``C / (1 - e) - C / (1 + e)`` (both ends of the range; no change if it is not clipped in
    either run). By the triangle inequality::

        bound = C / (1 - e) + others * (C / (1 - e) - C / (1 + e))

    ``k = 4096``, ``z = 5``: ``e = 0.055``, ``C (1.059 + 0.111 others)``.

    Args:
        max_grad_norm: ``C``.
        sketch_dim: ``k``, or None for exact norms.
        others: The records (or units) of the step present in both runs.
        z: Standard deviations of the sketch's error allowed.

    Returns:
        The bound.
    """
    c = max_grad_norm
    if sketch_dim is None:
        return c * (1 + 1e-4)
    e = z / math.sqrt(2 * sketch_dim)
    return (c / (1 - e) + others * (c / (1 - e) - c / (1 + e))) * (1 + 1e-4)


def left_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids from the attention mask: each row's first real token at 0, whatever the
    padding side (``(mask.cumsum(-1) - 1).clamp(min=0)``), shape ``(B, T)`` long."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ---------------------------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))

V = 11  # the token models' vocabulary and classes
T = 4  # the unit paths' sequence length
C_MLP = 0.05
C_TOKENS = 0.05
C_LM = 0.1  # the LMs' per-example norms are 1-4: every record is clipped


def add_probe(model: nn.Module) -> nn.Module:
    """Give ``model`` a trainable ``nn.Linear(PROBE_WIDTH, PROBE_WIDTH)`` named :data:`PROBE`
    that its forward never uses: the library noises it as a zero gradient."""
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(99)
        setattr(model, PROBE, nn.Linear(PROBE_WIDTH, PROBE_WIDTH))
    return model


class MLP(nn.Module):
    """``Linear(6, 16) -> tanh -> Linear(16, 3)`` on ``(B, 6)`` features, with the probe. Its
    norms are exact: an ``nn.Linear`` on rank-2 inputs uses the rank-one identity
    ``||g_i a_i^T|| = ||g_i|| ||a_i||`` (opacus_rc/grad_sample/linear.py), not the sketch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = nn.Linear(6, 16)
        self.out = nn.Linear(16, 3)
        add_probe(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


class TokenModel(nn.Module):
    """``Embedding(V, V) -> LayerNorm(V)``: every norm exact, with the probe."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, V)
        self.norm = nn.LayerNorm(V)
        add_probe(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.emb(x))


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Float64 copies of the trainable parameters, by name (the hooks' wrapper prefix cut)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name.removeprefix("_module.")] = p.detach().double().clone()
    return out


def release_of_sgd_step(
    before: dict[str, torch.Tensor],
    model: nn.Module,
    mechanism_of: Callable[[float], Mechanism],
    sampled: Sequence[int],
    sketch_dim: int | None,
    removed: int,
) -> Release:
    """The :class:`Release` of one step of SGD at ``lr = 1``: ``(before - after) * divisor``.

    Args:
        before: :func:`trainable` of the model before the step.
        model: The model after the step (its trainable parameters include the probe
            :data:`PROBE`, whose update is the noise alone).
        mechanism_of: Builds the run's :class:`Mechanism` from the probe's measured noise sd.
        sampled: The records (or units) in the step.
        sketch_dim: ``k`` of the sketched norms, or None for exact norms.
        removed: The index of ``D``'s last record (or unit).

    Returns:
        The release (the probe excluded from ``noisy_sum``).
    """
    after = trainable(model)
    probe = {n: before[n] - after[n] for n in before if n.startswith(PROBE + ".")}
    flat = torch.cat([d.flatten() for d in probe.values()])
    mechanism = mechanism_of(float(flat.pow(2).mean().sqrt()))
    if mechanism.noise_multiplier == 0:
        mechanism = Mechanism(**{**mechanism.__dict__, "noise_sd": math.nan})
    noisy_sum = {
        n: (before[n] - after[n]) * mechanism.divisor
        for n in before
        if not n.startswith(PROBE + ".")
    }
    return Release(mechanism, noisy_sum, tuple(sorted(sampled)), sketch_dim, removed)


def _engine_mechanism(engine: Any, loader: Any, optimizer: Any, sample_rate: float) -> Callable:
    [(sigma, q, steps, _spec)] = [tuple(h) for h in engine.accountant.history]

    def of(noise_sd: float) -> Mechanism:
        return Mechanism(
            sample_rate=float(sample_rate),
            accounted_rate=float(q),
            accounted_steps=int(steps),
            steps_per_epoch=len(loader),
            divisor=float(optimizer.expected_batch_size),
            noise_multiplier=float(optimizer.noise_multiplier),
            max_grad_norm=float(optimizer.max_grad_norm),
            noise_sd=noise_sd,
        )

    return of


def _make_private(
    model: nn.Module,
    loader: DataLoader,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    sketch_dim: int,
    dataset_size: int | None,
) -> tuple[PrivacyEngine, Any, Any, Any, Any]:
    engine = PrivacyEngine(accountant="rc")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="a sketch_generator was passed")
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message="noise_multiplier=0")
        m, opt, crit, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            clipping="randomized",
            sketch_dim=sketch_dim,
            sketch_generator=torch.Generator().manual_seed(3),
            noise_generator=torch.Generator().manual_seed(2),
            dataset_size=dataset_size,
        )
    return engine, m, opt, crit, dl


# ---------------------------------------------------------------------------------------------
# Engine, per record
# ---------------------------------------------------------------------------------------------

#: Records of the per-record engine paths: ``N = 8`` at batch size 4 (``q = 1 / ceil(8 / 4) =
#: 1 / ceil(7 / 4) = 1/2``); the public size is 8 for both.
N_RECORDS = 8
BATCH = 4
#: The loader's seed: the first Poisson batch holds the last record (checked by the test).
LOADER_SEED = 1


class Indexed(Dataset):
    """A list of items, each returned with its index."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.items[i], i


def _mlp_items(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N_RECORDS, 6, generator=g), torch.randint(0, 3, (N_RECORDS,), generator=g)
    return [(x[i], y[i]) for i in range(n)]


def _collate_pairs(rows: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not rows:
        return torch.zeros(0, 6), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return (
        torch.stack([r[0][0] for r in rows]),
        torch.stack([r[0][1] for r in rows]),
        torch.tensor([r[1] for r in rows]),
    )


def run_engine_mlp(*, neighbour: bool, noise_multiplier: float, public_size: bool) -> Release:
    """The engine on a small MLP of ``nn.Linear`` (exact norms, see :class:`MLP`)."""
    n = N_RECORDS - int(neighbour)
    model = MLP()
    loader = DataLoader(
        Indexed(_mlp_items(n)),
        batch_size=BATCH,
        collate_fn=_collate_pairs,
        generator=torch.Generator().manual_seed(LOADER_SEED),
    )
    engine, m, opt, crit, dl = _make_private(
        model,
        loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=C_MLP,
        sketch_dim=2,
        dataset_size=N_RECORDS if public_size else None,
    )
    before = trainable(m)
    x, y, idx = next(iter(dl))
    crit(m(x), y).backward()
    opt.step()
    return release_of_sgd_step(
        before,
        m,
        _engine_mechanism(engine, dl, opt, dl.sample_rate),
        idx.tolist(),
        None,
        N_RECORDS - 1,
    )


# Tiny language models through the engine, with the position ids the user computes.

LM_VOCAB = 64
PAD = 0


def lm_examples(n: int) -> list[list[int]]:
    """``n`` token sequences; the last of the ``N_RECORDS`` is the longest (12 tokens), so
    that removing it changes the others' padding."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(N_RECORDS):
        length = 12 if i == N_RECORDS - 1 else int(torch.randint(4, 9, (1,), generator=g))
        out.append(torch.randint(3, LM_VOCAB, (length,), generator=g).tolist())
    return out[:n]


def pad_batch(
    rows: Sequence[Sequence[int]], *, side: str, ignore_pad_targets: bool = False
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` (``-100`` on padding), padded on
    ``side`` (``"right"`` or ``"left"``); no ``position_ids``.

    With ``ignore_pad_targets``, a label whose preceding position is padding is ``-100`` too:
    under left padding the last pad position's logit would otherwise predict the first real
    token (the causal shift), a target computed from a pad's hidden state, which depends on the
    batch's padding (``DataCollatorForLanguageModeling`` does not do this).
    """
    t = max((len(r) for r in rows), default=1)
    ids = torch.full((len(rows), t), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(t - len(r), t)
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        mask[i, sl] = 1
    labels = ids.masked_fill(mask == 0, -100)
    if ignore_pad_targets:
        labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lm_model(arch: str) -> tuple[nn.Module, int | None]:
    """A tiny random LM with the probe, and the ``k`` of its sketched norms (None: exact).

    ``"gpt2"``: learned absolute positions, every norm exact (``Conv1D`` by functorch,
    embeddings, layer norms; the LM head untied and frozen). ``"llama"``: rotary positions,
    tied embedding and head, ``nn.Linear`` layers sketched at ``k = LARGE_K``.
    ``"llama-varlen"``: that Llama with ``opacus_rc.packed_attention``'s varlen
    SDPA (each record segment attended alone, the records from the position ids).
    ``"llama-untied"``: the same Llama with an untied, trainable LM head (every hooked layer an
    ``nn.Linear``, ``nn.Embedding`` or RMSNorm: a checkpoint's recomputation may stop early,
    opacus_rc/grad_sample/checkpointing.py).
    """
    import tiny_hf_models as hf

    if arch == "gpt2":
        model = hf.gpt2(
            vocab=LM_VOCAB, tie=False, seed=0, pad_token_id=PAD, bos_token_id=1, eos_token_id=2
        )
        model.lm_head.weight.requires_grad_(False)
        k = None
    else:
        tie = arch != "llama-untied"
        model = hf.llama(vocab=LM_VOCAB, tie=tie, intermediate_size=32, seed=0, pad_token_id=PAD)
        k = LARGE_K
        if arch == "llama-varlen":  # the varlen SDPA over records (no 4D mask)
            from opacus_rc.packed_attention import register_packed_sdpa

            model.set_attn_implementation(register_packed_sdpa())
    return add_probe(model), k


def run_engine_lm(
    arch: str,
    side: str,
    ignore_pad_targets: bool = True,
    checkpointing: bool = False,
    *,
    neighbour: bool,
    noise_multiplier: float,
    public_size: bool,
) -> Release:
    """The engine on a tiny HF LM, padded on ``side``, ``position_ids`` from the mask (what a
    user of the engine passes), and, with ``ignore_pad_targets``, no target predicted from a
    pad position (:func:`pad_batch`); with ``checkpointing``, HF's non-reentrant
    ``gradient_checkpointing_enable()``."""
    n = N_RECORDS - int(neighbour)
    model, k = lm_model(arch)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def collate(rows: list) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        batch = pad_batch([r[0] for r in rows], side=side, ignore_pad_targets=ignore_pad_targets)
        batch["position_ids"] = left_position_ids(batch["attention_mask"])
        return batch, torch.tensor([r[1] for r in rows], dtype=torch.long)

    loader = DataLoader(
        Indexed(lm_examples(n)),
        batch_size=BATCH,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(LOADER_SEED),
    )
    engine, m, opt, crit, dl = _make_private(
        model,
        loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=C_LM,
        sketch_dim=k or 2,
        dataset_size=N_RECORDS if public_size else None,
    )
    before = trainable(m)
    batch, idx = next(iter(dl))
    labels = batch.pop("labels")
    logits = m(**batch).logits
    per_sample_cross_entropy(crit, logits, labels, shift=True).backward()
    opt.step()
    return release_of_sgd_step(
        before,
        m,
        _engine_mechanism(engine, dl, opt, dl.sample_rate),
        idx.tolist(),
        k,
        N_RECORDS - 1,
    )


#: Rows of the packed paths: the 12-token last record is cut across two rows.
PACK_LENGTH = 10


def run_engine_packed(
    arch: str,
    padding_free: bool = False,
    *,
    neighbour: bool,
    noise_multiplier: float,
    public_size: bool,
) -> Release:
    """The engine on a tiny HF LM with the sampled records packed into rows of
    :data:`PACK_LENGTH` tokens (``opacus_rc.packing.pack_records``: several records per row,
    the last record cut across rows), a block-diagonal 4D mask (or, ``padding_free``, none:
    restarting ``position_ids`` keep records apart) and the criterion's ``record_ids=``
    (per-record clipping inside packed rows, issue 32)."""
    from opacus_rc.packing import pack_records

    n = N_RECORDS - int(neighbour)
    model, k = lm_model(arch)

    def collate(rows: list) -> tuple[Any, torch.Tensor]:
        packed = pack_records([r[0] for r in rows], max_length=PACK_LENGTH, pad_token_id=PAD)
        return packed, torch.tensor([r[1] for r in rows], dtype=torch.long)

    loader = DataLoader(
        Indexed(lm_examples(n)),
        batch_size=BATCH,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(LOADER_SEED),
    )
    engine, m, opt, crit, dl = _make_private(
        model,
        loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=C_LM,
        sketch_dim=k or 2,
        dataset_size=N_RECORDS if public_size else None,
    )
    before = trainable(m)
    packed, idx = next(iter(dl))
    inputs = packed.model_inputs(padding_free=padding_free)
    labels = inputs.pop("labels")
    logits = m(**inputs).logits
    r, t = labels.shape
    crit(
        logits[:, :-1].reshape(r * (t - 1), -1),
        labels[:, 1:].reshape(-1),
        shape=(r, t - 1),
        record_ids=packed.record_ids,
    ).backward()
    opt.step()
    return release_of_sgd_step(
        before,
        m,
        _engine_mechanism(engine, dl, opt, dl.sample_rate),
        idx.tolist(),
        k,
        N_RECORDS - 1,
    )


#: Records of the packed-units path: 8 units of 1-3 records; the last unit's 12-token record
#: is cut across two rows of :data:`PACK_LENGTH`.
PACKED_UNIT_SIZES = [2, 1, 3, 1, 2, 3, 1, 2]
PACKED_UNIT_RATE = 0.5
PACKED_UNIT_SEED = 2


def run_engine_packed_units(
    *, neighbour: bool, noise_multiplier: float, public_size: bool
) -> Release:
    """A :class:`~opacus_rc.units.UnitDataLoader` of records (a user's several records) whose
    collate function packs the sampled records (``opacus_rc.packing.PackingCollator``), GPT-2
    (every norm exact) and the criterion's ``record_ids=`` with ``units=``: each unit clipped
    once inside packed rows (issue 32); the last unit removed. The divisor is the loader's
    public ``expected_batch_size``."""
    from opacus_rc.packing import PackingCollator

    sizes = PACKED_UNIT_SIZES[:-1] if neighbour else PACKED_UNIT_SIZES
    unit_of = [u for u, n in enumerate(sizes) for _ in range(n)]
    g = torch.Generator().manual_seed(6)
    items = []
    for i in range(len(unit_of)):
        length = (
            12 if i == sum(PACKED_UNIT_SIZES) - 1 else int(torch.randint(3, 9, (1,), generator=g))
        )
        ids = torch.randint(3, LM_VOCAB, (length,), generator=g).tolist()
        items.append({"input_ids": ids, "index": i})
    model, k = lm_model("gpt2")
    pack = PackingCollator(max_length=PACK_LENGTH, pad_token_id=PAD)

    def collate(rows: list) -> dict[str, torch.Tensor]:
        return {**pack(rows), "index": torch.tensor([r["index"] for r in rows])}

    loader = UnitDataLoader(
        items,
        unit_of=unit_of,
        sample_rate=PACKED_UNIT_RATE,
        generator=torch.Generator().manual_seed(PACKED_UNIT_SEED),
        expected_batch_size=4,
        collate_fn=collate,
    )
    engine, m, opt, crit, dl = _make_private(
        model,
        loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=C_LM,
        sketch_dim=2,
        dataset_size=None,  # the divisor: the loader's public expected_batch_size
    )
    before = trainable(m)
    batch = next(iter(dl))
    labels = batch.pop("labels")
    record_ids, units = batch.pop("record_ids"), batch.pop("units")
    del batch["record_units"]
    sampled = sorted({unit_of[i] for i in batch.pop("index").tolist()})
    logits = m(**batch).logits
    r, t = labels.shape
    crit(
        logits[:, :-1].reshape(r * (t - 1), -1),
        labels[:, 1:].reshape(-1),
        shape=(r, t - 1),
        record_ids=record_ids,
        units=units,
    ).backward()
    opt.step()
    return release_of_sgd_step(
        before,
        m,
        _engine_mechanism(engine, dl, opt, dl.sample_rate),
        sampled,
        k,
        len(PACKED_UNIT_SIZES) - 1,
    )


# ---------------------------------------------------------------------------------------------
# Engine, units (UnitDataLoader and the criterion's units=)
# ---------------------------------------------------------------------------------------------

#: ``U = 12`` units of 1-3 sequences each, contiguous, the last one last; ``q = 1/4``: the
#: divisor is ``int(12 / 4) = 3`` and, for the neighbour without a public size,
#: ``int(11 / 4) = 2`` (issue 30).
UNIT_SIZES = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]
UNIT_RATE = 0.25
UNIT_SEED = 4


def _unit_data(neighbour: bool) -> tuple[list, list[int]]:
    sizes = UNIT_SIZES[:-1] if neighbour else UNIT_SIZES
    unit_of = [u for u, s in enumerate(sizes) for _ in range(s)]
    g = torch.Generator().manual_seed(0)
    n_all = sum(UNIT_SIZES)
    x = torch.randint(0, V, (n_all, T), generator=g)
    y = torch.randint(0, V, (n_all, T), generator=g)
    return [(x[i], y[i], torch.tensor(i)) for i in range(len(unit_of))], unit_of


def run_units(mode: str, *, neighbour: bool, noise_multiplier: float, public_size: bool) -> Release:
    """The engine with a unit loader and the criterion's ``units=``, on :class:`TokenModel`.

    ``mode``: ``"whole"`` (one physical batch), ``"virtual"`` (``UnitBatchMemoryManager``,
    physical batches of whole units), ``"split"`` (``split_units=True``: units cut across
    physical batches of 2 sequences) or ``"distributed-w1"`` (``DistributedUnitDataLoader``
    with one replica).
    """
    items, unit_of = _unit_data(neighbour)
    model = TokenModel()
    cls = DistributedUnitDataLoader if mode == "distributed-w1" else UnitDataLoader
    extra = {"num_replicas": 1, "rank": 0} if mode == "distributed-w1" else {}
    loader = cls(
        items,
        unit_of=unit_of,
        sample_rate=UNIT_RATE,
        generator=torch.Generator().manual_seed(UNIT_SEED),
        **extra,
    )
    engine, m, opt, crit, dl = _make_private(
        model,
        loader,
        noise_multiplier=noise_multiplier,
        max_grad_norm=C_TOKENS,
        sketch_dim=2,
        dataset_size=len(UNIT_SIZES) if public_size else None,
    )
    before = trainable(m)
    sampled: set[int] = set()

    def backward(x, y, idx, units, split=None) -> None:
        out = m(x)
        sampled.update(unit_of[i] for i in idx.tolist())
        kw = {} if split is None else {"unit_split": split}
        crit(out.reshape(-1, V), y.reshape(-1), shape=out.shape, units=units, **kw).backward()

    if mode in ("whole", "distributed-w1"):
        backward(*next(iter(dl)))
        opt.step()
    else:
        with UnitBatchMemoryManager(
            data_loader=dl,
            max_physical_batch_size=2 if mode == "split" else 3,
            optimizer=opt,
            split_units=mode == "split",
        ) as mem:
            for batch in mem:
                backward(*batch)
                opt.step()  # accumulates, except at the last physical batch of the step
                opt.zero_grad()
                if len(engine.accountant.history):  # the first logical step is taken
                    break
    return release_of_sgd_step(
        before,
        m,
        _engine_mechanism(engine, dl, opt, dl.sample_rate),
        sorted(sampled),
        None,
        len(UNIT_SIZES) - 1,
    )


# ---------------------------------------------------------------------------------------------
# Trainers
# ---------------------------------------------------------------------------------------------

SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "weight_decay": 0.0}
TRAINER_SEED = 5  # the first Poisson batch holds records 1, 3, 4 and the last, 7


def _trainer_mechanism(tr: Any) -> Callable[[float], Mechanism]:
    engine, opt, sampler = tr.privacy_engine, tr.dp_optimizer, tr._poisson_sampler
    [(sigma, q, steps, _spec)] = [tuple(h) for h in engine.accountant.history]

    def of(noise_sd: float) -> Mechanism:
        return Mechanism(
            sample_rate=float(sampler.sample_rate),
            accounted_rate=float(q),
            accounted_steps=int(steps),
            steps_per_epoch=int(sampler.steps),
            divisor=float(opt.expected_batch_size),
            noise_multiplier=float(opt.noise_multiplier),
            max_grad_norm=float(opt.max_grad_norm),
            noise_sd=noise_sd,
        )

    return of


def _first_batch_rows(tr: Any) -> list[int]:
    """The rows of the first logical batch, re-drawn from the trainer's sampler (epoch 0)."""
    sampler = tr._poisson_sampler
    sampler.set_epoch(0)
    return list(next(iter(sampler)))


def _train_one_step(tr: Any, k: int | None, unit_of: Sequence[int] | None = None) -> Release:
    """Train ``tr`` for its one step and return the release (``D``'s last record: index 7)."""
    import transformers

    tr.remove_callback(transformers.PrinterCallback)  # the logs are not checked here
    before = trainable(tr.model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
        warnings.filterwarnings("ignore", message="PrivacyArguments.sketch_seed")
        warnings.filterwarnings("ignore", message="noise_multiplier=0")
        warnings.filterwarnings("ignore", message="RCAccountant recorded a step without noise")
        tr.train()
    rows = _first_batch_rows(tr)
    sampled = rows if unit_of is None else sorted({unit_of[i] for i in rows})
    return release_of_sgd_step(before, tr.model, _trainer_mechanism(tr), sampled, k, N_RECORDS - 1)


def _trainer_args(tmp: str, **overrides: Any) -> Any:
    import trainer_helpers as th

    kw = {"max_steps": 1, "per_device_train_batch_size": N_RECORDS, "logging_steps": 100, **SGD}
    kw.update(overrides)
    return th.training_args(Path(tmp), **kw)


def run_trainer(
    arch: str,
    side: str,
    mask_positions: bool = False,
    *,
    neighbour: bool,
    noise_multiplier: float,
    public_size: bool,
) -> Release:
    """``DPTrainer`` on a tiny HF LM, a padding collator on ``side`` whose labels are the input
    ids with ``-100`` on padding (as ``DataCollatorForLanguageModeling``), one micro-batch
    holding the whole logical batch. No ``position_ids`` (the Trainer's own), or, with
    ``mask_positions``, the collator's from the attention mask."""
    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments

    n = N_RECORDS - int(neighbour)
    model, k = lm_model(arch)
    data = [{"input_ids": ids} for ids in lm_examples(n)]

    def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = pad_batch([r["input_ids"] for r in rows], side=side)
        if mask_positions:
            batch["position_ids"] = left_position_ids(batch["attention_mask"])
        return batch

    with tempfile.TemporaryDirectory() as tmp:
        tr = DPTrainer(
            model=model,
            args=_trainer_args(tmp),
            train_dataset=data,
            data_collator=collate,
            privacy_args=PrivacyArguments(
                noise_multiplier=noise_multiplier,
                target_delta=1e-3,
                max_grad_norm=C_LM,
                expected_batch_size=BATCH,
                sketch_dim=k or 2,
                sketch_seed=3 if k else None,
                seed=TRAINER_SEED,
                dataset_size=N_RECORDS if public_size else None,
            ),
        )
        return _train_one_step(tr, k)


def run_trainer_units(
    packed: bool = False, *, neighbour: bool, noise_multiplier: float, public_size: bool
) -> Release:
    """``DPTrainer`` with ``privacy_unit`` on GPT-2 (exact norms); the last unit removed. With
    ``packed``, a ``PackingCollator``: each sampled unit's records packed into rows of 16
    tokens, in one micro-batch, and clipped together (``units=`` over records)."""
    from opacus_rc.integrations.packed_batches import packing_mask_dtype
    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments
    from opacus_rc.packing import PackingCollator

    sizes = [1, 2, 1, 2, 1, 2, 1, 2][: N_RECORDS - int(neighbour)]
    seqs = lm_examples(N_RECORDS) * 2
    unit_of = [u for u, s in enumerate(sizes) for _ in range(s)]
    data = [{"input_ids": seqs[i], "doc": f"doc-{u}"} for i, u in enumerate(unit_of)]
    model, k = lm_model("gpt2")
    with tempfile.TemporaryDirectory() as tmp:
        tr = DPTrainer(
            model=model,
            args=_trainer_args(tmp, per_device_train_batch_size=16),
            train_dataset=data,
            data_collator=(
                PackingCollator(
                    max_length=16, pad_token_id=PAD, mask_dtype=packing_mask_dtype(model)
                )
                if packed
                else lambda rows: pad_batch([r["input_ids"] for r in rows], side="right")
            ),
            privacy_args=PrivacyArguments(
                noise_multiplier=noise_multiplier,
                target_delta=1e-3,
                max_grad_norm=C_LM,
                expected_batch_size=BATCH,
                seed=TRAINER_SEED,
                dataset_size=N_RECORDS if public_size else None,
                privacy_unit="doc",
            ),
        )
        return _train_one_step(tr, k, unit_of)


def _word_tokenizer() -> Any:
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(LM_VOCAB - 3)]
    wl = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(wl)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def run_sft(
    packing: bool = False,
    bf16: bool = False,
    *,
    neighbour: bool,
    noise_multiplier: float,
    public_size: bool,
) -> Release:
    """``DPSFTTrainer`` (TRL) on GPT-2 (exact norms), text rows tokenized by TRL; with
    ``packing``, ``packing=True``: the sampled records packed into rows of 16 tokens; with
    ``bf16``, TRL's default ``bf16=True`` (accelerate's bfloat16 autocast inside the model's
    forward)."""
    import datasets
    import trl

    datasets.disable_progress_bars()

    from opacus_rc.integrations.trl import DPSFTTrainer, PrivacyArguments

    n = N_RECORDS - int(neighbour)
    text = [" ".join(f"w{t - 3}" for t in ids) for ids in lm_examples(n)]
    model, k = lm_model("gpt2")
    with tempfile.TemporaryDirectory() as tmp:
        config = trl.SFTConfig(
            output_dir=str(Path(tmp) / "out"),
            per_device_train_batch_size=N_RECORDS,
            max_steps=1,
            logging_steps=100,
            save_strategy="no",
            report_to=[],
            max_grad_norm=0.0,
            use_cpu=True,
            disable_tqdm=True,
            bf16=bf16,
            gradient_checkpointing=False,
            dataloader_pin_memory=False,
            max_length=16,
            packing=packing,
            **SGD,
        )
        tr = DPSFTTrainer(
            model=model,
            args=config,
            train_dataset=datasets.Dataset.from_dict({"text": text}),
            processing_class=_word_tokenizer(),
            privacy_args=PrivacyArguments(
                noise_multiplier=noise_multiplier,
                target_delta=1e-3,
                max_grad_norm=C_LM,
                expected_batch_size=BATCH,
                seed=TRAINER_SEED,
                dataset_size=N_RECORDS if public_size else None,
            ),
        )
        return _train_one_step(tr, k)


def run_trainer_packed(
    arch: str, padding_free: bool = False, *, neighbour: bool, noise_multiplier: float,
    public_size: bool,
) -> Release:  # fmt: skip
    """``DPTrainer`` with a ``PackingCollator``: each logical batch's sampled records packed
    into rows of 16 tokens (several records a row; the block-diagonal mask, or none with
    ``padding_free``), clipped per record; one micro-batch of at most ``N_RECORDS`` rows."""
    from opacus_rc.integrations.packed_batches import packing_mask_dtype
    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments
    from opacus_rc.packing import PackingCollator

    n = N_RECORDS - int(neighbour)
    model, k = lm_model(arch)
    data = [{"input_ids": ids} for ids in lm_examples(n)]
    collator = PackingCollator(
        max_length=16,
        pad_token_id=PAD,
        padding_free=padding_free,
        mask_dtype=packing_mask_dtype(model),
    )
    with tempfile.TemporaryDirectory() as tmp:
        tr = DPTrainer(
            model=model,
            args=_trainer_args(tmp),
            train_dataset=data,
            data_collator=collator,
            privacy_args=PrivacyArguments(
                noise_multiplier=noise_multiplier,
                target_delta=1e-3,
                max_grad_norm=C_LM,
                expected_batch_size=BATCH,
                sketch_dim=k or 2,
                sketch_seed=3 if k else None,
                seed=TRAINER_SEED,
                dataset_size=N_RECORDS if public_size else None,
            ),
        )
        return _train_one_step(tr, k)


def _bind(fn: Callable, *args: Any) -> Callable[..., Release]:
    def run(*, neighbour: bool, noise_multiplier: float, public_size: bool) -> Release:
        return fn(
            *args, neighbour=neighbour, noise_multiplier=noise_multiplier, public_size=public_size
        )

    return run


#: Every single-process path: ``name -> (run, has_public_size)``. ``has_public_size``: the
#: path takes a public number of records (``make_private``'s ``dataset_size``, the Trainers'
#: ``PrivacyArguments.dataset_size``; their divisor is ``expected_batch_size`` either way).
PATHS: dict[str, tuple[Callable[..., Release], bool]] = {
    "engine-mlp": (run_engine_mlp, True),
    "engine-gpt2-right": (_bind(run_engine_lm, "gpt2", "right"), True),
    "engine-gpt2-left": (_bind(run_engine_lm, "gpt2", "left"), True),
    "engine-gpt2-left-pad-target": (_bind(run_engine_lm, "gpt2", "left", False), True),
    "engine-llama-right": (_bind(run_engine_lm, "llama", "right"), True),
    "engine-llama-left": (_bind(run_engine_lm, "llama", "left"), True),
    "engine-llama-untied-checkpointed": (
        _bind(run_engine_lm, "llama-untied", "right", True, True),
        True,
    ),
    "engine-packed-gpt2": (_bind(run_engine_packed, "gpt2"), True),
    "engine-packed-llama": (_bind(run_engine_packed, "llama"), True),
    "engine-packed-llama-padding-free": (_bind(run_engine_packed, "llama", True), True),
    "engine-packed-llama-varlen": (_bind(run_engine_packed, "llama-varlen", True), True),
    "engine-packed-units": (run_engine_packed_units, False),
    "engine-units": (_bind(run_units, "whole"), True),
    "unit-loader-virtual": (_bind(run_units, "virtual"), True),
    "unit-split": (_bind(run_units, "split"), True),
    "distributed-unit-loader-w1": (_bind(run_units, "distributed-w1"), True),
    "trainer-gpt2-right": (_bind(run_trainer, "gpt2", "right"), True),
    "trainer-gpt2-left": (_bind(run_trainer, "gpt2", "left"), True),
    "trainer-gpt2-left-mask-positions": (_bind(run_trainer, "gpt2", "left", True), True),
    "trainer-llama-right": (_bind(run_trainer, "llama", "right"), True),
    "trainer-llama-left": (_bind(run_trainer, "llama", "left"), True),
    "sft-trainer": (run_sft, True),
    "trainer-privacy-unit": (run_trainer_units, True),
    "trainer-packed-gpt2": (_bind(run_trainer_packed, "gpt2"), True),
    "trainer-packed-llama": (_bind(run_trainer_packed, "llama"), True),
    "trainer-padding-free-llama": (_bind(run_trainer_packed, "llama", True), True),
    "trainer-packed-llama-varlen": (_bind(run_trainer_packed, "llama-varlen", True), True),
    "sft-trainer-packing": (_bind(run_sft, True), True),
    "sft-trainer-bf16": (_bind(run_sft, False, True), True),
    "sft-trainer-packing-bf16": (_bind(run_sft, True, True), True),
    "trainer-packed-privacy-unit": (_bind(run_trainer_units, True), True),
}
