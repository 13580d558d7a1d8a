"""The privacy loss random variable (PRV) of one DP-SGD-RC step, for ``prv_accountant``.

Under add/remove adjacency with Poisson subsampling both ordered pairs of the threat model
(:mod:`~opacus_rc.accountants.analysis.threat_models`) are needed
(docs/privacy/adjacency.md#adjacency, Zhu, Dong and Wang 2022): the *remove* PRV ``Y_R =
log(dQ/dP)(X)``, ``X ~ Q``, and the *add* PRV ``Y_A = log(dP/dQ)(X)``, ``X ~ P``. With ``A`` and
``B`` the tabulated P- and Q-laws of ``z`` (:mod:`~opacus_rc.accountants.analysis.loss_table`), the
remove CDF is ``F_R(t) = B(z(t))`` and the add CDF is ``F_A(t) = 1 - A(z(-t))``.

Heavy tail (docs/privacy/heavy_tails.md#heavy-tails-rdp, docs/privacy/prv.md#prv-quadrature,
docs/privacy/prv.md#prv-tail-cap): the mass ``eta`` of ``S > s_max`` is a fully revealing event
(``pm_inf = eta`` in both directions), and the PRV is capped at ``t_cap``, the smallest value in
``{2, 2.5, ..., 200}`` with ``steps * P(Y > t_cap) <= 1e-3 delta`` (200 if none qualifies), the mass
above it moved to ``pm_inf`` (:func:`choose_t_cap`). Moving loss mass up to ``+inf`` can only
increase ``E(1 - e^{eps - sum Y})_+``, so both steps keep the bound valid. ``rdp`` is a finite upper
bound of the capped PRV's moment generating function, used only to size the discretisation domain;
the true RDP is infinite and is never reported.

Pure numpy/scipy and ``prv_accountant``; no Opacus import.
"""

from __future__ import annotations

import math

import numpy as np
from prv_accountant.privacy_random_variables import PrivacyRandomVariable
from scipy import special

from opacus_rc.accountants.analysis.envelope import DEFAULT_ETA, ENVELOPES, SensitivityEnvelope
from opacus_rc.accountants.analysis.loss_table import loss_table
from opacus_rc.accountants.analysis.threat_models import THREAT_MODELS, z_of_u
from opacus_rc.validation import validate_choice, validate_noise_multiplier, validate_sample_rate

__all__ = [
    "CAP_DELTA_FRACTION",
    "CAP_GRID",
    "DIRECTIONS",
    "RandomizedClippingPRV",
    "choose_t_cap",
]

#: Adjacency directions (docs/privacy/adjacency.md#adjacency).
DIRECTIONS = ("remove", "add")
#: Candidate caps of the privacy loss (docs/privacy/prv.md#prv-tail-cap): {2, 2.5, ..., 200}.
CAP_GRID = np.arange(2.0, 200.0 + 0.25, 0.5)
#: Tail mass moved to ``pm_inf`` by the cap, as a fraction of delta
#: (docs/privacy/prv.md#prv-tail-cap).
CAP_DELTA_FRACTION = 1e-3
# Orders at which prv_accountant's RDP accountant evaluates ``rdp`` (other_accountants.RDP).
_RDP_ORDERS = tuple([1.0 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])


class RandomizedClippingPRV(PrivacyRandomVariable):
    """Per-step privacy loss random variable of DP-SGD-RC (docs/privacy/prv.md#prv).

    ``cdf`` is the CDF *conditioned on a finite value*, as ``prv_accountant`` expects; the mass at
    ``+inf`` is :attr:`pm_inf`. With ``t_cap`` set, the loss is capped
    (docs/privacy/prv.md#prv-tail-cap): ``cdf(t) = F(min(t, t_cap)) / F(t_cap)`` and ``pm_inf = eta
    + (1 - eta)(1 - F(t_cap))``. Tables are cached per ``(q, sigma, k, envelope, mode, eta)`` and
    shared by both directions.

    Args:
        noise_multiplier: ``sigma``, noise std in units of the clipping bound (> 0).
        sample_rate: ``q``, Poisson sampling probability, in ``(0, 1]``.
        sketch_dim: ``k`` of the envelope (tail columns for Hutch++), or ``None`` for exact
            clipping.
        envelope: ``"chi2"`` or ``"chernoff"`` (docs/privacy/envelope.md#envelope-definition).
        threat_model: ``"hidden"`` (per-sample secret sketches) or ``"revealed"``
            (docs/privacy/threat_models.md#threat-models).
        direction: ``"remove"`` (``Y_R``) or ``"add"`` (``Y_A``)
            (docs/privacy/adjacency.md#adjacency).
        t_cap: Cap of the loss, or ``None`` for the uncapped PRV.
        eta: Mass of ``S > s_max`` treated as fully revealing (docs/privacy/prv.md#prv-quadrature),
            in ``(0, 1e-6]``; default ``1e-15``. Ignored for exact clipping (``S = 1``).

    Raises:
        ValueError: on out-of-range parameters.
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        sample_rate: float,
        sketch_dim: int | None = None,
        envelope: str = "chi2",
        threat_model: str = "hidden",
        direction: str = "remove",
        t_cap: float | None = None,
        eta: float = DEFAULT_ETA,
    ) -> None:
        sigma = validate_noise_multiplier(noise_multiplier, allow_zero=False)
        q = validate_sample_rate(sample_rate)
        validate_choice("envelope", envelope, ENVELOPES)
        validate_choice("threat_model", threat_model, THREAT_MODELS)
        validate_choice("direction", direction, DIRECTIONS)
        SensitivityEnvelope(sketch_dim=sketch_dim, envelope=envelope)  # validates sketch_dim
        if sketch_dim is None:
            # S = 1: one law, share the table
            envelope, threat_model, eta = "chi2", "hidden", DEFAULT_ETA
        elif not 0.0 < eta <= 1e-6:
            raise ValueError(f"eta must be in (0, 1e-6], got {eta!r}")
        self.noise_multiplier = sigma
        self.sample_rate = q
        self.sketch_dim = sketch_dim
        self.envelope = envelope
        self.threat_model = threat_model
        self.direction = direction
        self._eta_param = float(eta)
        self._table = loss_table(q, sigma, sketch_dim, envelope, threat_model, self._eta_param)
        self.t_cap = None if t_cap is None else float(t_cap)
        if self.t_cap is not None:
            f, fb = self._uncapped(np.array([self.t_cap]))
            self._f_cap, self._fbar_cap = float(f[0]), float(fb[0])
            if not self._f_cap > 0.0:
                raise ValueError(f"t_cap={t_cap} leaves no finite mass")
        self._rdp_cache: dict[float, float] = {}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(noise_multiplier={self.noise_multiplier}, "
            f"sample_rate={self.sample_rate}, sketch_dim={self.sketch_dim}, "
            f"envelope={self.envelope!r}, threat_model={self.threat_model!r}, "
            f"direction={self.direction!r}, t_cap={self.t_cap}, eta={self.eta})"
        )

    @property
    def eta(self) -> float:
        """Mass of ``S > s_max`` treated as fully revealing."""
        return self._table.eta

    def with_cap(self, t_cap: float | None) -> RandomizedClippingPRV:
        """The same PRV with another cap (shares the cached table)."""
        return RandomizedClippingPRV(
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
            sketch_dim=self.sketch_dim,
            envelope=self.envelope,
            threat_model=self.threat_model,
            direction=self.direction,
            t_cap=t_cap,
            eta=self._eta_param,
        )

    # ------------------------------------------------------------------ distribution
    def _uncapped(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(P(Y <= t), P(Y > t))`` of the uncapped finite PRV."""
        t = np.asarray(t, dtype=float)
        if self.direction == "remove":
            return self._table.law("B", z_of_u(self.sample_rate, t))
        a, abar = self._table.law("A", z_of_u(self.sample_rate, -t))
        return abar, a

    def cdf_sf(self, t: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(cdf(t), 1 - cdf(t))``, the second computed directly (full relative precision)."""
        t = np.asarray(t, dtype=np.float64)
        if self.t_cap is None:
            return self._uncapped(t)
        tc = np.minimum(t, self.t_cap)
        f, fb = self._uncapped(tc)
        cdf = np.where(t >= self.t_cap, 1.0, f / self._f_cap)
        sf = np.where(t >= self.t_cap, 0.0, np.maximum(fb - self._fbar_cap, 0.0) / self._f_cap)
        return np.minimum(cdf, 1.0), sf

    def cdf(self, t):
        """CDF of the finite part (vectorised; accepts floats and ``longdouble`` arrays)."""
        c = self.cdf_sf(t)[0]
        return c if c.ndim else float(c)

    def sf(self, t):
        """``1 - cdf(t)``, computed directly."""
        s = self.cdf_sf(t)[1]
        return s if s.ndim else float(s)

    def probability(self, a, b):
        """``P(a < Y <= b)`` of the finite part, from the survival function in the upper half."""
        ca, sa = self.cdf_sf(a)
        cb, sb = self.cdf_sf(b)
        p = np.where(ca > 0.5, sa - sb, cb - ca)
        return np.maximum(p, 0.0)

    @property
    def pm_inf(self) -> float:
        """Mass at ``+inf``: ``eta`` plus, if capped, the finite mass above ``t_cap``."""
        if self.t_cap is None:
            return self.eta
        return self.eta + (1.0 - self.eta) * self._fbar_cap

    def partial_expectation(self, a: float, b: float) -> float:
        """``E[Y 1{a < Y <= b}]`` of the finite (capped, conditioned) PRV."""
        a, b = float(a), float(b)
        if self.t_cap is not None:
            b = min(b, self.t_cap)
            if not b > a:
                return 0.0
        if self.direction == "remove":
            val = self._table.partial_moment("B", a, b)
        else:
            # Y = -U with U ~ A-law: a < Y <= b  <=>  -b <= U < -a
            val = -self._table.partial_moment("A", -b, -a)
        return val / (self._f_cap if self.t_cap is not None else 1.0)

    def mean(self) -> float:
        """Mean of the finite PRV (the capped one if ``t_cap`` is set)."""
        return self.partial_expectation(-np.inf, np.inf)

    # ------------------------------------------------------------------ RDP (domain sizing)
    def rdp(self, alpha: float) -> float:
        """A finite upper bound on the Renyi divergence of order ``alpha`` of the *capped* PRV.

        ``(1 / (alpha - 1)) log E[e^{(alpha - 1) Y}]`` with the mass of every knot interval
        moved to its upper end (docs/privacy/prv.md#prv-safe-domain). Used only by
        ``compute_safe_domain_size`` to size the discretisation domain: the RDP of randomized
        clipping itself is infinite (docs/privacy/heavy_tails.md#heavy-tails-rdp).

        Raises:
            ValueError: if the PRV is uncapped and heavy-tailed (the bound would be infinite).
        """
        alpha = float(alpha)
        if alpha not in self._rdp_cache:
            orders = np.array(sorted(set(_RDP_ORDERS) | {alpha}))
            vals = self._rdp_vector(orders)
            self._rdp_cache.update(dict(zip(orders.tolist(), vals.tolist())))
        return self._rdp_cache[alpha]

    def _rdp_vector(self, orders: np.ndarray) -> np.ndarray:
        tab = self._table
        remove = self.direction == "remove"
        # largest finite value of Y: the cap, and for the add direction also -log(1 - q)
        y_max = math.inf if self.t_cap is None else self.t_cap
        if not remove:
            y_max = min(y_max, -tab.t0)
        if not math.isfinite(y_max):
            raise ValueError(
                f"{self!r}: the rdp of an uncapped randomized-clipping PRV is infinite; cap it"
            )
        # Y-values of the knots (increasing) below y_max, then 64 exactly evaluated points up
        # to y_max, so that no mass is moved far beyond where it lies
        ys = np.sort(tab.u if remove else -tab.u)
        ys = ys[ys < y_max]
        last = ys[-1] if ys.size else y_max - 1.0
        ys = np.concatenate([ys, np.linspace(last, y_max, 65)[1:]])
        c, s = self.cdf_sf(ys)
        mass = np.empty_like(ys)
        mass[0] = c[0]
        mass[1:] = np.where(c[:-1] > 0.5, s[:-1] - s[1:], c[1:] - c[:-1])
        keep = mass > 0.0
        lm, yk = np.log(mass[keep]), ys[keep]
        a1 = orders - 1.0
        logmgf = special.logsumexp(lm[None, :] + a1[:, None] * yk[None, :], axis=1)
        return np.maximum(logmgf, 0.0) / a1


def choose_t_cap(
    prv: RandomizedClippingPRV,
    *,
    steps: int,
    delta: float,
    fraction: float = CAP_DELTA_FRACTION,
) -> float:
    """Smallest cap in :data:`CAP_GRID` with ``steps * P(Y > t_cap) <= fraction * delta``.

    docs/privacy/prv.md#prv-tail-cap; ``steps`` is the total number of composed steps. If no cap
    up to 200 qualifies, 200 is returned: capping is valid at any level (the mass above the cap goes
    to ``pm_inf``), it only spends more of delta, and
    :func:`~opacus_rc.accountants.analysis.compose.compose_epsilon` raises
    :class:`~opacus_rc.accountants.analysis.errors.EpsilonOutOfRangeError` if the mass at infinity
    reaches delta.
    """
    base = prv.with_cap(None) if prv.t_cap is not None else prv
    sf = base.sf(CAP_GRID)
    ok = np.nonzero(steps * sf <= fraction * delta)[0]
    return float(CAP_GRID[ok[0]] if ok.size else CAP_GRID[-1])
