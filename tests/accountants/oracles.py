"""Independent epsilon oracles for the accountant's tests.

1. :func:`pld_epsilons`: dp_accounting's PLD accountant with a mixture-of-Gaussians event.
2. :func:`longdouble_psg_epsilons`: exact clipping only: prv_accountant's own discretisation of
   the Poisson-subsampled Gaussian PRV, composed by an FFT in extended (80-bit) precision, so
   that round-off (about 1e-19 per entry instead of 1e-16) does not decide small deltas.

Measured limits of oracle 1 (dp_accounting 0.6.0, interval 1e-4): at 1000 steps its epsilon
at delta = 1e-12 moves by 0.014 with ``log_mass_truncation_bound`` (-50: 3.9054, -80: 3.9053;
3.9189 with ``tail_mass_truncation=1e-22``) and at delta = 1e-13 by more than 0.5: the
float64 round-off of its FFT. Oracle 2 gives 3.91431 and 4.22979 there. Tests use oracle 1
where it is stable (delta >= 1e-10 at 1000 steps, >= 1e-12 at 100) with a tolerance of 0.003,
oracle 2 (and the Gaussian closed form) below.

Oracle 1, details.

The hidden-model pair of one DP-SGD-RC step (docs/privacy/prv.md#prv-hidden) is ``N(0, sigma^2)``
versus ``(1 - q) N(0, sigma^2) + q E_S N(S, sigma^2)``: a mixture-of-Gaussians mechanism
(``dp_accounting.pld.privacy_loss_distribution.from_mixture_gaussian_mechanism``, Choquette-Choo et
al. 2023) once the law of ``S`` is made discrete. The envelope law of ``S``
(:class:`~opacus_rc.accountants.analysis.envelope.SensitivityEnvelope`: an atom at 1, a density on
``(1, inf)``) is put into ``buckets`` cells, equally spaced in ``log s`` up to the ``1 - tail``
quantile:

* ``rounding="up"`` gives every cell's mass to its right end: a stochastically larger ``S``,
  hence a dominating mechanism (docs/privacy/dominance.md#dominance); with ``pessimistic=True`` its
  epsilon is an upper bound on the true one, up to the last ``tail`` of mass, put at the last edge
  (a sensitivity of ``10^3`` would make dp_accounting's loss grid unaffordably long), which can
  lower delta by at most ``steps * q * tail`` (``1e-20`` for ``10^4`` steps);
* ``rounding="down"`` gives every cell's mass to its left end and the tail to the last edge: a
  dominated mechanism; with ``pessimistic=False`` a lower estimate.

Exact clipping (``sketch_dim=None``) is the Poisson-subsampled Gaussian: sensitivities
``[0, 1]``. dp_accounting is a dev dependency; this module is imported by tests only.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from opacus_rc.accountants.analysis.envelope import SensitivityEnvelope


def sensitivities(
    sketch_dim: int | None, *, rounding: str, buckets: int = 96, tail: float = 1e-22
) -> tuple[np.ndarray, np.ndarray]:
    """``(values, probabilities)`` of the discretised law of ``S`` (units of ``C``)."""
    if sketch_dim is None:
        return np.ones(1), np.ones(1)
    env = SensitivityEnvelope(sketch_dim=sketch_dim)
    top = float(env.isf(tail))
    edges = np.exp(np.linspace(0.0, np.log(top), buckets + 1))
    cdf = np.asarray(env.cdf(edges), dtype=float)
    cdf[0] = env.atom()  # P(S <= 1) is the atom
    mass = np.diff(cdf)
    if rounding == "up":
        values = np.concatenate([[1.0], edges[1:], [top]])
    elif rounding == "down":
        values = np.concatenate([[1.0], edges[:-1], [top]])
    else:
        raise ValueError(rounding)
    probs = np.concatenate([[env.atom()], mass, [float(env.sf(top))]])
    keep = probs > 0
    return values[keep], probs[keep] / probs[keep].sum()


@functools.lru_cache(maxsize=32)
def pld_epsilons(
    *,
    sigma: float,
    q: float,
    steps: int,
    sketch_dim: int | None = None,
    pessimistic: bool = True,
    interval: float = 1e-4,
    deltas: tuple[float, ...] = (1e-5,),
    buckets: int = 96,
) -> tuple[float, ...]:
    """dp_accounting's epsilon (max over its remove and add PLDs) at each delta.

    ``pessimistic=True`` uses the sensitivities rounded up and dp_accounting's pessimistic
    (connect-the-dots) discretisation: an upper bound. ``pessimistic=False`` rounds down and
    uses the optimistic privacy-buckets discretisation: a lower estimate.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    logging.getLogger("absl").setLevel(logging.ERROR)
    if sketch_dim is None:
        pld = pld_lib.from_gaussian_mechanism(
            sigma,
            sampling_prob=q,
            pessimistic_estimate=pessimistic,
            value_discretization_interval=interval,
            log_mass_truncation_bound=-80.0,
        )
        composed = pld.self_compose(steps, tail_mass_truncation=1e-24)
        return tuple(float(composed.get_epsilon_for_delta(d)) for d in deltas)
    rounding = "up" if pessimistic else "down"
    s, p = sensitivities(sketch_dim, rounding=rounding, buckets=buckets)
    sens = np.concatenate([[0.0], s])
    probs = np.concatenate([[1.0 - q], q * p])
    pld = pld_lib.from_mixture_gaussian_mechanism(
        standard_deviation=sigma,
        sensitivities=sens.tolist(),
        sampling_probs=probs.tolist(),
        pessimistic_estimate=pessimistic,
        value_discretization_interval=interval,
        use_connect_dots=pessimistic,
        log_mass_truncation_bound=-80.0,
    )
    composed = pld.self_compose(steps, tail_mass_truncation=1e-24)
    return tuple(float(composed.get_epsilon_for_delta(d)) for d in deltas)


def longdouble_psg_epsilons(
    *, sigma: float, q: float, steps: int, deltas: tuple[float, ...], mesh: float = 1e-4
) -> tuple[float, ...]:
    """Oracle 2: epsilon estimates of the remove direction of exact clipping.

    prv_accountant's ``PoissonSubsampledGaussianMechanism`` PRV, truncated to ``[-30, 30]``
    and discretised by its ``CellCentred`` discretiser (mean-preserving, mesh ``mesh``), then
    composed ``steps`` times by ``scipy.fft`` in ``np.longdouble``; ``delta(eps)`` is summed in
    long double and solved by Brent's method. Its precision: its cell masses are differences
    of prv_accountant's float64 CDF, so tail cells below about 1e-17 are inexact; at 1000
    steps the estimate moved by 2e-4 (delta = 1e-13) and 5e-3 (delta = 1e-15) between meshes
    1e-4 and 5e-5, and by less than 1e-4 at delta >= 1e-12.
    """
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant.discretisers import CellCentred
    from prv_accountant.domain import Domain
    from prv_accountant.privacy_random_variables import PrivacyRandomVariableTruncated
    from scipy import fft, optimize

    prv = PoissonSubsampledGaussianMechanism(q, sigma)
    domain = Domain.create_aligned(-30.0, 30.0, mesh)
    disc = CellCentred().discretise(
        PrivacyRandomVariableTruncated(prv, domain.t_min(), domain.t_max()), domain
    )
    pmf = disc.pmf.astype(np.longdouble)
    out = fft.irfft(fft.rfft(pmf) ** steps, n=pmf.size)
    out = np.roll(out, steps - 1 + (pmf.size // 2 if steps % 2 == 0 else 0))
    t = disc.domain.shift_right(disc.domain.shifts() * (steps - 1)).ts().astype(np.longdouble)

    def delta_of(eps: float) -> float:
        keep = t >= eps
        return float(np.sum(out[keep] * (1.0 - np.exp(eps - t[keep]))))

    return tuple(
        float(optimize.brentq(lambda e, d=d: delta_of(e) - d, -1.0, 29.0, xtol=1e-10))
        for d in deltas
    )


#: The stored oracle values (k = 32, hidden, chi2 envelope, q = 0.01, sigma = 1):
#: ``steps -> {delta: (rounded down, rounded up)}``, 1600 buckets, both dp_accounting 0.6.0
#: pessimistic (connect-the-dots) PLDs with ``interval=1e-4``; regenerate with
#: ``python tests/accountants/oracles.py`` (about 20 minutes on one core). Below
#: ``delta = 1e-10`` they carry dp_accounting's own float64 round-off (down > up at 1e-13).
STORED_CONFIGS = {100: (1e-5, 1e-10, 1e-12, 1e-13), 1000: (1e-5, 1e-10, 2e-12, 1e-12)}


def _main() -> None:  # pragma: no cover - regenerates the stored values
    import time

    for steps, deltas in STORED_CONFIGS.items():
        row = {}
        for rounding in ("down", "up"):
            start = time.perf_counter()
            s, p = sensitivities(32, rounding=rounding, buckets=1600)
            from dp_accounting.pld import privacy_loss_distribution as pld_lib

            sens = np.concatenate([[0.0], s])
            probs = np.concatenate([[0.99], 0.01 * p])
            pld = pld_lib.from_mixture_gaussian_mechanism(
                standard_deviation=1.0,
                sensitivities=sens.tolist(),
                sampling_probs=probs.tolist(),
                pessimistic_estimate=True,
                value_discretization_interval=1e-4,
                use_connect_dots=True,
                log_mass_truncation_bound=-80.0,
            )
            composed = pld.self_compose(steps, tail_mass_truncation=1e-24)
            row[rounding] = [composed.get_epsilon_for_delta(d) for d in deltas]
            print(steps, rounding, f"{time.perf_counter() - start:.0f} s", flush=True)
        print(
            f"    {steps}: {{"
            + ", ".join(
                f"{d:g}: ({lo:.4f}, {hi:.4f})" for d, lo, hi in zip(deltas, row["down"], row["up"])
            )
            + "},",
            flush=True,
        )


if __name__ == "__main__":  # pragma: no cover
    logging.getLogger("absl").setLevel(logging.ERROR)
    _main()

STORED = {
    100: {
        1e-05: (0.9218, 0.9245), 1e-10: (2.8572, 2.8651),
        1e-12: (3.6503, 3.6582), 1e-13: (4.0366, 4.0306),
    },
    1000: {
        1e-05: (2.1379, 2.1419), 1e-10: (4.0748, 4.0844),
        2e-12: (4.7669, 4.7737), 1e-12: (4.8878, 4.8907),
    },
}  # fmt: skip
