"""Exact per-sample norms and the book-keeping clipped sum of ``nn.EmbeddingBag`` (issue 20,
item 1).

Opacus' grad sampler for ``nn.EmbeddingBag`` (which randomized clipping used to inherit) adds a
repeated id of a bag once: ``gsm[i][index] += g`` with a repeated index writes once. A bag
``[7] * 8`` then has per-sample norm ``||g||`` instead of ``8 ||g||``, so a sample's clipped
contribution could reach 8x the clipping norm. The oracle here is autograd itself: a float64
copy of the layer (or model) and one backward pass per sample, so ``padding_idx`` (no gradient,
not counted in a mean), ``per_sample_weights`` and repeated ids are treated exactly as autograd
treats them.

Tolerances: the norms are accumulated in float64 from float32 output gradients (one float32
rounding of ``||g_i||``'s terms: relative 1e-6), the clipped sum in float32 (a sum of ``n <= 40``
float32 terms: relative error about ``n 2^-24 < 1e-5``); float64 inputs are held to 1e-12.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_rc.grad_sample import (
    CLIPPED_SUM_FUNCTIONS,
    EXACT_NORM_TYPES,
    FORWARD_INPUT_ADAPTERS,
    MODULE_CHECKS,
    SKETCHED_NORM_SAMPLERS,
    compute_embedding_bag_clipped_sum,
    compute_embedding_bag_norm_sample,
    embedding_bag_inputs,
)
from opacus_rc.grad_sample.routing import NormPath
from opacus_rc.privacy_engine import PrivacyEngine
from tests.grad_sample import layer_oracle

V, D = 9, 4
C = 0.05  # max_grad_norm: small, so that clipping is active for every sample


def bags(*, seed: int = 0, B: int = 5, empty: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D ids with offsets: repeated ids in every bag, an empty bag if ``empty``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (B,), generator=g)
    if empty:
        lengths[2] = 0
    lengths[0] = 8
    ids = torch.randint(0, 4, (int(lengths.sum()),), generator=g)  # 4 of V ids: many repeats
    ids[:8] = 7  # the reported bag [7] * 8
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return ids, offsets


def split(
    ids: torch.Tensor, offsets: torch.Tensor | None, weights: torch.Tensor | None, i: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sample ``i``'s call alone (2-D ids: row ``i``; 1-D: its bag with offsets [0])."""
    if offsets is None:
        return ids[i : i + 1], None, None if weights is None else weights[i : i + 1]
    ends = [*offsets[1:].tolist(), ids.numel()]
    lo, hi = int(offsets[i]), ends[i]
    w = None if weights is None else weights[lo:hi]
    return ids[lo:hi], torch.zeros(1, dtype=torch.long), w


def oracle(
    layer: nn.EmbeddingBag,
    ids: torch.Tensor,
    offsets: torch.Tensor | None,
    weights: torch.Tensor | None,
    G: torch.Tensor,
    coef: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 per-sample norms and ``sum_i c_i grad_i``, by autograd one sample at a time."""
    ref = copy.deepcopy(layer).double()
    ref.include_last_offset = False
    norms, total = [], torch.zeros_like(ref.weight)
    for i in range(G.shape[0]):
        ref.zero_grad()
        x, o, w = split(ids, offsets, weights, i)
        out = ref(x, o, per_sample_weights=None if w is None else w.double())
        (out * G[i : i + 1].double()).sum().backward()
        norms.append(ref.weight.grad.norm())
        total += coef[i].double() * ref.weight.grad
    return torch.stack(norms), total


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pad", [None, 7, 0, -2])
@pytest.mark.parametrize(
    "mode, layout, psw",
    [
        ("sum", "offsets", False),
        ("sum", "offsets", True),
        ("mean", "offsets", False),
        ("sum", "2d", False),
        ("sum", "2d", True),
        ("mean", "2d", False),
        ("sum", "last_offset", False),
    ],
)
def test_norms_and_clipped_sum_equal_the_oracle(
    mode: str, layout: str, psw: bool, pad: int | None, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    layer = nn.EmbeddingBag(
        V, D, mode=mode, padding_idx=pad, include_last_offset=layout == "last_offset"
    ).to(dtype)
    if layout == "2d":
        ids = torch.randint(0, 4, (5, 6))
        ids[0] = 7
        offsets = None
    else:
        ids, offsets = bags()
    weights = torch.rand(ids.shape, dtype=dtype) if psw else None
    B = ids.shape[0] if offsets is None else offsets.numel()
    call_offsets = offsets
    if layout == "last_offset":
        call_offsets = torch.cat([offsets, torch.tensor([ids.numel()])])
    G = torch.randn(B, D, dtype=dtype)
    coef = torch.rand(B, dtype=dtype)
    stored = embedding_bag_inputs(layer, [ids, call_offsets, weights])
    assert stored[-1].shape == (B,)  # Opacus reads the batch size from the last input
    want_norm, want_sum = oracle(layer, ids, offsets, weights, G, coef)
    got = compute_embedding_bag_norm_sample(layer, stored, G)[layer.weight]
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), want_norm, rtol=rtol, atol=1e-12)
    summed = compute_embedding_bag_clipped_sum(layer, stored, G, coef)[layer.weight]
    assert summed.dtype == dtype and summed.shape == (V, D)
    torch.testing.assert_close(summed.double(), want_sum, rtol=rtol, atol=1e-6)
    if layout != "2d":
        assert float(got[2]) == 0.0  # the empty bag
    if pad is not None:
        assert torch.count_nonzero(summed[pad % V]) == 0


def test_the_reported_bag_of_one_repeated_id_counts_every_repeat() -> None:
    """Bag ``[7] * 8``, sum mode: the row of id 7 gets ``8 g``, norm ``8 ||g||``. Opacus'
    sampler, the inherited path, gave ``||g||`` (the norm 8x too small)."""
    from opacus.grad_sample.embedding import compute_embeddingbag_gradsampler

    layer = nn.EmbeddingBag(V, D, mode="sum")
    ids, offsets = torch.full((8,), 7), torch.tensor([0])
    G = torch.randn(1, D)
    got = compute_embedding_bag_norm_sample(layer, embedding_bag_inputs(layer, [ids, offsets]), G)
    torch.testing.assert_close(got[layer.weight], 8 * G.norm(dim=1), rtol=1e-6, atol=0)
    inherited = compute_embeddingbag_gradsampler(layer, [ids, offsets], G)[layer.weight]
    torch.testing.assert_close(inherited.flatten(1).norm(dim=1), G.norm(dim=1))  # the bug


def test_registered_in_opacus_rc_registries_only() -> None:
    from opacus.grad_sample import GradSampleModule
    from opacus.grad_sample.embedding import compute_embeddingbag_gradsampler

    assert SKETCHED_NORM_SAMPLERS[nn.EmbeddingBag] is compute_embedding_bag_norm_sample
    assert nn.EmbeddingBag in EXACT_NORM_TYPES
    assert CLIPPED_SUM_FUNCTIONS[nn.EmbeddingBag] is compute_embedding_bag_clipped_sum
    assert FORWARD_INPUT_ADAPTERS[nn.EmbeddingBag] is embedding_bag_inputs
    assert nn.EmbeddingBag in MODULE_CHECKS
    assert GradSampleModule.GRAD_SAMPLERS[nn.EmbeddingBag] is compute_embeddingbag_gradsampler


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "max"}, "mode='max'"),
        ({"max_norm": 1.0}, "max_norm"),
        ({"scale_grad_by_freq": True}, "scale_grad_by_freq"),
        ({"sparse": True}, "sparse"),
    ],
)
def test_unsupported_options_are_refused_at_make_private(
    kwargs: dict[str, Any], match: str
) -> None:
    model = BagNet(**kwargs)
    with pytest.raises(ValueError, match=match):
        private(model, bookkeeping=True)
    assert not hasattr(model, "autograd_grad_sample_hooks")


def test_bad_inputs_are_refused_clearly() -> None:
    layer = nn.EmbeddingBag(V, D)
    with pytest.raises(ValueError, match="needs offsets"):
        embedding_bag_inputs(layer, [torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="offsets must be None"):
        embedding_bag_inputs(layer, [torch.ones(2, 3, dtype=torch.long), torch.tensor([0, 3])])
    with pytest.raises(ValueError, match="batch_first=True"):
        embedding_bag_inputs(layer, [torch.ones(2, 3, dtype=torch.long)], batch_first=False)
    with pytest.raises(ValueError, match="integer tensor"):
        embedding_bag_inputs(layer, [torch.ones(2, 3)])


# ------------------------------------------------------------------------------------------------
# Through the engine: the released (clipped) gradient, with book-keeping and two passes
# ------------------------------------------------------------------------------------------------


class BagNet(nn.Module):
    """An embedding bag and a frozen linear head (so the bag's norm is the sample's norm)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(V, D, **kwargs)
        self.head = nn.Linear(D, 3)
        self.head.requires_grad_(False)

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
        keywords: bool = False,
    ) -> torch.Tensor:
        if keywords:  # every input of the bag by keyword
            h = self.bag(input=ids, offsets=offsets, per_sample_weights=per_sample_weights)
        elif per_sample_weights is not None:
            h = self.bag(ids, offsets, per_sample_weights)
        else:
            h = self.bag(ids, offsets)
        return self.head(h)


def private(model: nn.Module, *, bookkeeping: bool) -> tuple[Any, ...]:
    engine = PrivacyEngine()
    ds = TensorDataset(torch.zeros(20, 1), torch.zeros(20, dtype=torch.long))
    return engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(ds, batch_size=5),
        noise_multiplier=1.0,
        max_grad_norm=C,
        clipping="randomized",
        sketch_dim=8,
        bookkeeping=bookkeeping,
        criterion=nn.CrossEntropyLoss(),
    )


@pytest.mark.parametrize("bookkeeping", [True, False])
@pytest.mark.parametrize(
    "mode, layout, psw, pad",
    [
        ("sum", "offsets", False, None),
        ("mean", "offsets", False, 7),
        ("sum", "offsets", True, 0),
        ("sum", "2d", False, None),
        ("mean", "2d", False, 7),
        ("sum", "keywords", True, None),
    ],
)
def test_engine_clips_each_bag_as_the_oracle(
    mode: str, layout: str, psw: bool, pad: int | None, bookkeeping: bool
) -> None:
    """The engine's per-sample norms equal the float64 oracle's (one autograd call per sample,
    cross-entropy), and ``p.grad`` after the private backward is ``sum_i min(1, C / n_i) g_i``
    (C small: every non-empty bag is clipped). 2-D ids without offsets used to crash (``not enough
    values to unpack`` / ``'NoneType' object has no attribute 'detach'``)."""
    model = BagNet(mode=mode, padding_idx=pad)
    ref = copy.deepcopy(model).double()
    module, _, criterion, _ = private(model, bookkeeping=bookkeeping)
    assert module.norm_routes["bag"].path is NormPath.EXACT
    if layout == "2d":
        ids, offsets = torch.randint(0, 4, (5, 6)), None
        ids[0] = 7
    else:
        ids, offsets = bags()
    weights = torch.rand(ids.shape) if psw else None
    y = torch.tensor([0, 1, 2, 0, 1])
    out = module(ids, offsets, weights, keywords=layout == "keywords")
    criterion(out, y).backward()
    norms = module.get_norm_sample()
    want_norms, want = [], torch.zeros_like(ref.bag.weight)
    for i in range(5):
        x, o, w = split(ids, offsets, weights, i)
        logits = ref(x, o, per_sample_weights=None if w is None else w.double())
        (g,) = torch.autograd.grad(
            nn.functional.cross_entropy(logits, y[i : i + 1]), [ref.bag.weight]
        )
        want_norms.append(g.norm())
        want += min(1.0, C / (float(g.norm()) + 1e-6)) * g  # the engine's clip factor
    want_norms_t = torch.stack(want_norms)
    torch.testing.assert_close(norms, want_norms_t, rtol=1e-5, atol=1e-12)
    nonempty = want_norms_t > 0  # bag 2 of the 1-D layouts is empty, bag 0 all padding at 7
    assert int(nonempty.sum()) >= 3 and bool((want_norms_t[nonempty] > C).all())  # all clipped
    torch.testing.assert_close(model.bag.weight.grad.double(), want, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------------------------------------
# Item 1: nn.EmbeddingBag with a repeated id in one bag
# ------------------------------------------------------------------------------------------------


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.fc = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        return self.fc(self.bag(ids, offsets))


@pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning")
@pytest.mark.filterwarnings("ignore:book-keeping \\(one backward pass\\) is off:UserWarning")
@pytest.mark.parametrize("bookkeeping", [True, False])
def test_embedding_bag_repeated_id_is_summed_and_the_release_is_clipped(
    bookkeeping: bool,
) -> None:
    """Issue 20 item 1: bag ``[7] * 8`` (and a second bag of distinct ids). The inherited
    Opacus sampler counted the repeated row once (the issue's numbers: true norm 0.411,
    computed 0.051; with two passes a released contribution of 4.0 x C). Here the norms equal
    the float64 oracle's, and every sample's contribution to the released sum is at most C."""
    model = Bag()
    ids = torch.tensor([7] * 8 + [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    offsets = torch.tensor([0, 8, 12, 15])
    y = torch.tensor([0, 1, 1, 0])
    bounds = [*offsets.tolist(), len(ids)]

    def loss_of(ref: nn.Module, i: int) -> torch.Tensor:
        one = ids[bounds[i] : bounds[i + 1]]
        return nn.functional.cross_entropy(ref(one, torch.tensor([0])), y[i : i + 1])

    want = layer_oracle.per_sample_oracle(model, loss_of)
    C = 0.1
    _, module, opt, crit = layer_oracle.private(model, C=C, bookkeeping=bookkeeping, sigma=0.0)
    crit(module(ids, offsets), y).backward()
    # Rank-2 input of fc: its norm is exact too, so every norm matches to float32 rounding.
    coef = layer_oracle.check_step(model, module, want, C=C, rtol_sq=2 * layer_oracle.EXACT_RTOL)
    contributions = [
        float(coef[i]) * float(torch.cat([g[i].flatten() for g in want.values()]).norm())
        for i in range(layer_oracle.B)
    ]
    assert max(contributions) <= C * (1 + 1e-5)
    bag_norm = float(want["bag.weight"][0].norm())
    torch.testing.assert_close(
        module.norm_samples["bag.weight"][0].double(),
        torch.tensor(bag_norm, dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
