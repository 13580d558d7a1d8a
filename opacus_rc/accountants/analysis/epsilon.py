"""Epsilon of a history of DP-SGD-RC steps: budgets, PRVs in both directions, composition.

:func:`compute_epsilon` groups a history of :class:`Segment` runs, builds the capped PRVs of
every distinct step in both adjacency directions (docs/privacy/adjacency.md#adjacency) and composes
them (:func:`~opacus_rc.accountants.analysis.compose.compose_prvs`). It splits delta into budgets
chosen from the requested delta and the number of steps ``T``:

* ``delta_error`` (default ``delta / 1000``): the discretisation's probability budget;
* the envelope's revealing tail ``eta`` (docs/privacy/prv.md#prv-quadrature), ``T eta <= 1e-4
  delta`` (rounded down to a power of ten, at most ``1e-15``): the mass it puts at infinity never
  decides whether a small delta can be reached;
* the cap (docs/privacy/prv.md#prv-tail-cap): ``T P(Y > t_cap) <= 1e-3 delta``.

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from opacus_rc.accountants.analysis.compose import compose_prvs
from opacus_rc.accountants.analysis.envelope import DEFAULT_ETA, ENVELOPES, SensitivityEnvelope
from opacus_rc.accountants.analysis.errors import EpsilonOutOfRangeError
from opacus_rc.accountants.analysis.prv import DIRECTIONS, RandomizedClippingPRV, choose_t_cap
from opacus_rc.accountants.analysis.threat_models import THREAT_MODELS
from opacus_rc.validation import (
    validate_choice,
    validate_delta,
    validate_noise_multiplier,
    validate_sample_rate,
)

__all__ = [
    "ETA_DELTA_FRACTION",
    "EpsilonReport",
    "Segment",
    "choose_eta",
    "compute_epsilon",
    "compute_epsilon_replace_one",
]

#: The envelope's revealing tail may spend at most this fraction of delta over all steps.
ETA_DELTA_FRACTION = 1e-4


def choose_eta(*, steps: int, delta: float) -> float:
    """The revealing tail ``eta`` of the envelope for ``steps`` steps at ``delta``.

    ``min(1e-15, 10^floor(log10(1e-4 delta / steps)))``: the total revealing mass ``steps * eta``
    is at most ``1e-4 delta``, and powers of ten keep the per-``eta`` table cache small.
    """
    budget = ETA_DELTA_FRACTION * float(delta) / max(int(steps), 1)
    return min(DEFAULT_ETA, 10.0 ** math.floor(math.log10(budget)))


#: Smallest noise multiplier the accountant computes epsilon for (see :func:`compute_epsilon`).
MIN_NOISE_MULTIPLIER = 0.01


@dataclass(frozen=True)
class Segment:
    """A run of identical steps: ``steps`` steps of noise ``sigma`` and rate ``q`` with sketch
    ``k``.

    Attributes:
        noise_multiplier: ``sigma`` (noise std / clipping bound), > 0, or 0 for steps without
            noise (epsilon infinite).
        sample_rate: ``q`` in ``(0, 1]``.
        steps: Number of steps, >= 0.
        sketch_dim: ``k`` of the envelope, or ``None`` for exact clipping.
        threat_model: ``"hidden"`` or ``"revealed"`` for this run of steps.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    sketch_dim: int | None = None
    threat_model: str = "hidden"

    def __post_init__(self) -> None:
        sigma = validate_noise_multiplier(self.noise_multiplier)
        object.__setattr__(self, "noise_multiplier", sigma)
        object.__setattr__(self, "sample_rate", validate_sample_rate(self.sample_rate))
        if isinstance(self.steps, bool) or int(self.steps) != self.steps or self.steps < 0:
            raise ValueError(f"steps must be an integer >= 0, got {self.steps!r}")
        object.__setattr__(self, "steps", int(self.steps))
        SensitivityEnvelope(sketch_dim=self.sketch_dim)  # validates
        validate_choice("threat_model", self.threat_model, THREAT_MODELS)
        if self.sketch_dim is None:
            object.__setattr__(self, "threat_model", "hidden")  # S = 1: both models coincide
        else:
            object.__setattr__(self, "sketch_dim", int(self.sketch_dim))

    @property
    def key(self) -> tuple:
        return (self.noise_multiplier, self.sample_rate, self.sketch_dim, self.threat_model)


@dataclass(frozen=True)
class EpsilonReport:
    """Epsilon bounds of a composition in both adjacency directions.

    Attributes:
        remove: ``(lower, estimate, upper)`` for the remove direction.
        add: ``(lower, estimate, upper)`` for the add direction.
        delta: The delta the bounds are for.
    """

    remove: tuple[float, float, float]
    add: tuple[float, float, float]
    delta: float

    @property
    def upper(self) -> float:
        """The guaranteed epsilon: max over directions of the upper bounds."""
        return max(self.remove[2], self.add[2])

    @property
    def estimate(self) -> float:
        """Max over directions of the estimates (what
        docs/privacy/reference_numbers.md#reference-epsilon tabulates)."""
        return max(self.remove[1], self.add[1])

    @property
    def dominant_direction(self) -> str:
        """``"remove"`` or ``"add"``, whichever gives the larger upper bound."""
        return "remove" if self.remove[2] >= self.add[2] else "add"


def compute_epsilon(
    segments: Sequence[Segment],
    *,
    delta: float,
    envelope: str = "chi2",
    eps_error: float = 0.01,
    delta_error: float | None = None,
) -> EpsilonReport:
    """Epsilon of a (possibly heterogeneous) history of DP-SGD-RC steps, both directions.

    Identical segments are merged (composition is commutative); each distinct configuration
    gets one PRV per direction with the revealing tail of :func:`choose_eta`, capped by
    :func:`~opacus_rc.accountants.analysis.prv.choose_t_cap` with the total step count.
    Epsilon is reported as 0 where the bound would be negative (large delta), as
    ``dp_accounting`` does.

    Args:
        segments: The runs of steps.
        delta: Target delta in (0, 1).
        envelope: A registered envelope name (``"chi2"``, ``"schur"`` or ``"chernoff"``).
        eps_error: Epsilon error of the discretisation.
        delta_error: Delta error; default ``delta / 1000``.

    Returns:
        An :class:`EpsilonReport`; all zeros for an empty history.

    Raises:
        EpsilonOutOfRangeError: if epsilon exceeds every value this analysis certifies
            (a privacy answer).
        NumericalLimitError: if the composition exceeds the numerical limits at this
            ``eps_error`` (not a statement about epsilon).
        ValueError: if a step's noise multiplier is in ``(0, MIN_NOISE_MULTIPLIER)``
            (:data:`MIN_NOISE_MULTIPLIER`; 0 is accepted, see below).

    Steps with ``noise_multiplier = 0`` (debugging runs without noise) make every epsilon
    infinite, as in Opacus: :func:`_noiseless_report`.
    """
    delta = validate_delta(delta)
    validate_choice("envelope", envelope, ENVELOPES)
    grouped: dict[tuple, int] = {}
    for seg in segments:
        if seg.steps:
            grouped[seg.key] = grouped.get(seg.key, 0) + seg.steps
    if not grouped:
        zero = (0.0, 0.0, 0.0)
        return EpsilonReport(remove=zero, add=zero, delta=delta)
    tiny = [sigma for sigma, *_ in grouped if 0.0 < sigma < MIN_NOISE_MULTIPLIER]
    if tiny:
        # Below this the per-step loss tables span thousands of nats and take minutes and
        # gigabytes to build, for an epsilon far beyond any useful budget. Not a numerical
        # limit of the composition (a larger eps_error does not help): outside the domain.
        raise ValueError(
            f"noise_multiplier={min(tiny):.3g} is outside the range the accountant computes "
            f"epsilon for: noise_multiplier must be >= {MIN_NOISE_MULTIPLIER} (or 0, a step "
            "without noise, accounted at epsilon = inf). Below it epsilon is far beyond any "
            "useful budget; use a larger noise multiplier."
        )
    noiseless = {q: n for (sigma, q, *_), n in grouped.items() if sigma == 0.0}
    if noiseless:
        return _noiseless_report(noiseless, delta)
    total = sum(grouped.values())
    eta = choose_eta(steps=total, delta=delta)
    prvs: dict[str, list[RandomizedClippingPRV]] = {d: [] for d in DIRECTIONS}
    for sigma, q, k, mode in grouped:
        for direction in DIRECTIONS:  # consecutive: both directions share one cached table
            prv = RandomizedClippingPRV(
                noise_multiplier=sigma,
                sample_rate=q,
                sketch_dim=k,
                envelope=envelope,
                threat_model=mode,
                direction=direction,
                eta=eta,
            )
            prvs[direction].append(prv.with_cap(choose_t_cap(prv, steps=total, delta=delta)))
    out = {}
    for direction in DIRECTIONS:
        try:
            out[direction] = compose_prvs(
                prvs[direction],
                list(grouped.values()),
                delta=delta,
                eps_error=eps_error,
                delta_error=delta_error,
            ).as_tuple()
        except EpsilonOutOfRangeError as err:
            raise EpsilonOutOfRangeError(
                f"{direction} direction (docs/privacy/adjacency.md), {total} steps: {err}"
            ) from err
    return EpsilonReport(remove=out["remove"], add=out["add"], delta=delta)


def compute_epsilon_replace_one(
    segments: Sequence[Segment],
    *,
    delta: float,
    envelope: str = "chi2",
    eps_error: float = 0.01,
    delta_error: float | None = None,
) -> float:
    """An upper bound on epsilon under *replace-one* adjacency (one record's value changed).

    A conversion from the add/remove accounting, valid for any mechanism (docs/privacy/
    adjacency.md#adjacency-replace-one): replacing ``x`` by ``x'`` is removing ``x``, then
    adding ``x'``. If the remove direction is ``(eps_R, delta_1)``-DP and the add direction
    ``(eps_A, delta_2)``-DP, then for every output set ``S``

        P[M(D) in S] <= e^{eps_R} P[M(D - x) in S] + delta_1
                     <= e^{eps_R + eps_A} P[M(D - x + x') in S] + e^{eps_R} delta_2 + delta_1,

    (and symmetrically from ``D'``), so the run is ``(eps_R + eps_A, delta)``-DP under
    replace-one with ``delta_1 = delta / 2`` and ``delta_2 = delta / (2 e^{eps_R})``. Both are
    the guaranteed upper bounds of :func:`compute_epsilon`.

    Args:
        segments: The runs of steps.
        delta: Target delta in ``(0, 1)``.
        envelope: As :func:`compute_epsilon`.
        eps_error: Discretisation error in epsilon of each of the two computations.
        delta_error: Error in delta of each of the two computations; default ``delta / 1000``
            of each one's delta.

    Returns:
        ``eps_R + eps_A`` (``inf`` if ``eps_R`` is infinite or ``delta_2`` underflows).

    Raises:
        ValueError: On ``delta`` outside ``(0, 1)`` or ``delta_error`` outside
            ``(0, delta / 2)``.
        EpsilonOutOfRangeError, NumericalLimitError: As :func:`compute_epsilon`.
    """
    delta = validate_delta(delta)
    if delta_error is not None and not 0.0 < delta_error < delta / 2.0:
        raise ValueError(f"delta_error must be in (0, delta / 2), got {delta_error!r}")
    first = compute_epsilon(
        segments, delta=delta / 2.0, envelope=envelope, eps_error=eps_error, delta_error=delta_error
    )
    eps_r = first.remove[2]
    if not math.isfinite(eps_r):
        return math.inf
    delta_2 = delta / (2.0 * math.exp(eps_r))
    if delta_2 <= 0.0:
        return math.inf
    err_2 = None if delta_error is None else min(delta_error, delta_2 / 2.0)
    second = compute_epsilon(
        segments, delta=delta_2, envelope=envelope, eps_error=eps_error, delta_error=err_2
    )
    return eps_r + second.add[2]


def _noiseless_report(noiseless: dict[float, int], delta: float) -> EpsilonReport:
    """The report of a history with steps without noise (``noise_multiplier = 0``).

    Such a step releases the sum of the clipped gradients of its batch exactly. For a record
    with a gradient that the others' cannot produce (e.g. all other gradients zero), the
    output with and without it differ whenever it is sampled in at least one of these steps,
    which happens with probability ``p0 = 1 - prod_j (1 - q_j)^{n_j}``; the hockey-stick
    divergence is then at least ``p0`` at every epsilon, in both directions. So the upper
    bound and the estimate are ``inf`` (as Opacus reports), and the lower bound is ``inf`` for
    ``delta < p0`` and the trivial 0 otherwise.
    """
    log_keep = sum(n * math.log1p(-q) if q < 1.0 else -math.inf for q, n in noiseless.items())
    p0 = -math.expm1(log_keep)
    lower = math.inf if delta < p0 else 0.0
    row = (lower, math.inf, math.inf)
    return EpsilonReport(remove=row, add=row, delta=delta)
