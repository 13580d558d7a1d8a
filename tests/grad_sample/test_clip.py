"""The clip factors are made by one function and applied by one (opacus_rc/grad_sample/clip.py).

* :func:`clip_factors` against a float64 oracle and bit for bit against the expression the
  step and the canary audit each wrote before;
* its arithmetic against float64 oracles (scale, batch sum, rows of a sample, in place for
  ``B = 1``) and the expressions each caller used before (bit for bit);
* one path: with every caller's ``apply_clip_factors`` replaced by one that applies ``c = 0``,
  a sigma = 0 step of a model with every clipped-sum kind (``nn.Linear``, ``nn.Embedding``,
  ``nn.EmbeddingBag``, an Opacus grad sampler's per-sample gradients) releases exactly zero for
  every parameter, with book-keeping and with two passes: no clip factor is applied elsewhere;
* equivalence: released gradients recorded on main before the refactor (fingerprints to
  float tolerance: CPUs differ in last bits).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.grad_sample.clip import CLIP_EPSILON, apply_clip_factors, clip_factors
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")


def test_clip_factors_against_float64_oracle_and_the_former_expression() -> None:
    g = torch.Generator().manual_seed(4)
    norms = torch.cat([torch.zeros(1), torch.rand(7, generator=g) * 3.0]).double()
    C = 1.3
    oracle = [min(1.0, C / (float(n) + 1e-6)) for n in norms]  # Opacus' min(1, C / (n + 1e-6))
    out = clip_factors(norms, max_grad_norm=C)
    assert out.dtype == torch.float64 and CLIP_EPSILON == 1e-6
    assert out.tolist() == pytest.approx(oracle, rel=1e-15, abs=0)
    assert out[0] == 1.0 and bool((out * norms <= C).all())  # c_i n_i <= C, zero norm finite
    # Bit for bit what step.py and auditing.py computed inline before.
    assert torch.equal(out, (C / (norms + 1e-6)).clamp(max=1.0))
    f32 = norms.float()
    assert torch.equal(clip_factors(f32, max_grad_norm=C), (C / (f32 + 1e-6)).clamp(max=1.0))


def test_scale_and_sum_against_float64_oracle() -> None:
    g = torch.Generator().manual_seed(0)
    c = torch.rand(5, generator=g)
    x = torch.randn(5, 3, 4, generator=g)
    oracle = c.double()[:, None, None] * x.double()
    scaled = apply_clip_factors(c, x)
    assert scaled.shape == (5, 3, 4) and scaled.dtype == torch.float32
    torch.testing.assert_close(scaled.double(), oracle, rtol=1e-7, atol=0)
    summed = apply_clip_factors(c, x, reduce=True)
    assert summed.shape == (3, 4)
    # float32 sum of 5 products: relative error <= 5 * 2^-24 of sum |c_i x_i| (Higham 2002, 3.1)
    bound = 5 * 2.0**-24 * oracle.abs().sum(0)
    assert ((summed.double() - oracle.sum(0)).abs() <= bound).all()
    # rows of samples: row j belongs to sample s(j)
    rows = torch.randn(7, 2, generator=g, dtype=torch.float64)
    s = torch.tensor([0, 0, 1, 4, 4, 4, 2])
    out = apply_clip_factors(c, rows, dtype=torch.float64, sample_of=s)
    assert torch.equal(out, c.double()[s][:, None] * rows)


def test_dtype_rules() -> None:
    c32, c64 = torch.rand(3), torch.rand(3, dtype=torch.float64)
    x16 = torch.randn(3, 2).to(torch.bfloat16)
    assert apply_clip_factors(c32, x16).dtype == torch.float32  # as c * x promotes
    assert apply_clip_factors(c64, torch.randn(3)).dtype == torch.float64
    assert apply_clip_factors(c32, x16, dtype=torch.bfloat16).dtype == torch.bfloat16
    # the product is taken in dtype, after both are converted to it
    assert torch.equal(
        apply_clip_factors(c32, x16, dtype=torch.bfloat16),
        x16 * c32.to(torch.bfloat16)[:, None],
    )


def test_consume_scales_the_one_sample_in_place() -> None:
    c = torch.tensor([0.25])
    x = torch.randn(1, 4, 3)
    expected = 0.25 * x[0].clone()
    out = apply_clip_factors(c, x, reduce=True, consume=True)
    assert out.data_ptr() == x.data_ptr() and torch.equal(out, expected)
    y = torch.randn(1, 4, 3)
    out = apply_clip_factors(c, y, reduce=True)  # not consumed: a new tensor
    assert out.data_ptr() != y.data_ptr() and torch.equal(out, 0.25 * y[0])


def test_bit_identical_to_the_callers_former_expressions() -> None:
    g = torch.Generator().manual_seed(1)
    c = torch.rand(6, generator=g)
    G = torch.randn(6, 9, 5, generator=g)
    # nn.Linear weight (G3 * c.view(B, 1, 1)) and bias (c @ g_sum)
    assert torch.equal(apply_clip_factors(c, G, dtype=G.dtype), G * c.view(6, 1, 1))
    g_sum = G.sum(1)
    assert torch.equal(apply_clip_factors(c, g_sum, dtype=torch.float32, reduce=True), c @ g_sum)
    # book-keeping of per-sample gradients (tensordot) and the two-pass loss (c * losses)
    assert torch.equal(apply_clip_factors(c, G, reduce=True), torch.tensordot(c, G, dims=1))
    losses = torch.randn(6, generator=g, dtype=torch.float64)
    assert torch.equal(apply_clip_factors(c, losses), c * losses)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="shape \\(B,\\)"):
        apply_clip_factors(torch.ones(2, 1), torch.ones(2, 3))
    with pytest.raises(ValueError, match="one factor per sample"):
        apply_clip_factors(torch.ones(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="sample_of"):
        apply_clip_factors(torch.ones(3), torch.ones(4, 2), sample_of=torch.zeros(3).long())
    with pytest.raises(ValueError, match="sample_of"):
        apply_clip_factors(
            torch.ones(3), torch.ones(4, 2), sample_of=torch.zeros(4).long(), reduce=True
        )


class Net(nn.Module):
    """Every kind of clipped sum: Linear, Embedding, EmbeddingBag (ours), LayerNorm (Opacus'
    grad sampler: per-sample gradients stashed)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.bag = nn.EmbeddingBag(9, 6, mode="mean")
        self.ln = nn.LayerNorm(6)
        self.lin = nn.Linear(6, 4)

    def forward(self, ids: torch.Tensor, bag_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.bag(bag_ids).unsqueeze(1)
        return self.lin(self.ln(h)).mean(1)


def released(batch: int, dtype: torch.dtype, bookkeeping: bool, sigma: float = 0.9) -> Any:
    torch.manual_seed(0)
    model = Net().to(dtype)
    gsm = GradSampleModuleRandomizedClipping(
        model,
        max_grad_norm=0.5,
        sketch_dim=4,
        loss_reduction="mean",
        sketch_generator=torch.Generator().manual_seed(123),
        bookkeeping=bookkeeping,
    )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.5),
        grad_sample_module=gsm,
        noise_multiplier=sigma,
        expected_batch_size=batch,
        loss_reduction="mean",
        generator=torch.Generator().manual_seed(7),
    )
    crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(reduction="mean"), "mean")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (batch, 5), generator=g)
    bag = torch.randint(0, 9, (batch, 3), generator=g)
    y = torch.randint(0, 4, (batch,), generator=g)
    seen: list[dict[str, torch.Tensor]] = []
    names = {p: n for n, p in model.named_parameters()}
    opt.attach_step_hook(lambda o: seen.append({names[p]: p.grad.clone() for p in o.params}))
    crit(gsm(ids, bag), y).backward()
    opt.step()
    return seen[0]


@pytest.mark.parametrize("bookkeeping", [True, False])
@pytest.mark.parametrize("batch", [1, 6])
def test_every_clip_factor_goes_through_the_one_function(
    monkeypatch: pytest.MonkeyPatch, bookkeeping: bool, batch: int
) -> None:
    baseline = released(batch, torch.float32, bookkeeping, sigma=0.0)
    assert all(g.abs().sum() > 0 for g in baseline.values())  # every parameter has a gradient
    real = apply_clip_factors

    def zero_factors(clip_factors: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return real(torch.zeros_like(clip_factors), *args, **kwargs)

    callers = [
        mod
        for name, mod in sys.modules.items()
        if name.startswith("opacus_rc.") and getattr(mod, "apply_clip_factors", None) is real
    ]
    # private_step (two passes; it hands the function to units.split for a cut unit's closed
    # sum, issue 31), linear, embedding, embedding_bag, bookkeeping (book-keeping)
    assert {m.__name__ for m in callers} >= {
        "opacus_rc.grad_sample.private_step",
        "opacus_rc.grad_sample.linear",
        "opacus_rc.grad_sample.embedding",
        "opacus_rc.grad_sample.embedding_bag",
        "opacus_rc.grad_sample.bookkeeping",
    }
    for mod in callers:
        monkeypatch.setattr(mod, "apply_clip_factors", zero_factors)
    out = released(batch, torch.float32, bookkeeping, sigma=0.0)
    assert set(out) == set(baseline)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in out.values()), {
        n: g.abs().max().item() for n, g in out.items()
    }


def fingerprint(flat: torch.Tensor) -> torch.Tensor:
    """(sum, sum of squares, position-weighted sum) of the released gradients, in float64."""
    f = flat.detach().double()
    w = torch.arange(1, f.numel() + 1, dtype=torch.float64) / f.numel()
    return torch.stack([f.sum(), (f * f).sum(), (f * w).sum()])


# Recorded from main at dc844e0 (before the clip factor was applied in one place):
# (batch, dtype, bookkeeping) -> fingerprint of the released gradients (sigma = 0.9, seeded
# noise). On the machine that recorded them the current code's released gradients were bit for
# bit dc844e0's in all eight cases; a SHA-256 of the bytes is not portable across CPUs (AMD
# EPYC and Intel Xeon differ in last bits: the kernels sum in another order), so the test
# compares fingerprints. Tolerance: each of the ~160 coordinates may move by a few ulps between
# CPUs (float32: relative < 1e-6; float64: < 1e-14), so the sums move by < 160 * that * max|g|:
# atol 1e-4 * ||g||_2 for float32 and 1e-11 * ||g||_2 for float64 (a changed clip factor or
# divisor moves them by far more).
MAIN_FINGERPRINTS = {
    (1, torch.float32, True): (-3.236039716284722, 30.84800890215601, -1.9362364115251691),
    (1, torch.float32, False): (-3.236039936542511, 30.84800893906629, -1.9362365839537237),
    (1, torch.float64, True): (3.170039627194797, 37.14481792442364, -0.5236181171641118),
    (1, torch.float64, False): (3.170039627194797, 37.14481792442364, -0.523618117164112),
    (6, torch.float32, True): (-0.6622619115514681, 0.8489754154491752, -0.4197848124138546),
    (6, torch.float32, False): (-0.6622618593974039, 0.8489753999084781, -0.41978476044023416),
    (6, torch.float64, True): (0.4054180050037285, 1.0541070005864284, -0.184348394011724),
    (6, torch.float64, False): (0.40541800500372854, 1.0541070005864284, -0.18434839401172393),
}


@pytest.mark.parametrize(("batch", "dtype", "bookkeeping"), list(MAIN_FINGERPRINTS))
def test_released_gradient_equals_main_before_the_refactor(
    batch: int, dtype: torch.dtype, bookkeeping: bool
) -> None:
    out = released(batch, dtype, bookkeeping)
    got = fingerprint(torch.cat([g.flatten() for g in out.values()]))
    want = torch.tensor(MAIN_FINGERPRINTS[(batch, dtype, bookkeeping)], dtype=torch.float64)
    tol = (1e-4 if dtype == torch.float32 else 1e-11) * want[1].sqrt().item()
    assert torch.allclose(got, want, rtol=0, atol=tol), (got.tolist(), want.tolist())
