"""Empirical privacy auditing of randomized clipping: a canary attack on the real mechanism.

The attack (Jagielski, Ullman and Oprea 2020; Nasr et al. 2021, "Adversary instantiation"):
an adversary inserts a canary whose gradient is adversarial for randomized clipping (rank one,
so that the sketch's ratio ``W = n_hat / n`` is a single ``chi2_k / k``,
docs/privacy/estimators.md#estimators-hutchinson; a huge norm, so that the clipped contribution is
``C W^{-1/2}``, the worst case of docs/privacy/mechanism.md#mechanism-reduction; a fixed direction
``u``), runs one step of DP-SGD-RC with and without it, and scores the released gradient by its
projection on ``u``. If the mechanism is ``(epsilon, delta)``-DP, every test ``score > tau``
satisfies ``TPR <= e^epsilon FPR + delta`` and ``1 - FPR <= e^epsilon (1 - TPR) + delta``; with
Clopper-Pearson bounds on the empirical rates this gives an epsilon lower bound that holds with
probability ``1 - alpha`` (Bonferroni over all thresholds and both bounds).

Trials are batched (:func:`run_canary_audit`). One step of the real
:class:`~opacus_rc.grad_sample.GradSampleModuleRandomizedClipping` +
:class:`~opacus_rc.optimizers.RandomizedClipOptimizer` on ``nn.Linear(d, 2m, bias=False)`` with
inputs ``(B, 1, d)`` (rank 3, so the weight norm is sketched) holds ``m`` canaries and ``m``
empty rows: canary ``r`` has input ``e_0`` and output gradient ``canary_norm * e_r``, so its
gradient is ``canary_norm * e_r e_0^T`` and its direction is the weight entry ``(r, 0)``. Every
sample has its own probes, and every weight entry its own noise draw, so the ``m`` scores
``grad[r, 0]`` (``r < m``) are independent single-canary trials "with", and the ``m`` scores of
rows ``m..2m-1`` independent trials "without". A few background samples (input coordinate 0
equal to 0, so their gradients are orthogonal to every canary direction) make each batch a
realistic one without changing the scores' laws. The hypotheses are therefore exactly the pair
the accountant analyses for a rank-one record at ``q = 1``
(docs/privacy/mechanism.md#mechanism-reduction, "hidden"): the adversary sees the released gradient,
never the probes.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.stats import beta
from torch import nn

from opacus_rc.validation import validate_delta, validate_noise_multiplier

__all__ = [
    "AuditBound",
    "CanaryAuditResult",
    "clopper_pearson",
    "epsilon_lower_bound",
    "run_canary_audit",
]

#: Default thresholds on the score, in units of the noise std ``sigma * C``.
DEFAULT_THRESHOLDS = tuple(np.round(np.arange(0.5, 6.01, 0.5), 2))


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """One-sided Clopper-Pearson bounds, each holding with probability at least ``1 - alpha``.

    Args:
        successes: Observed count ``x`` (``0 <= x <= trials``).
        trials: Number of Bernoulli trials ``n >= 1``.
        alpha: Error probability of each one-sided bound, in ``(0, 1)``.

    Returns:
        ``(lower, upper)``: ``lower = Beta(alpha; x, n - x + 1)`` (0 if ``x = 0``) and
        ``upper = Beta(1 - alpha; x + 1, n - x)`` (1 if ``x = n``).

    Raises:
        ValueError: On counts out of range or ``alpha`` outside ``(0, 1)``.
    """
    if not (0 < alpha < 1):
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if trials < 1 or not (0 <= successes <= trials):
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes}/{trials}")
    lower = 0.0 if successes == 0 else float(beta.ppf(alpha, successes, trials - successes + 1))
    upper = (
        1.0
        if successes == trials
        else float(beta.ppf(1 - alpha, successes + 1, trials - successes))
    )
    return lower, upper


@dataclass(frozen=True)
class AuditBound:
    """The best epsilon lower bound at one ``delta`` and the test that gives it.

    Attributes:
        epsilon: The lower bound (``0.0`` if no test gives a positive one).
        delta: The delta it holds for.
        threshold: The threshold ``tau`` of the test ``score > tau`` (units of ``sigma C``).
        direction: ``"remove"`` (``TPR <= e^eps FPR + delta``) or ``"add"`` (the complement).
        tpr_interval: Clopper-Pearson ``(lower, upper)`` of the true positive rate.
        fpr_interval: Clopper-Pearson ``(lower, upper)`` of the false positive rate.
    """

    epsilon: float
    delta: float
    threshold: float | None = None
    direction: str | None = None
    tpr_interval: tuple[float, float] | None = None
    fpr_interval: tuple[float, float] | None = None


def epsilon_lower_bound(
    positives: Sequence[int],
    n_positive: int,
    false_positives: Sequence[int],
    n_negative: int,
    *,
    delta: float,
    alpha: float = 0.05,
    thresholds: Sequence[float] | None = None,
) -> AuditBound:
    """Epsilon lower bound from the counts of threshold tests (Clopper-Pearson, Bonferroni).

    For each threshold ``j``, ``positives[j]`` of ``n_positive`` trials with the canary and
    ``false_positives[j]`` of ``n_negative`` without scored above it. With ``L`` thresholds,
    each of the ``4 L`` one-sided bounds (TPR and FPR, lower and upper) holds with probability
    ``1 - alpha / (4 L)``, so all hold together with probability ``1 - alpha``; then for every
    threshold, if the mechanism is ``(epsilon, delta)``-DP,

    * remove: ``epsilon >= log((TPR_lo - delta) / FPR_hi)``,
    * add: ``epsilon >= log((1 - FPR_hi - delta) / (1 - TPR_lo))``.

    Args:
        positives: Counts of "with canary" scores above each threshold.
        n_positive: Number of "with canary" trials.
        false_positives: Counts of "without" scores above each threshold.
        n_negative: Number of "without" trials.
        delta: The delta of the bound.
        alpha: Total error probability.
        thresholds: The thresholds (only reported back).

    Returns:
        The largest bound over thresholds and directions.
    """
    if len(positives) != len(false_positives):
        raise ValueError("positives and false_positives need one count per threshold")
    validate_delta(delta)
    a = alpha / (4 * len(positives))
    best = AuditBound(epsilon=0.0, delta=delta)
    for j, (tp, fp) in enumerate(zip(positives, false_positives, strict=True)):
        tpr = clopper_pearson(int(tp), n_positive, a)
        fpr = clopper_pearson(int(fp), n_negative, a)
        candidates = {
            "remove": (tpr[0] - delta, fpr[1]),
            "add": (1.0 - fpr[1] - delta, 1.0 - tpr[0]),
        }
        for direction, (num, den) in candidates.items():
            if num <= 0:
                continue
            eps = math.inf if den <= 0 else math.log(num / den)
            if eps > best.epsilon:
                best = AuditBound(
                    epsilon=eps,
                    delta=delta,
                    threshold=None if thresholds is None else float(thresholds[j]),
                    direction=direction,
                    tpr_interval=tpr,
                    fpr_interval=fpr,
                )
    return best


@dataclass
class CanaryAuditResult:
    """Counts of a canary audit (see :func:`run_canary_audit`).

    Attributes:
        sketch_dim: ``k``.
        noise_multiplier: ``sigma``.
        max_grad_norm: ``C``.
        trials: Trials per hypothesis (with / without canary).
        thresholds: Thresholds in units of ``sigma C``.
        positives: Per threshold, "with canary" scores above it.
        false_positives: Per threshold, "without" scores above it.
        steps: Optimizer steps run.
        mean_contribution: Mean released canary contribution ``c_r canary_norm`` (units of C):
            the sample mean of ``S``.
        max_contribution: Largest released canary contribution (units of C).
    """

    sketch_dim: int
    noise_multiplier: float
    max_grad_norm: float
    trials: int
    thresholds: tuple[float, ...]
    positives: list[int]
    false_positives: list[int]
    steps: int
    mean_contribution: float
    max_contribution: float
    bounds: dict[float, AuditBound] = field(default_factory=dict)

    def lower_bound(self, delta: float, *, alpha: float = 0.05) -> AuditBound:
        """:func:`epsilon_lower_bound` of these counts at ``delta``."""
        bound = epsilon_lower_bound(
            self.positives,
            self.trials,
            self.false_positives,
            self.trials,
            delta=delta,
            alpha=alpha,
            thresholds=self.thresholds,
        )
        self.bounds[delta] = bound
        return bound


class _InnerProductLoss(nn.Module):
    """``loss_i = <out_i, target_i>``: the per-sample output gradient is exactly ``target_i``."""

    reduction = "sum"

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        per_sample = (out * target).flatten(1).sum(1)
        return per_sample if self.reduction == "none" else per_sample.sum()


def run_canary_audit(
    *,
    sketch_dim: int,
    noise_multiplier: float,
    trials: int,
    trials_per_step: int = 1000,
    max_grad_norm: float = 1.0,
    canary_norm: float = 1e6,
    sketch: str = "hutchinson",
    in_features: int = 4,
    background: int = 8,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    seed: int | None = 0,
) -> CanaryAuditResult:
    """Run ``trials`` canary trials per hypothesis through the real randomized-clipping step.

    See the module docstring for the construction. Each optimizer step is one non-subsampled
    (``q = 1``) step of DP-SGD-RC with ``loss_reduction="sum"``; it yields ``trials_per_step``
    trials with and as many without the canary.

    Args:
        sketch_dim: ``k``.
        noise_multiplier: ``sigma`` (> 0).
        trials: Trials per hypothesis (rounded up to a multiple of ``trials_per_step``).
        trials_per_step: Canaries per step (memory ``~ 2 (m + background) m`` floats).
        max_grad_norm: ``C``.
        canary_norm: Gradient norm of each canary (huge: ``canary_norm >> C``).
        sketch: Estimator name.
        in_features: ``d`` of the audited layer (>= 2).
        background: Ordinary samples per step (orthogonal to the canaries).
        thresholds: Score thresholds, in units of ``sigma C``.
        seed: Seeds the sketch, noise and background generators, for a reproducible audit (the
            simulated adversary does not use them); ``None`` uses fresh OS-seeded sketches.

    Returns:
        The counts; call :meth:`CanaryAuditResult.lower_bound` for epsilon lower bounds.
    """
    from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
    from opacus_rc.grad_sample.clip import clip_factors
    from opacus_rc.optimizers import (
        DPLossRandomizedClipping,
        RandomizedClipOptimizer,
        attach_post_processing_hook,
    )

    validate_noise_multiplier(noise_multiplier, allow_zero=False)
    if in_features < 2:
        raise ValueError("in_features must be >= 2 (coordinate 0 is reserved for the canaries)")
    m = int(trials_per_step)
    steps = math.ceil(trials / m)
    C = float(max_grad_norm)
    gens = [None if seed is None else torch.Generator().manual_seed(seed + i) for i in range(3)]
    sketch_gen, noise_gen, data_gen = gens
    model = nn.Linear(in_features, 2 * m, bias=False)
    with warnings.catch_warnings():
        # A seeded sketch generator is the audit's own choice, for reproducibility.
        warnings.filterwarnings("ignore", message="a sketch_generator was passed")
        gsm = GradSampleModuleRandomizedClipping(
            model,
            max_grad_norm=C,
            sketch=sketch,
            sketch_dim=sketch_dim,
            sketch_generator=sketch_gen,
            loss_reduction="sum",
        )
    opt = RandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=0.0),
        grad_sample_module=gsm,
        noise_multiplier=float(noise_multiplier),
        max_grad_norm=C,
        expected_batch_size=m + background,
        loss_reduction="sum",
        generator=noise_gen,
    )
    crit = DPLossRandomizedClipping(gsm, opt, _InnerProductLoss(), "sum")
    released: list[torch.Tensor] = []
    attach_post_processing_hook(opt, lambda o: released.append(o.params[0].grad[:, 0].clone()))

    B = m + background
    x = torch.zeros(B, 1, in_features)
    x[:m, 0, 0] = 1.0  # canaries: input e_0
    target = torch.zeros(B, 1, 2 * m)
    target[torch.arange(m), 0, torch.arange(m)] = canary_norm  # canary r: output gradient e_r
    tau = torch.tensor([float(t) for t in thresholds], dtype=torch.float64)
    positives = torch.zeros(len(tau), dtype=torch.long)
    false_positives = torch.zeros(len(tau), dtype=torch.long)
    total, largest = 0.0, 0.0
    try:
        for _ in range(steps):
            x[m:, 0, 1:] = torch.randn(background, in_features - 1, generator=data_gen)
            target[m:, 0] = torch.randn(background, 2 * m, generator=data_gen)
            crit(gsm(x), target).backward()
            contribution = clip_factors(gsm.per_sample_gradient_norms[:m], max_grad_norm=C)
            contribution = contribution * canary_norm / C
            total += float(contribution.sum())
            largest = max(largest, float(contribution.max()))
            opt.step()
            opt.zero_grad()
            score = released.pop().double() / (noise_multiplier * C)
            positives += (score[:m, None] > tau).sum(0)
            false_positives += (score[m:, None] > tau).sum(0)
    finally:
        gsm.cleanup()
    return CanaryAuditResult(
        sketch_dim=sketch_dim,
        noise_multiplier=float(noise_multiplier),
        max_grad_norm=C,
        trials=steps * m,
        thresholds=tuple(float(t) for t in thresholds),
        positives=positives.tolist(),
        false_positives=false_positives.tolist(),
        steps=steps,
        mean_contribution=total / (steps * m),
        max_contribution=largest,
    )
