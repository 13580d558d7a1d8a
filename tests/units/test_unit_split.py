"""A unit cut across the physical batches of one logical batch (issue 23, item 2: virtual
steps within a unit; docs/privacy/units.md#units-split).

Oracle: a float64 copy of the model, one autograd call per unit of the sum of its sequences'
losses (each the mean over its tokens, as the DP criterion's per-sequence loss with
``shape=``): the unit's summed gradient ``g_u``. The released (noiseless) update must be
``sum_u c_u g_u`` with ``c_u = min(1, C / (n_hat_u + 1e-6))``, ``n_hat_u`` the module's norm
of the *whole* unit, whatever the cut.

Tolerances. ``RTOL = 0.06`` for a sketched norm at ``k = 4096``: a Hutchinson estimate of a
squared norm has relative variance ``2 sum s_i^4 / (k (sum s_i^2)^2) <= 2 / k``, so the norm
has relative standard deviation ``<= sqrt(2 / k) / 2 = 0.011`` and 0.06 is more than five of
them (the same derivation as tests/units/test_unit_clipping.py). Each norm check is paired
with the norm of the unit's *last physical part only* (what clipping the parts separately
would use), which is off by far more than ``RTOL``: the checks can fail. Updates computed with
the module's own factors are compared at float32 round-off (``rtol=1e-4``). The moment test of
the estimator's law derives its tolerance in its docstring.
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import TensorDataset

from opacus_rc import PrivacyEngine, UnitDataLoader
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.grad_sample.private_step import StepProtocolError
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer
from opacus_rc.sketching import hutchinson_sqnorm
from opacus_rc.units import UnitBatchMemoryManager, UnitSplit, split_at_size
from opacus_rc.units.split import _summed_gradient_norm

pytestmark = [
    pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning"),
    pytest.mark.filterwarnings("ignore:noise_multiplier=0"),
    pytest.mark.filterwarnings("ignore:RCAccountant recorded a step without noise"),
    pytest.mark.filterwarnings("ignore:torch.utils.checkpoint"),
]

K = 4096
RTOL = 0.06  # > 5 standard deviations of a sketched norm at k = 4096 (module docstring)
V, T, C = 13, 6, 5
#: Units of 2, 8 and 3 sequences, contiguous; cut into physical batches of 3 this gives
#: [0 0 1] [1 1 1] [1 1 1] [1 2 2] [2]: unit 1 opens, stays open over a batch of its own,
#: closes in a batch where unit 2 opens, which closes alone.
UNITS = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2])
PHYSICAL = 3


class TokenModel(nn.Module):
    """Embedding (padding_idx) -> LayerNorm -> Linear -> Linear head: exact and sketched
    routes. With ``checkpointed``, the middle layers run in a torch.utils.checkpoint region."""

    def __init__(self, *, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, C)
        self.checkpointed = checkpointed

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mid(self.norm(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = checkpoint(self.body, h, use_reentrant=False) if self.checkpointed else self.body(h)
        return self.head(h)


def data(B: int = len(UNITS), seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    x[0, -2:] = 0  # padding ids
    y = torch.randint(0, C, (B, T), generator=g)
    x[5], y[5] = x[3], y[3]  # a repeated sequence inside unit 1: large cross terms
    return x, y


def unit_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, units: torch.Tensor) -> Any:
    """``(U, P)`` float64 summed gradient of each unit (one autograd call per unit)."""
    ref = copy.deepcopy(model).double()
    ref.checkpointed = False
    params = [p for p in ref.parameters() if p.requires_grad]
    rows = []
    for u in range(int(units.max()) + 1):
        idx = torch.nonzero(units == u).flatten()
        out = ref(x[idx])
        loss = (
            nn.functional.cross_entropy(out.reshape(-1, C), y[idx].reshape(-1), reduction="none")
            .view(len(idx), T)
            .mean(dim=1)
            .sum()
        )
        grads = torch.autograd.grad(loss, params)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def private(
    model: nn.Module,
    *,
    bookkeeping: Any = True,
    k: int = K,
    c: float = 0.5,
    seed: int = 0,
    **options: Any,
) -> tuple[Any, Any, Any]:
    m = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=c,
        sketch_dim=k,
        sketch_generator=torch.Generator().manual_seed(seed),
        bookkeeping=bookkeeping,
        **options,
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        grad_sample_module=m,
        noise_multiplier=0.0,
        expected_batch_size=1,
    )
    crit = DPLossRandomizedClipping(m, opt, nn.CrossEntropyLoss(), "mean")
    return m, opt, crit


def cuts(units: torch.Tensor, size: int) -> list[tuple[slice, torch.Tensor, UnitSplit]]:
    """The physical batches of ``units`` (contiguous) at ``size``: positions, relabelled
    units and the cut, written out independently of the loader."""
    out = []
    for lo, hi in split_at_size(units.tolist(), max_batch_size=size):
        part = units[lo:hi]
        first, last = int(part[0]), int(part[-1])
        continued = lo > 0 and int(units[lo - 1]) == first
        continues = hi < len(units) and int(units[hi]) == last
        out.append((slice(lo, hi), part - first, UnitSplit(continued, continues)))
    return out


def run_split(m, opt, crit, x, y, units, size: int) -> dict[int, torch.Tensor]:
    """Virtual steps over the physical batches (step() after each, the last one not
    skipped); returns each unit's reported norm (from the batch where it closes)."""
    batches = cuts(units, size)
    norms: dict[int, torch.Tensor] = {}
    for i, (pos, part, split) in enumerate(batches):
        opt.signal_skip_step(do_skip=i < len(batches) - 1)
        out = m(x[pos])
        loss = crit(
            out.reshape(-1, C), y[pos].reshape(-1), shape=out.shape, units=part, unit_split=split
        )
        loss.backward()
        reported = m.per_sample_gradient_norms
        assert reported.shape == (int(part.max()) + 1,)
        assert torch.isnan(reported[-1]).item() == split.continues  # open: not known yet
        used = opt.last_clip_result.clip_factors  # the factors the batch applied
        assert torch.isnan(used[-1]).item() == split.continues
        closed = ~torch.isnan(reported)
        want = (m.max_grad_norm / (reported[closed] + 1e-6)).clamp(max=1.0)
        torch.testing.assert_close(used[closed].double(), want, rtol=1e-6, atol=0)
        first = int(units[pos][0])
        for u in range(len(reported)):
            if not (split.continues and u == len(reported) - 1):
                norms[first + u] = reported[u].clone()
        opt.step()
        opt.zero_grad()
    return norms


def flat(model: nn.Module) -> torch.Tensor:
    """The trainable parameters, flattened (the oracle's order)."""
    return torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize(
    ("bookkeeping", "checkpointed"), [(True, False), ("always", False), (True, True)]
)
def test_a_unit_cut_into_physical_batches_gives_the_oracle_update(
    bookkeeping: Any, checkpointed: bool
) -> None:
    """Units of 2, 8 and 3 sequences in physical batches of 3 at sigma = 0: each unit's norm
    is that of its whole summed gradient (within RTOL of the oracle, not the norm of its last
    part), and the update is ``sum_u c_u g_u`` with those factors; with activation
    checkpointing too."""
    model = TokenModel(checkpointed=checkpointed)
    x, y = data()
    G = unit_grads(model, x, y, UNITS)
    oracle = G.norm(dim=1)
    last_part = unit_grads(model, x[12:13], y[12:13], torch.tensor([0])).norm(dim=1)
    assert abs(last_part[0] - oracle[2]) / oracle[2] > 3 * RTOL  # a wrong norm would fail
    before = flat(model)
    m, opt, crit = private(model, bookkeeping=bookkeeping)
    norms = run_split(m, opt, crit, x, y, UNITS, PHYSICAL)
    got = torch.stack([norms[u] for u in range(3)])
    torch.testing.assert_close(got, oracle, rtol=RTOL, atol=0)
    factors = (0.5 / (got + 1e-6)).clamp(max=1.0)
    assert factors.max() < 1  # every unit clipped: the factors matter
    want = (factors[:, None] * G).sum(0)
    torch.testing.assert_close((before - flat(model)).double(), want, rtol=1e-4, atol=1e-6)


def test_a_cut_unit_with_hutchpp_matches_the_oracle() -> None:
    """Hutch++ (an exact head of 4 directions plus a k-column Hutchinson tail, relative
    variance again <= 2 / k, so RTOL holds) on the cut unit's summed gradient: norms within
    RTOL of the oracle."""
    model = TokenModel()
    x, y = data()
    oracle = unit_grads(model, x, y, UNITS).norm(dim=1)
    m, opt, crit = private(model, sketch="hutch++", sketch_head_dim=4)
    norms = run_split(m, opt, crit, x, y, UNITS, PHYSICAL)
    got = torch.stack([norms[u] for u in range(3)])
    torch.testing.assert_close(got, oracle, rtol=RTOL, atol=0)


def test_cut_and_whole_units_give_the_same_step_at_large_k() -> None:
    """The same logical batch whole and cut at 3 (and at 1: every batch a single sequence):
    the same norms (each within 2 RTOL of the other, both sketched at k = 4096) and the same
    update (within the factors' difference)."""
    x, y = data()
    results = []
    for size in (len(UNITS), PHYSICAL, 1):
        model = TokenModel()
        before = flat(model)
        m, opt, crit = private(model, seed=size)
        norms = run_split(m, opt, crit, x, y, UNITS, size)
        results.append((torch.stack([norms[u] for u in range(3)]), before - flat(model)))
    for norms, update in results[1:]:
        torch.testing.assert_close(norms, results[0][0], rtol=2 * RTOL, atol=0)
        torch.testing.assert_close(update, results[0][1], rtol=2 * RTOL, atol=1e-3)
    assert results[0][1].abs().max() > 1e-2  # the step moved the parameters


@pytest.mark.parametrize("kind", ["sketched", "tied"])
def test_the_norm_of_a_cut_unit_has_the_law_of_the_batch_sketch(kind: str) -> None:
    """The sketched norm of a cut unit (taken from its summed gradient ``M``) and the batch
    path's (from its factors, ``M = G^T A``: the module's estimator for an ``nn.Linear``
    weight, the ``d``-side sketch for a tied weight) have the same law, that of ``n_hat =
    sum_i s_i^2 X_i / k`` with ``X_i`` iid chi2_k and ``s`` the singular values of ``M``: mean
    ``||M||_F^2``, variance ``(2 / k) sum s_i^4``.

    Tolerance: with ``N = 4000`` draws at ``k = 4`` the sample mean has standard error
    ``sqrt(var / N)``, and the sample variance a relative standard error of
    ``sqrt((kappa + 2) / N) <= sqrt(5 / N) = 0.035`` (``kappa <= 12 / k = 3`` the excess
    kurtosis of a chi2_k / k mixture); both are checked within 5 of them. A sketch with twice
    the columns (variance halved) or an exact norm (variance 0) fails by far."""
    g = torch.Generator().manual_seed(0)
    A = torch.randn(1, 20, 7, generator=g, dtype=torch.float64)
    G = torch.randn(1, 20, 5, generator=g, dtype=torch.float64)
    M = (G[0].t() @ A[0]).float()
    s = torch.linalg.svdvals(M.double())
    mean, var = float(s.pow(2).sum()), 2 / 4 * float(s.pow(4).sum())
    n, k = 4000, 4
    weight = nn.Parameter(M.clone())
    gen = torch.Generator().manual_seed(1)
    side = "input" if kind == "tied" else "auto"
    batch = hutchinson_sqnorm(
        A.expand(n, -1, -1), G.expand(n, -1, -1), sketch_dim=k, generator=gen, side=side
    )
    cut = torch.stack(
        [
            _summed_gradient_norm(
                {weight: M},
                kinds={id(weight): kind},
                estimator=hutchinson_sqnorm,
                sketch_dim=k,
                generator_for=lambda _d: gen,
            ).square()
            for _ in range(n)
        ]
    )
    for draws in (batch, cut):
        assert abs(float(draws.mean()) - mean) < 5 * math.sqrt(var / n)
        assert abs(float(draws.var()) / var - 1) < 5 * math.sqrt(5 / n)


def test_an_open_unit_at_the_end_of_the_logical_step_is_refused() -> None:
    """step() that ends the logical batch (not skipped) while a unit is open raises before
    anything is noised, accounted or applied; the open unit is dropped, so the next batch may
    not continue it either."""
    model = TokenModel()
    x, y = data()
    m, opt, crit = private(model)
    before = flat(model)
    out = m(x[:3])
    crit(
        out.reshape(-1, C),
        y[:3].reshape(-1),
        shape=out.shape,
        units=torch.tensor([0, 0, 1]),
        unit_split=UnitSplit(False, True),
    ).backward()
    with pytest.raises(StepProtocolError, match="still open"):
        opt.step()
    torch.testing.assert_close(flat(model), before, rtol=0, atol=0)
    assert all(p.summed_grad is None for p in model.parameters())
    opt.zero_grad()
    out = m(x[3:6])
    with pytest.raises(ValueError, match="no unit is open"):
        crit(
            out.reshape(-1, C),
            y[3:6].reshape(-1),
            shape=out.shape,
            units=torch.tensor([0, 0, 0]),
            unit_split=UnitSplit(True, False),
        )


def test_a_batch_that_does_not_continue_the_open_unit_is_refused() -> None:
    model = TokenModel()
    x, y = data()
    m, opt, crit = private(model)
    opt.signal_skip_step(do_skip=True)
    out = m(x[:3])
    crit(
        out.reshape(-1, C),
        y[:3].reshape(-1),
        shape=out.shape,
        units=torch.tensor([0, 0, 1]),
        unit_split=UnitSplit(False, True),
    ).backward()
    opt.step()
    opt.zero_grad()
    out = m(x[3:6])
    with pytest.raises(ValueError, match="does not continue it"):
        crit(out.reshape(-1, C), y[3:6].reshape(-1), shape=out.shape, units=torch.tensor([0, 0, 0]))


def test_a_cut_unit_without_bookkeeping_is_refused() -> None:
    """Two backward passes cannot keep a unit's part (its clip factor is not known when the
    second pass runs): refused at the criterion, before any backward."""
    model = TokenModel()
    x, y = data()
    m, _opt, crit = private(model, bookkeeping=False)
    out = m(x[:3])
    with pytest.raises(NotImplementedError, match="needs book-keeping"):
        crit(
            out.reshape(-1, C),
            y[:3].reshape(-1),
            shape=out.shape,
            units=torch.tensor([0, 0, 1]),
            unit_split=UnitSplit(False, True),
        )


# ----------------------------------------------------------------------------------------------
# The loader: UnitBatchMemoryManager(split_units=True), sampling and accounting unchanged
# ----------------------------------------------------------------------------------------------


def sequences(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(1, V, (n, T), generator=g), torch.arange(n))


def test_the_manager_cuts_at_the_physical_size_and_says_where() -> None:
    unit_of = torch.tensor([u for u in range(6) for _ in range(1 + 2 * u)])  # 1, 3, ..., 11
    loader = UnitDataLoader(
        sequences(len(unit_of)),
        unit_of=unit_of,
        sample_rate=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(TokenModel().parameters(), lr=1.0),
        grad_sample_module=GradSampleModuleRandomizedClipping(TokenModel(), max_grad_norm=1.0),
        noise_multiplier=0.0,
        expected_batch_size=1,
    )
    with UnitBatchMemoryManager(
        data_loader=loader, max_physical_batch_size=4, optimizer=opt, split_units=True
    ) as mem:
        batches = list(mem)
    index = torch.cat([b[1] for b in batches])
    assert index.tolist() == list(range(36))  # every sequence once, in order
    assert [len(b[0]) for b in batches] == [4] * 9
    for (_, idx, units, split), (pos, part, want) in zip(batches, cuts(unit_of, 4)):
        assert split == want and torch.equal(units, part) and torch.equal(idx, index[pos])


def test_dict_batches_get_a_unit_split_key() -> None:
    class Dicts(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": torch.full((T,), i)}

    loader = UnitDataLoader(Dicts(), unit_of=[5, 5, 5, 6, 6], sample_rate=1.0)
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(TokenModel().parameters(), lr=1.0),
        grad_sample_module=GradSampleModuleRandomizedClipping(TokenModel(), max_grad_norm=1.0),
        noise_multiplier=0.0,
        expected_batch_size=1,
    )
    with UnitBatchMemoryManager(
        data_loader=loader, max_physical_batch_size=2, optimizer=opt, split_units=True
    ) as mem:
        batches = list(mem)
    assert [b["units"].tolist() for b in batches] == [[0, 0], [0, 1], [0]]
    assert [tuple(b["unit_split"]) for b in batches] == [
        (False, True),
        (True, True),
        (True, False),
    ]


def test_manager_split_run_equals_whole_units_and_accounts_the_same() -> None:
    """Poisson-sampled units of 1 to 7 sequences through the engine, exact norms only
    (embedding, layer norm: the probes cannot matter), clipped: physical batches of 2 cutting
    units give the update of whole-unit virtual steps to float round-off, and the same
    accountant history (same q, same sigma, same number of steps, same sketch spec)."""
    unit_of = torch.tensor([u for u in range(10) for _ in range(1 + u % 7)])
    results = []
    for split in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(V, C), nn.LayerNorm(C))
        loader = UnitDataLoader(
            sequences(len(unit_of)),
            unit_of=unit_of,
            sample_rate=0.5,
            generator=torch.Generator().manual_seed(4),
            expected_batch_size=5,  # public: 10 units at q = 0.5
        )
        engine = PrivacyEngine(accountant="rc")
        m, opt, crit, dl = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=0.05,
            clipping="randomized",
            criterion=nn.CrossEntropyLoss(),
        )
        cut = 0
        with UnitBatchMemoryManager(
            data_loader=dl,
            max_physical_batch_size=2 if split else 100,
            optimizer=opt,
            split_units=split,
        ) as mem:
            for x, index, units, *rest in mem:
                out = m(x)
                yy = (index[:, None] + torch.arange(T)) % C
                kw = {"unit_split": rest[0]} if split else {}
                cut += bool(rest and (rest[0].continued or rest[0].continues))
                crit(
                    out.reshape(-1, C), yy.reshape(-1), shape=out.shape, units=units, **kw
                ).backward()
                opt.step()
                opt.zero_grad()
        assert (cut > 0) == split
        results.append((flat(model), engine.accountant.history))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    assert results[1][1] == results[0][1] and len(results[0][1]) == 1
    torch.manual_seed(0)
    init = flat(nn.Sequential(nn.Embedding(V, C), nn.LayerNorm(C)))
    assert (results[0][0] - init).abs().max() > 1e-3  # the steps moved the parameters


@pytest.mark.parametrize(
    ("variant", "checkpointing"), [("tied", False), ("tied", True), ("lora", False)]
)
def test_a_cut_unit_of_a_tiny_llama_matches_the_oracle(variant: str, checkpointing: bool) -> None:
    """A tiny Llama with its embedding tied to the LM head (the joint d-side sketch of the
    shared weight, taken from the summed gradient for the cut unit), RMSNorm and padding-idx
    embedding routes, with and without HF gradient checkpointing, and an untied one with LoRA
    (peft) factors only: units of 2 and 3 sequences in physical batches of 2 ([0 0] [1 1]
    [1]), against the oracle."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tiny_hf_models as hf

    vocab, length = 48, 8
    model = hf.llama(vocab=vocab, tie=variant == "tied", pad_token_id=0).train()
    if variant == "lora":
        peft = pytest.importorskip("peft")
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(model, lora)
        for name, p in model.named_parameters():  # B = 0 at init: move it so both factors matter
            if "lora_B" in name:
                with torch.no_grad():
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    units = torch.tensor([0, 0, 1, 1, 1])
    x = torch.randint(1, vocab, (5, length), generator=torch.Generator().manual_seed(1))
    x[4] = x[2]  # unit 1: a repeated sequence (large cross term)
    x[3, -2:] = 0  # pad ids

    def logits_of(mod: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        return mod(input_ids=ids, position_ids=pos).logits[:, :-1]

    ref = copy.deepcopy(model).double()
    params = [p for p in ref.parameters() if p.requires_grad]
    G = []
    for u in range(2):
        ids = x[units == u]
        out = logits_of(ref, ids)
        loss = nn.functional.cross_entropy(
            out.reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="none"
        )
        grads = torch.autograd.grad(loss.view(len(ids), -1).mean(1).sum(), params)
        G.append(torch.cat([g.flatten() for g in grads]))
    G = torch.stack(G)
    oracle = G.norm(dim=1)
    c = float(oracle.min()) / 2  # every unit clipped
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    before = flat(model)
    m, opt, crit = private(model, c=c)
    got = {}
    batches = cuts(units, 2)
    for i, (pos, part, split) in enumerate(batches):
        opt.signal_skip_step(do_skip=i < len(batches) - 1)
        ids = x[pos]
        out = logits_of(m, ids)
        crit(
            out.reshape(-1, vocab),
            ids[:, 1:].reshape(-1),
            shape=out.shape,
            units=part,
            unit_split=split,
        ).backward()
        if not split.continues:
            got[int(units[pos][-1])] = m.per_sample_gradient_norms[-1].clone()
        opt.step()
        opt.zero_grad()
    norms = torch.stack([got[0], got[1]])
    torch.testing.assert_close(norms, oracle, rtol=RTOL, atol=0)
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    want = (factors[:, None] * G).sum(0)
    # expected_batch_size=1, lr=1: the update is the clipped sum
    torch.testing.assert_close((before - flat(model)).double(), want, rtol=1e-3, atol=1e-6)


def test_a_failed_backward_drops_the_open_unit() -> None:
    """A backward that raises while a unit is open (a NaN norm here) drops the unit's part
    with the step; the next batch that says it continues the unit is then refused."""
    model = TokenModel()
    x, y = data()
    m, opt, crit = private(model)
    opt.signal_skip_step(do_skip=True)
    out = m(x[:3])
    crit(
        out.reshape(-1, C),
        y[:3].reshape(-1),
        shape=out.shape,
        units=torch.tensor([0, 0, 1]),
        unit_split=UnitSplit(False, True),
    ).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model.head.weight[0, 0] = math.nan
    out = m(x[3:6])
    loss = crit(
        out.reshape(-1, C),
        y[3:6].reshape(-1),
        shape=out.shape,
        units=torch.tensor([0, 0, 0]),
        unit_split=UnitSplit(True, True),
    )
    with pytest.raises(FloatingPointError):
        loss.backward()
    opt.zero_grad()
    with torch.no_grad():
        model.head.weight[0, 0] = 0.0
    out = m(x[6:9])
    with pytest.raises(ValueError, match="no unit is open"):
        crit(
            out.reshape(-1, C),
            y[6:9].reshape(-1),
            shape=out.shape,
            units=torch.tensor([0, 0, 0]),
            unit_split=UnitSplit(True, False),
        )
