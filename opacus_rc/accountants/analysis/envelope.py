"""Law of the worst-case per-sample sensitivity ``S`` of randomized clipping (the "envelope").

Randomized clipping scales sample ``i`` by ``c_i = min(1, C / sqrt(n_hat_i))`` where
``n_hat_i = n_i W_i`` is a Gaussian sketch (Hutchinson, ``k`` columns) of the squared gradient
norm ``n_i``. The contribution of the differing record has norm at most ``S = C W^{-1/2}``
(``docs/privacy/mechanism.md#mechanism-sensitivity``), so the sensitivity is a random
variable. Its law depends on the (unknown) spectrum of the per-sample gradient; this module
implements upper bounds ``F_env(y)`` on ``sup P(W <= y)`` over all spectra, the *envelopes*,
and the law of ``S = W_env^{-1/2}`` they induce, in units of the clipping bound ``C``
(definitions and proofs: ``docs/privacy/envelope.md``). Every envelope is 1 for ``y >= 1``
(``#envelope-above-one``). Below 1:

* ``envelope="chi2"`` (default): ``F_env(y) = P(chi2_k <= k y)``, the exact supremum, attained
  by rank-one gradients ("Claim L"). **Proved for k >= 2**
  (``docs/privacy/envelope.md#envelope-claim-l``). At ``k = 1`` the proof does not apply
  (``#envelope-k1``): the law is still computed, but its accounting uses (:meth:`quadrature`,
  :func:`envelope_cdf`) raise a :class:`UserWarning` saying so; ``"schur"`` and ``"chernoff"``
  are proved at ``k = 1``. Law: an atom ``P(S = 1) = P(chi2_k >= k)`` and the density
  ``rho(s) = (2k / s^3) f_{chi2_k}(k / s^2)`` on ``s > 1``; ``P(S > s) = P(chi2_k < k / s^2)``.
* ``envelope="schur"`` (the proved fallback, ``docs/privacy/envelope.md#envelope-schur``):
  ``P(chi2_k <= k y)`` for ``y < y0 = 1 - 2/k`` (the Schur-convexity region, ``k >= 3``; empty
  for ``k <= 2``) and, on ``[y0, 1)``, the convex-order hinge bound
  ``h(y) = inf_{c > y} E(c - Y)_+ / (c - y)`` with ``Y = chi2_k / k``, which never exceeds the
  Chernoff bound. ``h(y) = P(Y <= c*)`` where ``c*`` solves ``E[Y | Y <= c*] = y``, i.e.
  ``P(chi2_{k+2} <= k c*) = y P(chi2_k <= k c*)``. Law: no atom at 1, an atom at
  ``s* = y0^{-1/2}`` of mass ``h(y0) - P(chi2_k <= k y0)``, the ``"chi2"`` density above ``s*``.
* ``envelope="chernoff"`` (proved for every ``k``, ``docs/privacy/envelope.md#envelope-chernoff``;
  the independent cross-check): no atom, ``P(S > s) = (s^{-2} e^{1 - s^{-2}})^{k/2}`` for
  ``s >= 1``.
* ``sketch_dim=None`` is exact clipping: ``S = 1`` almost surely.

Assumptions, stated first as in the monotone-loss classes this module imitates: ``S >= 1``
always; a stochastically larger ``S`` is a worse mechanism in both threat models and both
adjacency directions (``docs/privacy/dominance.md``), which is what makes an envelope (a
pointwise upper bound on ``P(S > s)``) a valid replacement for the true, spectrum-dependent law.
The right tail is polynomial, ``P(S > s) ~ c_k s^{-k}`` (``docs/privacy/heavy_tails.md``), so
every Renyi divergence is infinite.

The laws themselves, one module per family, their registry and the quadrature rules are in
:mod:`opacus_rc.accountants.analysis.envelopes`; this module is the public entry point.

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import numpy as np

from opacus_rc.accountants.analysis.envelopes import ENVELOPE_LAWS
from opacus_rc.accountants.analysis.envelopes.quadrature import DEFAULT_ETA, EnvelopeQuadrature
from opacus_rc.validation import validate_choice, validate_sketch_dim

__all__ = [
    "DEFAULT_ETA",
    "ENVELOPES",
    "EnvelopeQuadrature",
    "SensitivityEnvelope",
    "envelope_cdf",
]

#: Envelope names accepted everywhere an ``envelope`` argument appears (the registered laws of
#: :mod:`opacus_rc.accountants.analysis.envelopes`, in registration order).
ENVELOPES = ENVELOPE_LAWS.available()


def _validate_envelope(envelope: str) -> None:
    validate_choice("envelope", envelope, ENVELOPES)


def _warn_if_unproved(sketch_dim: int | None, envelope: str) -> None:
    if envelope == "chi2" and sketch_dim == 1:
        warnings.warn(
            "envelope='chi2' is proved for sketch_dim >= 2 only (docs/privacy/envelope.md, "
            "section 'Why k = 1 is not covered'); at sketch_dim=1 it is a numerically checked "
            "bound, not a proved one. Pass envelope='schur' or envelope='chernoff' for a proved "
            "bound, or use sketch_dim >= 2.",
            UserWarning,
            stacklevel=3,
        )


def envelope_cdf(y: float | np.ndarray, *, sketch_dim: int, envelope: str = "chi2") -> np.ndarray:
    """The envelope ``F_env(y) >= sup_W P(W <= y)`` of the ratio ``W = n_hat / n``.

    ``docs/privacy/envelope.md`` (definitions and proofs): ``F_env(y) = 1`` for ``y >= 1``
    (docs/privacy/envelope.md#envelope-above-one); for ``y < 1`` it is ``P(chi2_k <= k y)``
    ("chi2", proved for ``k >= 2``: then it is the supremum itself,
    docs/privacy/envelope.md#envelope-claim-l), the Schur/hinge fallback ("schur",
    docs/privacy/envelope.md#envelope-schur) or the Chernoff bound ``(y e^{1-y})^{k/2}``
    ("chernoff", docs/privacy/envelope.md#envelope-chernoff).

    Args:
        y: Ratio of estimated to true squared norm (dimensionless), any shape.
        sketch_dim: ``k``, the number of Gaussian sketch columns (>= 1).
        envelope: A name in :data:`ENVELOPES` (``"chi2"``, ``"schur"`` or ``"chernoff"``).

    Returns:
        Array of the same shape as ``y`` with values in ``[0, 1]``.

    Raises:
        ValueError: if ``sketch_dim < 1`` or ``envelope`` is unknown.
    """
    _validate_envelope(envelope)
    validate_sketch_dim(sketch_dim, allow_none=True)
    if sketch_dim is None:
        raise ValueError("envelope_cdf needs a sketch_dim; exact clipping has W = 1")
    _warn_if_unproved(sketch_dim, envelope)
    y = np.asarray(y, dtype=float)
    inside = (y > 0.0) & (y < 1.0)
    val = ENVELOPE_LAWS[envelope](int(sketch_dim)).w_cdf(np.where(inside, y, 0.5))
    return np.where(y >= 1.0, 1.0, np.where(y <= 0.0, 0.0, val))


@dataclass(frozen=True)
class SensitivityEnvelope:
    """Worst-case law of the sensitivity ``S`` (units of ``C``) of randomized clipping.

    Parameter domains: ``sketch_dim`` in ``{1, 2, ...}`` or ``None`` (exact clipping, ``S = 1``);
    ``envelope`` in :data:`ENVELOPES`. For Hutch++ pass the number of *tail* columns
    (``docs/privacy/hutchpp.md#hutchpp-theorem-h``). ``"chi2"`` is proved for ``k >= 2``; at
    ``k = 1`` it warns (see
    the module docstring) and ``"schur"`` or ``"chernoff"`` give proved bounds.

    Example:
        >>> env = SensitivityEnvelope(sketch_dim=32)
        >>> round(env.atom(), 10)
        0.4667448914
        >>> round(float(env.isf(1e-6)), 6)
        2.130958

    Attributes:
        sketch_dim: ``k``, the Gaussian columns of the (tail) sketch, or ``None``.
        envelope: ``"chi2"`` (default), ``"schur"`` or ``"chernoff"``.
    """

    sketch_dim: int | None = None
    envelope: str = "chi2"

    def __post_init__(self) -> None:
        validate_sketch_dim(self.sketch_dim, allow_none=True)
        _validate_envelope(self.envelope)
        if self.sketch_dim is not None:
            object.__setattr__(self, "sketch_dim", int(self.sketch_dim))

    @property
    def exact(self) -> bool:
        """``True`` for exact clipping (``S = 1`` almost surely)."""
        return self.sketch_dim is None

    @property
    def _law(self):
        return _law(self.sketch_dim, self.envelope)

    # ------------------------------------------------------------------ law of S
    def atom(self) -> float:
        """``P(S = 1)``: ``P(chi2_k >= k)`` for "chi2", 0 for "schur" and "chernoff", 1 if exact."""
        return dict(self.atoms()).get(1.0, 0.0)

    def atoms(self) -> tuple[tuple[float, float], ...]:
        """All atoms ``(s, P(S = s))`` of the law, in increasing ``s``.

        "chi2": ``((1, P(chi2_k >= k)),)``; "schur" (``k >= 3``): ``((s*, mass),)`` with
        ``s* = (1 - 2/k)^{-1/2}``; "chernoff": none; exact clipping: ``((1, 1),)``.
        """
        if self.exact:
            return ((1.0, 1.0),)
        return self._law.atoms()

    def logsf(self, s: float | np.ndarray) -> np.ndarray:
        """``log P(S > s)`` for ``s`` in units of ``C`` (``docs/privacy/envelope.md``)."""
        s = np.asarray(s, dtype=float)
        if self.exact:
            return np.where(s < 1.0, 0.0, -np.inf)
        val = self._law.logsf(np.maximum(s, 1.0))
        return np.where(s < 1.0, 0.0, val)

    def sf(self, s: float | np.ndarray) -> np.ndarray:
        """``P(S > s)`` (survival function; computed directly, not as ``1 - cdf``)."""
        return np.exp(self.logsf(s))

    def cdf(self, s: float | np.ndarray) -> np.ndarray:
        """``P(S <= s)``."""
        s = np.asarray(s, dtype=float)
        if self.exact:
            return np.where(s < 1.0, 0.0, 1.0)
        val = self._law.cdf(np.maximum(s, 1.0))
        return np.where(s < 1.0, 0.0, val)

    def logpdf(self, s: float | np.ndarray) -> np.ndarray:
        """Log density of the continuous part of ``S`` on ``s > 1`` (``-inf`` elsewhere).

        "chi2": ``rho(s) = (2k / s^3) f_{chi2_k}(k / s^2)`` (``#envelope-law``). "chernoff":
        ``rho(s) = (k / s)(1 - s^{-2})(s^{-2} e^{1 - s^{-2}})^{k/2}``, the derivative of the
        Chernoff survival function. "schur": ``(2 / s^3) b'(s^{-2})`` on ``(1, s*)`` (``b`` the
        hinge bound, ``b' = b / (c* - y)``), the "chi2" density above ``s*``.
        """
        s = np.asarray(s, dtype=float)
        if self.exact:
            return np.full_like(s, -np.inf)
        inside = s > 1.0
        val = self._law.logpdf(np.where(inside, s, 2.0))
        return np.where(inside, val, -np.inf)

    def pdf(self, s: float | np.ndarray) -> np.ndarray:
        """Density of the continuous part of ``S`` (see :meth:`logpdf`)."""
        return np.exp(self.logpdf(s))

    def isf(self, p: float | np.ndarray) -> np.ndarray:
        """Inverse survival function: the smallest ``s`` with ``P(S > s) <= p``.

        Returns 1 where ``p >= P(S > 1)`` (the atom). Closed forms: "chi2"
        ``s = sqrt(k / (2 gammaincinv(k/2, p)))``; "chernoff" ``s = y^{-1/2}`` with
        ``y = -W_0(-p^{2/k} / e)`` (Lambert W, principal branch); "schur" the "chi2" form
        below ``P(chi2_k < k y0)``, ``s*`` up to ``b(y0)``, and above it ``s = y^{-1/2}`` with
        ``y = max(E[Y | Y <= F_Y^{-1}(p)], chernoff^{-1}(p))``.

        Args:
            p: Tail probability in ``(0, 1]``.

        Raises:
            ValueError: if some ``p`` is outside ``(0, 1]``.
        """
        p = np.asarray(p, dtype=float)
        if np.any((p <= 0.0) | (p > 1.0)):
            raise ValueError("isf needs tail probabilities in (0, 1]")
        if self.exact:
            return np.ones_like(p)
        return self._law.isf(p)

    def ppf(self, p: float | np.ndarray) -> np.ndarray:
        """Quantile function: the smallest ``s`` with ``P(S <= s) >= p``, ``p`` in ``[0, 1)``."""
        p = np.asarray(p, dtype=float)
        if np.any((p < 0.0) | (p >= 1.0)):
            raise ValueError("ppf needs probabilities in [0, 1)")
        return self.isf(1.0 - p)

    def mean(self) -> float:
        """``E S`` (units of ``C``); infinite for ``k = 1``.

        "chi2": ``P(chi2_k >= k) + sqrt(k/2) Gamma((k-1)/2) / Gamma(k/2) P(chi2_{k-1} < k)``,
        from ``x^{-1/2} f_{chi2_k}(x) = f_{chi2_{k-1}}(x) Gamma((k-1)/2) / (sqrt 2 Gamma(k/2))``.
        "schur": the same closed form above ``s*``, ``s*`` times the atom, and
        ``integral E[Y | Y <= c]^{-1/2} f_Y(c) dc`` over ``c > c*(y0)`` by quadrature.
        "chernoff": ``1 + integral_1^inf P(S > s) ds`` by quadrature.
        """
        if self.exact:
            return 1.0
        if self.sketch_dim == 1:
            return math.inf
        return self._law.mean()

    def s_max(self, eta: float = DEFAULT_ETA) -> float:
        """The cap ``s_max`` with ``P(S > s_max) = eta``
        (``docs/privacy/prv.md#prv-quadrature``)."""
        if self.exact:
            return 1.0
        return float(self.isf(eta))

    # ------------------------------------------------------------------ quadrature
    def quadrature(
        self, *, eta: float = DEFAULT_ETA, panels: int = 40, order: int = 16
    ) -> EnvelopeQuadrature:
        """Quadrature nodes and weights of the law of ``S`` on ``[1, s_max]``.

        ``docs/privacy/prv.md#prv-quadrature``.

        Atoms are nodes of their own; the continuous part uses composite Gauss-Legendre in
        ``u = log s`` on ``[0, log s_max]``, ``panels`` panels of ``order`` nodes, weight
        ``rho(s) s du``. "schur" splits the range at its atom ``s*``: above it the same rule
        (``panels // 2`` panels), below it Gauss-Legendre in ``log c`` of the hinge
        parameterisation ``S = E[Y | Y <= c]^{-1/2}``, ``c ~ chi2_k / k``, whose integrand is
        smooth where the density of ``S`` is not (near ``s = 1``). The mass ``eta`` above
        ``s_max`` is left out (``tail_mass``). Results are cached. Warns once for "chi2" at
        ``k = 1`` (not proved there; see the module docstring).

        Args:
            eta: Capped tail mass ``P(S > s_max)``, in ``(0, 1e-6]``.
            panels: Number of Gauss-Legendre panels (>= 1).
            order: Nodes per panel (>= 2).

        Raises:
            ValueError: on out-of-range arguments.
            RuntimeError: if the weights do not sum to ``1 - eta`` within ``1e-9`` (a numerical
                failure of the quadrature, e.g. an extreme ``sketch_dim``).
        """
        if not 0.0 < eta <= 1e-6:
            raise ValueError(f"eta must be in (0, 1e-6], got {eta}")
        if panels < 1 or order < 2:
            raise ValueError(f"need panels >= 1 and order >= 2, got {panels}, {order}")
        _warn_if_unproved(self.sketch_dim, self.envelope)
        return _quadrature(self.sketch_dim, self.envelope, float(eta), int(panels), int(order))


@functools.lru_cache(maxsize=64)
def _law(sketch_dim: int, envelope: str):
    return ENVELOPE_LAWS[envelope](sketch_dim)


@functools.lru_cache(maxsize=64)
def _quadrature(
    sketch_dim: int | None, envelope: str, eta: float, panels: int, order: int
) -> EnvelopeQuadrature:
    env = SensitivityEnvelope(sketch_dim=sketch_dim, envelope=envelope)
    if env.exact:
        one = np.ones(1)
        return EnvelopeQuadrature(nodes=one, weights=one.copy(), tail_mass=0.0, s_max=1.0)
    s_max = env.s_max(eta)
    s, w = env._law.quadrature(s_max, eta, panels, order)
    total = float(w.sum())
    if abs(total - (1.0 - eta)) > 1e-9:
        raise RuntimeError(
            f"envelope quadrature for k={sketch_dim} ({envelope}) sums to {total!r}, not "
            f"1 - eta = {1.0 - eta!r}; increase panels/order"
        )
    s.setflags(write=False)
    w.setflags(write=False)
    return EnvelopeQuadrature(nodes=s, weights=w, tail_mass=eta, s_max=s_max)
