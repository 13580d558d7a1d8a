"""Unit-level (document/user-level) randomized clipping (issue 23, item 1).

The oracle sums each unit's per-sequence gradients: one autograd call per unit, on a float64
copy of the model, of the sum of the unit's per-sequence losses (each the mean over its
tokens, as the DP criterion's per-sequence loss with ``shape=``).

Tolerance of the statistical checks (k = 4096). A Hutchinson estimate of a squared norm with
Gaussian probes (entries N(0, 1/k)) is ``||M Omega||_F^2 = sum_i s_i^2 X_i / k``, ``s_i`` the
singular values of ``M`` and ``X_i`` iid chi2_k: its mean is ``||M||_F^2`` and its relative
variance ``2 sum s_i^4 / (k (sum s_i^2)^2) <= 2 / k`` (docs/privacy/estimators.md). Over
layers the estimate is a sum of independent such terms and exact ones, whose relative variance
is again ``<= 2 / k``. The norm (square root) then has relative standard deviation ``<= sqrt(2 /
k) / 2 = 0.011`` to first order, and ``RTOL = 0.06`` is more than five of them. The sketch
generator is seeded, so every test is deterministic. Each norm check is paired with the
per-sequence norm it replaces (``sqrt(sum_j ||g_j||^2)``, no cross terms), which differs from
the oracle by more than ``RTOL``: the check can fail.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer
from opacus_rc.units import UnitLayout

pytestmark = [
    pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated"),
    pytest.mark.filterwarnings("ignore:noise_multiplier=0"),
]

K = 4096
RTOL = 0.06  # > 5 standard deviations of the norm at k = 4096 (module docstring)
V, T, C = 13, 6, 5
#: Units of sizes 3, 2 and 1, interleaved.
UNITS = torch.tensor([0, 1, 0, 2, 1, 0])


class TokenModel(nn.Module):
    """Embedding (with padding_idx) -> LayerNorm -> Linear head: every route of a small LM."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 8, padding_idx=0)
        self.norm = nn.LayerNorm(8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.norm(self.emb(x)))))


def data(B: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    x[0, -2:] = 0  # padding ids
    y = torch.randint(0, C, (B, T), generator=g)
    if B == 6:  # repeated sequences inside units 0 and 1 of UNITS: large cross terms
        x[2], y[2] = x[0], y[0]
        x[4], y[4] = x[1], y[1]
    return x, y


def seq_loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Per-sequence losses (B,): the mean (sum) over tokens, as the DP criterion with shape=
    under loss_reduction="mean" ("sum")."""
    per_token = nn.functional.cross_entropy(
        out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none"
    ).view(y.shape)
    return per_token.mean(dim=1) if reduction == "mean" else per_token.sum(dim=1)


def unit_grads(
    model: nn.Module, x: Any, y: torch.Tensor, units: torch.Tensor, forward, reduction="mean"
) -> Any:
    """``(U, P)`` float64 summed gradient of each unit: one autograd call per unit."""
    ref = copy.deepcopy(model).double()
    params = [p for p in ref.parameters() if p.requires_grad]
    rows = []
    for u in range(int(units.max()) + 1):
        idx = torch.nonzero(units == u).flatten()
        loss = seq_loss(forward(ref, x[idx]), y[idx], reduction).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(
            torch.cat(
                [(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(grads, params)]
            )
        )
    return torch.stack(rows)


def seq_grad_norms(model: nn.Module, x: Any, y: torch.Tensor, units: torch.Tensor, forward) -> Any:
    """``(U,)`` ``sqrt(sum_{j in u} ||g_j||^2)``: the per-sequence norms, no cross terms."""
    per_seq = unit_grads(model, x, y, torch.arange(len(units)), forward)
    sq = torch.zeros(int(units.max()) + 1, dtype=torch.float64)
    return sq.index_add(0, units, per_seq.pow(2).sum(1)).sqrt()


def plain_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def private(
    model: nn.Module,
    *,
    bookkeeping: bool = True,
    seed: int = 0,
    k: int = K,
    c: float = 1e6,
    reduction: str = "mean",
) -> tuple[Any, Any, Any]:
    m = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=c,
        loss_reduction=reduction,
        sketch_dim=k,
        sketch_generator=torch.Generator().manual_seed(seed),
        bookkeeping=bookkeeping,
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        grad_sample_module=m,
        noise_multiplier=0.0,
        expected_batch_size=3,
    )
    crit = DPLossRandomizedClipping(m, opt, nn.CrossEntropyLoss(reduction=reduction), reduction)
    return m, opt, crit


def unit_step(m, crit, x, y, units, forward=plain_forward) -> torch.Tensor:
    """One private backward with ``units=``; returns the clipped gradient sum (flattened)."""
    out = forward(m, x)
    loss = crit(out.reshape(-1, out.shape[-1]), y.reshape(-1), shape=out.shape, units=units)
    assert loss.loss_per_sample.shape == (int(units.max()) + 1,)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in m.parameters() if p.requires_grad])


# ----------------------------------------------------------------------------------------------
# Norms and clipped sums against the float64 oracle
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bookkeeping", "reduction"), [(True, "mean"), (False, "mean"), (True, "sum")]
)
def test_per_unit_norms_and_clipped_sum_match_the_oracle(bookkeeping: bool, reduction: str) -> None:
    """Units of sizes 3, 2, 1 interleaved: norms within RTOL of the oracle's summed gradient
    (and not the per-sequence norm), and the clipped sum equal to ``sum_u c_u g_u`` with the
    module's own factors (exact up to float32)."""
    model = TokenModel()
    x, y = data()
    G = unit_grads(model, x, y, UNITS, plain_forward, reduction)
    oracle = G.norm(dim=1)
    naive = seq_grad_norms(model, x, y, UNITS, plain_forward)
    assert ((naive - oracle).abs() / oracle)[:2].min() > RTOL  # units of >1 sequence differ
    m, _opt, crit = private(model, bookkeeping=bookkeeping, c=0.5, reduction=reduction)
    got = unit_step(m, crit, x, y, UNITS)
    norms = m.per_sample_gradient_norms
    assert norms.shape == (3,)
    torch.testing.assert_close(norms, oracle, rtol=RTOL, atol=0)
    factors = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    assert factors.max() < 1  # every unit clipped
    want = (factors[:, None] * G).sum(0)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def test_the_norm_readers_have_one_entry_per_unit() -> None:
    """With ``units=`` (U = 3 of B = 6) get_norm_sample(), per_sample_gradient_norms and each
    norm_samples entry are ``(U,)`` (as documented), and the per-parameter norms combine to the
    whole-model ones."""
    m, _opt, crit = private(TokenModel(), c=0.5)
    unit_step(m, crit, *data(), UNITS)
    whole = m.get_norm_sample()
    assert whole.shape == (3,)
    torch.testing.assert_close(whole, m.per_sample_gradient_norms, rtol=0, atol=0)
    parts = m.norm_samples
    assert {tuple(t.shape) for t in parts.values()} == {(3,)}
    combined = torch.stack([t.double() for t in parts.values()]).norm(dim=0)
    torch.testing.assert_close(combined, whole, rtol=1e-6, atol=0)


def test_identity_units_reproduce_the_per_sequence_step() -> None:
    """``units = arange(B)`` (every sequence its own unit) is the per-sequence step: the same
    norms and gradients, probe for probe (same seed), up to float rounding (the per-sequence
    step applies Opacus' x B rescale to the norms after the sketch, the unit step to the
    output gradients before it; issue 34)."""
    model = TokenModel()
    x, y = data()
    m, _opt, crit = private(model, k=8, c=0.3)
    got = unit_step(m, crit, x, y, torch.arange(len(x)))
    norms_u = m.per_sample_gradient_norms.clone()
    m.cleanup()
    model2 = TokenModel()
    m2, _opt2, crit2 = private(model2, k=8, c=0.3)
    out = m2(x)
    crit2(out.reshape(-1, C), y.reshape(-1), shape=out.shape).backward()
    ref = torch.cat([p.grad.flatten() for p in m2.parameters()])
    torch.testing.assert_close(norms_u, m2.per_sample_gradient_norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_reordered_and_interleaved_sequences_give_the_same_step() -> None:
    """A unit's sequences reordered, and interleaved with other units', give the same norms and
    clipped gradient (the probe of unit u is the u-th draw of the seeded generator, so unit
    labels are kept; only positions change)."""
    x, y = data()
    grouped = torch.tensor([0, 0, 0, 1, 1, 2])
    perm = torch.tensor([3, 0, 5, 1, 4, 2])  # interleaved, each unit's order changed
    results = []
    for order in (torch.arange(6), perm):
        model = TokenModel()
        m, _opt, crit = private(model, k=16, c=0.2)
        grad = unit_step(m, crit, x[order], y[order], grouped[order])
        results.append((m.per_sample_gradient_norms.clone(), grad))
        m.cleanup()
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)
    assert results[0][0].min() > 0.2  # clipped, so the factors matter


def test_mixing_criterion_calls_with_and_without_units_raises() -> None:
    model = TokenModel()
    x, y = data()
    m, _opt, crit = private(model)
    out = m(x)
    crit(out.reshape(-1, C), y.reshape(-1), shape=out.shape, units=UNITS)
    with pytest.raises(ValueError, match="different units="):
        crit(out.reshape(-1, C), y.reshape(-1), shape=out.shape)


def test_a_nan_unit_norm_is_counted_per_unit() -> None:
    """One NaN unit among U = 3 (6 sequences): the message counts units, not sequences."""
    model = TokenModel()
    x, y = data()
    x[x == V - 1] = 1
    x[3] = V - 1  # the only sequence of unit 2, and the only one with token V - 1
    with torch.no_grad():
        model.emb.weight[V - 1] = float("nan")
    m, _opt, crit = private(model)
    out = m(x)
    with pytest.raises(
        FloatingPointError, match=r"^1 of 3 per-unit gradient norm estimates are NaN or inf"
    ):
        crit(out.reshape(-1, C), y.reshape(-1), shape=out.shape, units=UNITS).backward()
    # Without units= the same batch counts its 6 sequences.
    m, _opt, crit = private(TokenModel())
    with torch.no_grad():
        m._module.emb.weight[V - 1] = float("nan")
    out = m(x)
    with pytest.raises(
        FloatingPointError, match=r"^1 of 6 per-sample gradient norm estimates are NaN or inf"
    ):
        crit(out.reshape(-1, C), y.reshape(-1), shape=out.shape).backward()


@pytest.mark.parametrize(
    ("units", "error", "match"),
    [
        (torch.tensor([0, 2, 0, 2, 0, 0]), ValueError, "without gaps"),
        (torch.tensor([0, 1, 0]), ValueError, "3 entries"),
        (torch.tensor([0.0, 1, 0, 1, 0, 0]), TypeError, "integer"),
        (torch.tensor([[0, 1, 0, 1, 0, 0]]), ValueError, r"shape \(B,\)"),
    ],
)
def test_malformed_units_are_refused(units: torch.Tensor, error: type, match: str) -> None:
    model = TokenModel()
    x, y = data()
    m, _opt, crit = private(model)
    out = m(x)
    with pytest.raises(error, match=match):
        crit(out.reshape(-1, C), y.reshape(-1), shape=out.shape, units=units)


def test_a_module_that_is_not_token_wise_is_refused() -> None:
    """A Conv1d over the sequence mixes positions: concatenating a unit's sequences would not
    give its summed gradient, so units= is refused naming the module."""

    class ConvModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(4, 4, 3, padding=1)
            self.head = nn.Linear(4, C)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.conv(x.transpose(1, 2)).transpose(1, 2))

    model = ConvModel()
    m, _opt, crit = private(model)
    x = torch.randn(6, T, 4)
    _, y = data()
    out = m(x)
    with pytest.raises(NotImplementedError, match=r"'conv' \(Conv1d\)"):
        crit(out.reshape(-1, C), y.reshape(-1), shape=out.shape, units=UNITS)


def test_layout_packs_without_copy_when_contiguous() -> None:
    lay = UnitLayout(torch.tensor([0, 0, 1, 1]))
    x = torch.randn(4, 3)
    assert lay.pack(x).data_ptr() == x.data_ptr()
    lay2 = UnitLayout(torch.tensor([1, 0, 1]))
    packed = lay2.pack(torch.tensor([[1.0], [2.0], [3.0]]))
    torch.testing.assert_close(packed, torch.tensor([[[2.0], [0.0]], [[1.0], [3.0]]]))


def test_hutchpp_per_unit_norms_match_the_oracle() -> None:
    """Hutch++ runs on the packed tensors too (head and tail per unit). Its estimate is an
    exact head share plus a k-column Hutchinson tail on the residual, so its relative variance
    is again <= 2 / k and RTOL holds (module docstring)."""
    model = TokenModel()
    x, y = data()
    oracle = unit_grads(model, x, y, UNITS, plain_forward).norm(dim=1)
    m = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=1e6,
        sketch="hutch++",
        sketch_dim=K,
        sketch_head_dim=4,
        sketch_generator=torch.Generator().manual_seed(0),
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        grad_sample_module=m,
        noise_multiplier=0.0,
        expected_batch_size=3,
    )
    crit = DPLossRandomizedClipping(m, opt, nn.CrossEntropyLoss(), "mean")
    unit_step(m, crit, x, y, UNITS)
    torch.testing.assert_close(m.per_sample_gradient_norms, oracle, rtol=RTOL, atol=0)


def test_each_unit_and_each_step_gets_its_own_probe() -> None:
    """Two units with the same content (one sequence each, identical) in one batch: with one
    fresh probe draw per unit their sketched norms differ (k = 8, the sketched Linears give a
    relative spread of about sqrt(2/8) = 0.5 of their share, and two independent Gaussian draws
    coincide with probability 0); a probe reused across units would give equal norms. The next
    step's draw differs again (no reuse across steps)."""
    model = TokenModel()
    x, y = data(B=1)
    x, y = x.repeat(2, 1), y.repeat(2, 1)
    m, opt, crit = private(model, k=8)
    units = torch.tensor([0, 1])
    unit_step(m, crit, x, y, units)
    first = m.per_sample_gradient_norms.clone()
    assert first.shape == (2,)
    assert (first[0] - first[1]).abs() > 1e-6 * first.abs().max()
    opt.zero_grad()
    unit_step(m, crit, x, y, units)
    second = m.per_sample_gradient_norms.clone()
    assert ((second - first).abs() > 1e-6 * first.abs().max()).all()


def test_a_units_rank2_linear_norm_does_not_depend_on_the_other_units_sizes() -> None:
    """Substitution neighbours with the same U = 3: unit 2 has one sequence, then two. An
    ``nn.Linear`` on ``(B, d)`` inputs (a pooled classifier head) packs to ``(U, d)`` when every
    unit of the batch has one sequence (its sampler's exact rank-one rule) and to
    ``(U, n_max, d)`` otherwise (sketched): unit 0's weight norm moved by 33% with the size of
    unit 2 (k = 4). The sequence axis is now kept, ``(U, 1, d)``, so unit 0's norms are the same
    (same probes: U and the draw shapes agree) to float32 rounding, with and without
    book-keeping."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g)
    y = torch.randint(0, 4, (4,), generator=g)

    def unit0_norms(xs: torch.Tensor, ys: torch.Tensor, units: torch.Tensor, bk: bool) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        gsm, _, crit = private(model, bookkeeping=bk, seed=7, k=4, c=1.0)
        crit(gsm(xs), ys, units=units).backward()
        norms = {n: float(v[0]) for n, v in gsm.norm_samples.items()}
        gsm.cleanup()
        return norms

    for bk in (True, False):
        one_each = unit0_norms(x[:3], y[:3], torch.tensor([0, 1, 2]), bk)
        two_in_last = unit0_norms(x, y, torch.tensor([0, 1, 2, 2]), bk)
        assert set(one_each) == set(two_in_last)
        for name, value in one_each.items():
            assert two_in_last[name] == pytest.approx(value, rel=1e-5), (name, bk)
