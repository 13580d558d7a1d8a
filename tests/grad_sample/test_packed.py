"""Per-record norms and clipped sums inside packed rows (opacus_rc.grad_sample.packed, issue 32).

Oracle everywhere: each record run *alone* through the same tiny ``nn.Linear`` / ``nn.Embedding``
with a token-wise loss, its gradient taken by autograd in float64. The packed side runs the
packed rows (:func:`opacus_rc.packing.pack_records`: several records per row, one record cut
across rows) through the same layer with the same per-token loss, and reads the layer's input
and output gradient rows.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from opacus_rc.grad_sample.packed import (
    RecordLayout,
    embedding_record_clipped_sum,
    embedding_record_sqnorms,
    linear_record_clipped_sum,
    linear_record_sketched_sqnorms,
    linear_record_sqnorms,
    tied_record_sketched_sqnorms,
)
from opacus_rc.packing import pack_records
from opacus_rc.sketching import hutchinson_sqnorm

#: Ragged lengths; with max_length 16 record 5 (20 tokens) is cut across two rows and the
#: rows hold several records each.
LENGTHS = (5, 9, 3, 12, 7, 20, 1)
MAX_LENGTH = 16
D, P = 6, 4
VOCAB = 11


def _records(seed: int = 0) -> tuple[list[torch.Tensor], object]:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    packed = pack_records(ids, max_length=MAX_LENGTH, pad_token_id=0)
    assert int(packed.segments.max()) > 1  # a record cut across rows
    assert int((packed.record_ids >= 0).sum(-1).max()) > 0
    return ids, packed


def _place(rows: list[torch.Tensor], packed: object) -> torch.Tensor:
    """Per-record token rows ``(l_r, F)`` laid out as the packed ``(R, T, F)``, zeros at
    padding."""
    rid, tidx = packed.record_ids, packed.token_index
    out = torch.zeros(*rid.shape, rows[0].shape[-1], dtype=rows[0].dtype)
    for (r, t), rec in zip((rid >= 0).nonzero().tolist(), rid[rid >= 0].tolist()):
        out[r, t] = rows[rec][tidx[r, t]]
    return out


def _token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A token-wise loss (each position's term reads that position only), nonlinear in out."""
    return (out * y).sum() + 0.5 * out.pow(2).sum()


def _linear_case(seed: int = 0, *, d: int = D, p: int = P):
    """The layer, each record's gradient alone, and the packed (A, G, record_ids)."""
    _, packed = _records(seed)
    g = torch.Generator().manual_seed(seed + 1)
    torch.manual_seed(seed)
    layer = nn.Linear(d, p).double()
    xs = [torch.randn(n, d, generator=g, dtype=torch.float64) for n in LENGTHS]
    ys = [torch.randn(n, p, generator=g, dtype=torch.float64) for n in LENGTHS]
    alone = []
    for x, y in zip(xs, ys):
        layer.zero_grad()
        _token_loss(layer(x), y).backward()
        alone.append((layer.weight.grad.clone(), layer.bias.grad.clone()))
    A = _place(xs, packed)
    Y = _place(ys, packed)
    out = layer(A)
    valid = (packed.record_ids >= 0).unsqueeze(-1)
    (G,) = torch.autograd.grad(_token_loss(out * valid, Y), out)
    return layer, alone, A, G, packed


@pytest.mark.parametrize("method", ["gram", "materialize", "auto"])
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_exact_linear_norms_equal_each_record_alone(method: str, chunk_size: int) -> None:
    _, alone, A, G, packed = _linear_case()
    layout = RecordLayout.from_record_ids(packed.record_ids, chunk_size=chunk_size)
    weight, bias = linear_record_sqnorms(A, G, layout=layout, bias=True, method=method)
    want_w = torch.stack([w.pow(2).sum() for w, _ in alone])
    want_b = torch.stack([b.pow(2).sum() for _, b in alone])
    torch.testing.assert_close(weight, want_w, rtol=1e-12, atol=0)
    torch.testing.assert_close(bias, want_b, rtol=1e-12, atol=0)


def test_exact_linear_norms_per_unit_sum_the_units_records() -> None:
    _, alone, A, G, packed = _linear_case()
    units = torch.tensor([0, 0, 1, 2, 2, 3, 1])
    layout = RecordLayout.from_record_ids(
        torch.where(packed.record_ids >= 0, units[packed.record_ids.clamp(min=0)], -1),
        chunk_size=4,
    )
    weight, _ = linear_record_sqnorms(A, G, layout=layout)
    want = torch.stack(
        [
            sum(alone[r][0] for r in range(len(LENGTHS)) if units[r] == u).pow(2).sum()
            for u in range(4)
        ]
    )
    torch.testing.assert_close(weight, want, rtol=1e-12, atol=0)


def _alone_layout(xs: list[torch.Tensor]) -> torch.Tensor:
    """Per-record rows zero-padded to ``(N, max l, F)``: each record alone as one sample."""
    out = torch.zeros(len(xs), max(x.shape[0] for x in xs), xs[0].shape[1], dtype=xs[0].dtype)
    for i, x in enumerate(xs):
        out[i, : x.shape[0]] = x
    return out


def _per_record_rows(t: torch.Tensor, packed: object) -> list[torch.Tensor]:
    """The packed rows of each record back in its token order."""
    rid, tidx = packed.record_ids, packed.token_index
    out = []
    for r in range(packed.num_records):
        where = rid == r
        order = torch.argsort(tidx[where])
        out.append(t[where][order])
    return out


@pytest.mark.parametrize(("d", "p"), [(6, 4), (3, 7)])  # output side, input side
def test_sketch_is_hutchinson_of_each_record_alone(d: int, p: int) -> None:
    # Same generator seed: the same N probes, and the packed estimate equals
    # hutchinson_sqnorm on each record's tokens alone, up to rounding.
    _, _, A, G, packed = _linear_case(d=d, p=p)
    layout = RecordLayout.from_record_ids(packed.record_ids, chunk_size=4)
    got = linear_record_sketched_sqnorms(
        A, G, layout=layout, sketch_dim=3, generator=torch.Generator().manual_seed(7)
    )
    want = hutchinson_sqnorm(
        _alone_layout(_per_record_rows(A, packed)),
        _alone_layout(_per_record_rows(G, packed)),
        sketch_dim=3,
        generator=torch.Generator().manual_seed(7),
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_sketch_is_unbiased_within_its_variance() -> None:
    # n_hat_r = tr(Omega^T O_r Omega) with O_r = M_r M_r^T and Omega_uv ~ N(0, 1/k):
    # E n_hat_r = ||M_r||_F^2 and Var n_hat_r = (2/k) ||O_r||_F^2 (Gaussian quadratic form,
    # k independent columns). The mean of S independent estimates has standard deviation
    # sigma_r = sqrt(2 ||O_r||_F^2 / (k S)); it is within 5 sigma_r of the truth with probability
    # 1 - 6e-7 per record (normal limit of a mean of S = 2000 draws). Fixed seeds: deterministic.
    _, alone, A, G, packed = _linear_case()
    layout = RecordLayout.from_record_ids(packed.record_ids, chunk_size=4)
    k, draws = 2, 2000
    gen = torch.Generator().manual_seed(3)
    est = torch.stack(
        [
            linear_record_sketched_sqnorms(A, G, layout=layout, sketch_dim=k, generator=gen)
            for _ in range(draws)
        ]
    )
    truth = torch.stack([w.pow(2).sum() for w, _ in alone])
    o_sq = torch.stack([(w @ w.T).pow(2).sum() for w, _ in alone])
    sigma = (2 * o_sq / (k * draws)).sqrt()
    assert bool(((est.mean(0) - truth).abs() <= 5 * sigma).all()), (est.mean(0), truth, sigma)
    # Not a constant: the spread is the Hutchinson spread (within 20% for 2000 draws).
    spread = est.std(0) / (2 * o_sq / k).sqrt()
    assert bool(((spread - 1).abs() < 0.2).all()), spread


def test_sketch_draws_fresh_probes_per_record() -> None:
    # Two records with identical tokens get independent probes: different estimates.
    x = torch.randn(4, D, dtype=torch.float64)
    g = torch.randn(4, P, dtype=torch.float64)
    packed = pack_records([[1, 2, 3, 4], [1, 2, 3, 4]], max_length=8, pad_token_id=0)
    A = _place([x, x], packed)
    G = _place([g, g], packed)
    layout = RecordLayout.from_record_ids(packed.record_ids)
    est = linear_record_sketched_sqnorms(
        A, G, layout=layout, sketch_dim=2, generator=torch.Generator().manual_seed(0)
    )
    assert float((est[0] - est[1]).abs()) > 1e-6 * float(est.abs().max())


def test_linear_clipped_sum_is_sum_of_clipped_records_alone() -> None:
    _, alone, A, G, packed = _linear_case()
    coef = torch.linspace(0.1, 1.0, len(LENGTHS), dtype=torch.float64)
    weight, bias = linear_record_clipped_sum(
        A, G, record_ids=packed.record_ids, coef=coef, bias=True
    )
    torch.testing.assert_close(
        weight, sum(c * w for c, (w, _) in zip(coef, alone)), rtol=1e-12, atol=1e-14
    )
    torch.testing.assert_close(
        bias, sum(c * b for c, (_, b) in zip(coef, alone)), rtol=1e-12, atol=1e-14
    )


def _embedding_case(padding_idx: int | None):
    ids, packed = _records(seed=4)
    torch.manual_seed(0)
    emb = nn.Embedding(VOCAB, D, padding_idx=padding_idx).double()
    g = torch.Generator().manual_seed(5)
    ys = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in LENGTHS]
    alone = []
    for x, y in zip(ids, ys):
        emb.zero_grad()
        _token_loss(emb(x), y).backward()
        alone.append(emb.weight.grad.clone())
    Y = _place(ys, packed)
    out = emb(packed.input_ids)
    valid = (packed.record_ids >= 0).unsqueeze(-1)
    (G,) = torch.autograd.grad(_token_loss(out * valid, Y), out)
    return alone, packed, G


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_norms_and_clipped_sum_equal_records_alone(padding_idx: int | None) -> None:
    alone, packed, G = _embedding_case(padding_idx)
    # Some record tokens are id 0, the padding_idx of the second case (its row is left out).
    assert int((packed.input_ids[packed.record_ids >= 0] == 0).sum()) > 0
    layout = RecordLayout.from_record_ids(packed.record_ids, chunk_size=4)
    got = embedding_record_sqnorms(
        packed.input_ids, G, layout=layout, num_embeddings=VOCAB, padding_idx=padding_idx
    )
    torch.testing.assert_close(
        got, torch.stack([w.pow(2).sum() for w in alone]), rtol=1e-12, atol=0
    )
    coef = torch.linspace(1.0, 0.2, len(LENGTHS), dtype=torch.float64)
    summed = embedding_record_clipped_sum(
        packed.input_ids,
        G,
        record_ids=packed.record_ids,
        coef=coef,
        num_embeddings=VOCAB,
        padding_idx=padding_idx,
    )
    torch.testing.assert_close(
        summed, sum(c * w for c, w in zip(coef, alone)), rtol=1e-12, atol=1e-14
    )


def test_layout_refuses_bad_record_ids() -> None:
    with pytest.raises(ValueError, match=r"\(R, T\) integer tensor"):
        RecordLayout.from_record_ids(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must lie in \[-1, 2\)"):
        RecordLayout.from_record_ids(torch.tensor([[0, 2]]), num_records=2)
    with pytest.raises(ValueError, match="chunk_size"):
        RecordLayout.from_record_ids(torch.tensor([[0, 1]]), chunk_size=0)
    layout = RecordLayout.from_record_ids(torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="record_ids"):
        linear_record_sqnorms(torch.zeros(1, 3, 2), torch.zeros(1, 3, 2), layout=layout)


def test_record_without_tokens_gets_zero_norm() -> None:
    layout = RecordLayout.from_record_ids(torch.tensor([[0, 0, -1]]), num_records=3)
    A = torch.randn(1, 3, 2, dtype=torch.float64)
    G = torch.randn(1, 3, 2, dtype=torch.float64)
    weight, bias = linear_record_sqnorms(A, G, layout=layout, bias=True)
    assert weight.shape == (3,) and float(weight[1:].abs().sum()) == 0.0
    want = (G[0, :2].T @ A[0, :2]).pow(2).sum()
    assert math.isclose(float(weight[0]), float(want), rel_tol=1e-12)


def test_per_record_layout_feeds_the_existing_samplers() -> None:
    # The smallest wiring: records re-laid out as samples (N, max T_r, .) give the step's
    # existing per-sample functions per-record results (same probes, same numbers).
    from opacus_rc.grad_sample.linear import (
        compute_linear_clipped_sum,
        compute_linear_sketched_norm_sample,
    )

    layer, alone, A, G, packed = _linear_case()
    layout = RecordLayout.from_record_ids(packed.record_ids, chunk_size=4)
    Ar, Gr = layout.per_record(A), layout.per_record(G)
    assert Ar.shape == (len(LENGTHS), max(LENGTHS), D)
    sketched = compute_linear_sketched_norm_sample(
        layer,
        [Ar],
        Gr,
        estimator=hutchinson_sqnorm,
        sketch_dim=3,
        generator=torch.Generator().manual_seed(7),
    )
    want = linear_record_sketched_sqnorms(
        A, G, layout=layout, sketch_dim=3, generator=torch.Generator().manual_seed(7)
    )
    torch.testing.assert_close(sketched[layer.weight].pow(2), want, rtol=1e-12, atol=0)
    _, bias_sq = linear_record_sqnorms(A, G, layout=layout, bias=True)
    torch.testing.assert_close(sketched[layer.bias].pow(2), bias_sq, rtol=1e-12, atol=0)
    coef = torch.linspace(0.1, 1.0, len(LENGTHS), dtype=torch.float64)
    sums = compute_linear_clipped_sum(layer, [Ar], Gr, coef)
    torch.testing.assert_close(
        sums[layer.weight], sum(c * w for c, (w, _) in zip(coef, alone)), rtol=1e-12, atol=1e-14
    )


def _tied_case(padding_idx: int | None):
    """A weight tied between an embedding and a head; each record's gradient alone, and the
    packed (head A, head G, ids, embedding G)."""
    ids, packed = _records(seed=6)
    torch.manual_seed(1)
    emb = nn.Embedding(VOCAB, D, padding_idx=padding_idx).double()
    head = nn.Linear(D, VOCAB, bias=False).double()
    head.weight = emb.weight
    mix = nn.Linear(D, D).double()  # a token-wise layer between them

    def forward(x):
        e = emb(x)
        h = torch.tanh(mix(e))
        return e, h, head(h)

    g = torch.Generator().manual_seed(2)
    ys = [torch.randn(n, VOCAB, generator=g, dtype=torch.float64) for n in LENGTHS]
    alone = []
    for x, y in zip(ids, ys):
        emb.zero_grad()
        _token_loss(forward(x)[2], y).backward()
        alone.append(emb.weight.grad.clone())
    e, h, out = forward(packed.input_ids)
    valid = (packed.record_ids >= 0).unsqueeze(-1)
    Ge, Gh = torch.autograd.grad(_token_loss(out * valid, _place(ys, packed)), (e, out))
    return alone, packed, (h.detach(), Gh, packed.input_ids, Ge)


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_tied_sketch_is_the_joint_sketch_of_each_record_alone(padding_idx: int | None) -> None:
    from opacus_rc.grad_sample.tied import tied_hutchinson_sqnorm

    alone, packed, (A, Gh, ids, Ge) = _tied_case(padding_idx)
    layout = RecordLayout.from_record_ids(packed.record_ids, chunk_size=4)
    # Exact with the identity as probe (k = d): ||M_r I||_F^2 = ||M_r||_F^2, M_r the tied
    # weight's gradient of record r alone (cross term between head and embedding included).
    eye = torch.eye(D, dtype=torch.float64).expand(len(LENGTHS), D, D)
    exact = tied_record_sketched_sqnorms(
        A, Gh, ids, Ge, layout=layout, sketch_dim=D, probes=eye, padding_idx=padding_idx
    )
    torch.testing.assert_close(
        exact, torch.stack([w.pow(2).sum() for w in alone]), rtol=1e-12, atol=0
    )
    # Random probes, same seed: the existing joint sketch on each record laid out alone.
    got = tied_record_sketched_sqnorms(
        A,
        Gh,
        ids,
        Ge,
        layout=layout,
        sketch_dim=3,
        generator=torch.Generator().manual_seed(9),
        padding_idx=padding_idx,
    )
    want = tied_hutchinson_sqnorm(
        layout.per_record(A),
        layout.per_record(Gh),
        layout.per_record(ids),
        layout.per_record(Ge),
        sketch_dim=3,
        padding_idx=padding_idx,
        generator=torch.Generator().manual_seed(9),
    )
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-12, atol=0)


def _joint_packed(A, Gh, ids, Ge, layout, probes, padding_idx, *, head_first: bool):
    """The step's path (JointSketch's packed-row parts): ``(N,)`` squared-norm estimates."""
    from opacus_rc.grad_sample.tied import JointSketch

    sketch = JointSketch(probes, num_embeddings=VOCAB)
    parts = [
        lambda: sketch.add_linear_packed(A, Gh, layout=layout),
        lambda: sketch.add_embedding_packed(ids, Ge, padding_idx=padding_idx, layout=layout),
    ]
    for part in parts if head_first else parts[::-1]:
        part()
    return sketch.norm().double().square()


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("head_first", [True, False])
@pytest.mark.parametrize("runs", ["segments", "chunks"])
def test_joint_sketch_from_packed_rows_is_each_records_joint_sketch(
    padding_idx: int | None, head_first: bool, runs: str
) -> None:
    # Issue 32 (no re-layout): the packed-row parts of the joint sketch, with the same probe
    # per record, give the joint sketch of each record laid out alone (identity probes: the
    # exact squared norm of the tied weight's gradient, cross term included). On a CPU the
    # parts run over each record's runs of tokens (views); elsewhere over chunks.
    from opacus_rc.grad_sample.tied import tied_hutchinson_sqnorm

    alone, packed, (A, Gh, ids, Ge) = _tied_case(padding_idx)
    layout = RecordLayout.from_record_ids(packed.record_ids, chunk_size=4)
    assert layout.segments is not None and len(layout.segments) > layout.num_records  # a cut
    if runs == "chunks":
        layout = dataclasses.replace(layout, segments=None)
    n = len(LENGTHS)
    eye = torch.eye(D, dtype=torch.float64).expand(n, D, D).contiguous()
    exact = _joint_packed(A, Gh, ids, Ge, layout, eye, padding_idx, head_first=head_first)
    torch.testing.assert_close(
        exact, torch.stack([w.pow(2).sum() for w in alone]), rtol=1e-12, atol=0
    )
    probes = torch.randn(n, D, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    got = _joint_packed(A, Gh, ids, Ge, layout, probes, padding_idx, head_first=head_first)
    want = tied_hutchinson_sqnorm(
        layout.per_record(A),
        layout.per_record(Gh),
        layout.per_record(ids),
        layout.per_record(Ge),
        sketch_dim=3,
        padding_idx=padding_idx,
        probes=probes,
    )
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # float32 beyond its range without the per-record power-of-two scaling: entries of size
    # 2^40 give squared norms near 2^160 (> 3.4e38) while the norms (~2^80) are finite.
    big = 2.0**40
    got32 = _joint_packed(
        (A * big).float(),
        (Gh * big).float(),
        ids,
        (Ge * big**2).float(),
        layout,
        probes.float(),
        padding_idx,
        head_first=head_first,
    )
    assert bool(torch.isfinite(got32.sqrt()).all())
    torch.testing.assert_close(got32.sqrt() / big**2, got.sqrt(), rtol=1e-4, atol=0)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "layer_norm_no_bias"])
def test_norm_layer_record_grads_equal_each_record_alone(kind: str) -> None:
    # Issue 32: a norm layer's exact per-record gradients from the packed token rows (one
    # index_add over the token-to-record map) equal autograd's on each record alone.
    from opacus_rc.grad_sample.norm_layers import norm_layer_record_grads

    _, packed = _records(seed=3)
    torch.manual_seed(2)
    layer = nn.RMSNorm(D) if kind == "rms_norm" else nn.LayerNorm(D, bias=kind == "layer_norm")
    layer = layer.double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in LENGTHS]
    ys = [torch.randn(n, D, generator=g, dtype=torch.float64) for n in LENGTHS]
    params = list(layer.parameters())
    alone = [torch.autograd.grad(_token_loss(layer(x), y), params) for x, y in zip(xs, ys)]
    X = _place(xs, packed)
    X[packed.record_ids < 0] = 3.0  # padding rows: anything, left out
    out = layer(X)
    valid = (packed.record_ids >= 0).unsqueeze(-1)
    (G,) = torch.autograd.grad(_token_loss(out * valid, _place(ys, packed)), out)
    G = G + (~valid) * 7.0  # a padding gradient must not count either
    got = norm_layer_record_grads(
        layer, X, G, record_ids=packed.record_ids, num_records=packed.num_records
    )
    assert len(got) == len(params)
    for i, p in enumerate(params):
        want = torch.stack([a[i] for a in alone])
        torch.testing.assert_close(got[p], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("d", "p"), [(6, 4), (3, 7)])  # output side, input side
def test_sketch_over_runs_equals_sketch_over_chunks(d: int, p: int) -> None:
    # Issue 32: the CPU path (two products per run of a record's tokens, on views) and the
    # chunked path give the same estimate with the same probes; "segments" is refused for a
    # layout without runs (built off the CPU).
    _, _, A, G, packed = _linear_case(d=d, p=p)
    layout = RecordLayout.from_record_ids(packed.record_ids, chunk_size=4)
    kw = {"layout": layout, "sketch_dim": 3}
    runs = linear_record_sketched_sqnorms(
        A, G, generator=torch.Generator().manual_seed(8), method="segments", **kw
    )
    chunks = linear_record_sketched_sqnorms(
        A, G, generator=torch.Generator().manual_seed(8), method="chunks", **kw
    )
    auto = linear_record_sketched_sqnorms(A, G, generator=torch.Generator().manual_seed(8), **kw)
    torch.testing.assert_close(runs, chunks, rtol=1e-12, atol=0)
    assert torch.equal(auto, runs)
    assert not torch.equal(runs, linear_record_sketched_sqnorms(A, G, **kw))  # fresh draws
    no_runs = dataclasses.replace(layout, segments=None)
    with pytest.raises(ValueError, match="segments"):
        linear_record_sketched_sqnorms(A, G, layout=no_runs, sketch_dim=3, method="segments")
    with pytest.raises(ValueError, match="method"):
        linear_record_sketched_sqnorms(A, G, layout=layout, sketch_dim=3, method="rows")
