"""Law of the worst-case per-sample sensitivity ``S`` of randomized clipping (the "envelope").

Randomized clipping scales sample ``i`` by ``c_i = min(1, C / sqrt(n_hat_i))`` where
``n_hat_i = n_i W_i`` is a Gaussian sketch (Hutchinson, ``k`` columns) of the squared gradient
norm ``n_i``. The contribution of the differing record has norm at most ``S = C W^{-1/2}``
(THEORY.md B.1), so the sensitivity is a random variable. Its law depends on the (unknown)
spectrum of the per-sample gradient; this module implements the worst case over spectra, the
*envelope*, in units of the clipping bound ``C`` (THEORY.md B.3):

* ``envelope="chi2"`` (default, the paper's; rests on "Claim L", [conj] + [num] in B.3 item 2):
  ``S = max(1, (chi2_k / k)^{-1/2})``: an atom ``P(S = 1) = P(chi2_k >= k)`` and the density
  ``rho(s) = (2k / s^3) f_{chi2_k}(k / s^2)`` on ``s > 1``; ``P(S > s) = P(chi2_k < k / s^2)``.
* ``envelope="chernoff"`` (fully proved, B.3 item 5): no atom,
  ``P(S > s) = (s^{-2} e^{1 - s^{-2}})^{k/2}`` for ``s >= 1``.
* ``sketch_dim=None`` is exact clipping: ``S = 1`` almost surely.

Assumptions, stated first as in the monotone-loss classes this module imitates: ``S >= 1``
always; a stochastically larger ``S`` is a worse mechanism in both threat models and both
adjacency directions (THEORY.md B.4), which is what makes an envelope (a pointwise upper bound
on ``P(S > s)``) a valid replacement for the true, spectrum-dependent law. The right tail is
polynomial, ``P(S > s) ~ c_k s^{-k}`` (B.6), so every Renyi divergence is infinite.

Pure numpy/scipy; no Opacus import.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy import integrate, special

__all__ = [
    "ENVELOPES",
    "EnvelopeQuadrature",
    "SensitivityEnvelope",
    "envelope_cdf",
]

#: Envelope names accepted everywhere an ``envelope`` argument appears.
ENVELOPES = ("chi2", "chernoff")

#: Default capped tail mass of the quadrature (THEORY.md C.3 item 1).
DEFAULT_ETA = 1e-15


def _validate_sketch_dim(sketch_dim: int | None) -> None:
    if sketch_dim is None:
        return
    if isinstance(sketch_dim, bool) or not isinstance(sketch_dim, (int, np.integer)):
        raise TypeError(
            f"sketch_dim must be an int >= 1 or None (exact clipping), got "
            f"{type(sketch_dim).__name__}"
        )
    if sketch_dim < 1:
        raise ValueError(
            f"sketch_dim must be >= 1 (number of Gaussian sketch columns), got {sketch_dim}; "
            "use sketch_dim=None for exact clipping"
        )


def _validate_envelope(envelope: str) -> None:
    if envelope not in ENVELOPES:
        raise ValueError(f"envelope must be one of {ENVELOPES}, got {envelope!r}")


def envelope_cdf(y: float | np.ndarray, *, sketch_dim: int, envelope: str = "chi2") -> np.ndarray:
    """The envelope ``F_env(y) = sup_W P(W <= y)`` of the ratio ``W = n_hat / n``.

    THEORY.md B.3: ``F_env(y) = 1`` for ``y >= 1`` (item 1); for ``y < 1`` it is
    ``P(chi2_k <= k y)`` ("chi2", item 2) or the Chernoff bound ``(y e^{1-y})^{k/2}``
    ("chernoff", item 5).

    Args:
        y: Ratio of estimated to true squared norm (dimensionless), any shape.
        sketch_dim: ``k``, the number of Gaussian sketch columns (>= 1).
        envelope: ``"chi2"`` or ``"chernoff"``.

    Returns:
        Array of the same shape as ``y`` with values in ``[0, 1]``.

    Raises:
        ValueError: if ``sketch_dim < 1`` or ``envelope`` is unknown.
    """
    _validate_envelope(envelope)
    _validate_sketch_dim(sketch_dim)
    if sketch_dim is None:
        raise ValueError("envelope_cdf needs a sketch_dim; exact clipping has W = 1")
    k = float(sketch_dim)
    y = np.asarray(y, dtype=float)
    below = np.clip(y, 0.0, 1.0)
    if envelope == "chi2":
        val = special.gammainc(k / 2.0, k * below / 2.0)
    else:
        with np.errstate(divide="ignore"):
            val = np.exp((k / 2.0) * (np.log(below) + 1.0 - below))
    return np.where(y >= 1.0, 1.0, np.where(y <= 0.0, 0.0, val))


@dataclass(frozen=True)
class EnvelopeQuadrature:
    """Riemann-Stieltjes quadrature of the envelope law on ``[1, s_max]`` (THEORY.md C.3 item 1).

    ``integral f dF_S ~= sum_j weights[j] f(nodes[j])`` for ``S <= s_max``; the mass above
    ``s_max``, ``tail_mass``, is not represented by any node: the accountant treats it as a
    fully revealing event (``pm_inf``).

    Attributes:
        nodes: Sensitivities ``s_j`` in units of ``C``, increasing, shape ``(n,)``. The atom at
            ``s = 1`` (if any) is ``nodes[0]``.
        weights: Probability weights, shape ``(n,)``; ``weights.sum() = 1 - tail_mass``.
        tail_mass: ``eta = P(S > s_max)`` (0 for exact clipping).
        s_max: Upper end of the represented range (units of ``C``).
    """

    nodes: np.ndarray
    weights: np.ndarray
    tail_mass: float
    s_max: float


@dataclass(frozen=True)
class SensitivityEnvelope:
    """Worst-case law of the sensitivity ``S`` (units of ``C``) of randomized clipping.

    Parameter domains: ``sketch_dim`` in ``{1, 2, ...}`` or ``None`` (exact clipping, ``S = 1``);
    ``envelope`` in :data:`ENVELOPES`. For Hutch++ pass the number of *tail* columns
    (THEORY.md D, Theorem H).

    Example:
        >>> env = SensitivityEnvelope(sketch_dim=32)
        >>> round(env.atom(), 10)
        0.4667448914
        >>> round(float(env.isf(1e-6)), 6)
        2.130958

    Attributes:
        sketch_dim: ``k``, the Gaussian columns of the (tail) sketch, or ``None``.
        envelope: ``"chi2"`` (default) or ``"chernoff"``.
    """

    sketch_dim: int | None = None
    envelope: str = "chi2"

    def __post_init__(self) -> None:
        _validate_sketch_dim(self.sketch_dim)
        _validate_envelope(self.envelope)
        if self.sketch_dim is not None:
            object.__setattr__(self, "sketch_dim", int(self.sketch_dim))

    @property
    def exact(self) -> bool:
        """``True`` for exact clipping (``S = 1`` almost surely)."""
        return self.sketch_dim is None

    # ------------------------------------------------------------------ law of S
    def atom(self) -> float:
        """``P(S = 1)``: ``P(chi2_k >= k)`` for "chi2", 0 for "chernoff", 1 if exact (B.3 item 4)."""
        if self.exact:
            return 1.0
        if self.envelope == "chernoff":
            return 0.0
        k = self.sketch_dim
        return float(special.gammaincc(k / 2.0, k / 2.0))

    def logsf(self, s: float | np.ndarray) -> np.ndarray:
        """``log P(S > s)`` for ``s`` in units of ``C`` (B.3 items 4 and 5)."""
        s = np.asarray(s, dtype=float)
        if self.exact:
            return np.where(s < 1.0, 0.0, -np.inf)
        k = float(self.sketch_dim)
        sc = np.maximum(s, 1.0)
        y = 1.0 / (sc * sc)
        if self.envelope == "chi2":
            # P(S > s) = P(chi2_k < k / s^2); for s < 1 it is 1.
            with np.errstate(divide="ignore"):
                val = np.log(special.gammainc(k / 2.0, k * y / 2.0))
            val = np.where(s < 1.0, 0.0, val)
        else:
            val = (k / 2.0) * (np.log(y) + 1.0 - y)
            val = np.where(s <= 1.0, 0.0, val)
        return val

    def sf(self, s: float | np.ndarray) -> np.ndarray:
        """``P(S > s)`` (survival function; computed directly, not as ``1 - cdf``)."""
        return np.exp(self.logsf(s))

    def cdf(self, s: float | np.ndarray) -> np.ndarray:
        """``P(S <= s)``."""
        s = np.asarray(s, dtype=float)
        if self.exact:
            return np.where(s < 1.0, 0.0, 1.0)
        k = float(self.sketch_dim)
        sc = np.maximum(s, 1.0)
        y = 1.0 / (sc * sc)
        if self.envelope == "chi2":
            val = special.gammaincc(k / 2.0, k * y / 2.0)
        else:
            val = -np.expm1((k / 2.0) * (np.log(y) + 1.0 - y))
        return np.where(s < 1.0, 0.0, val)

    def logpdf(self, s: float | np.ndarray) -> np.ndarray:
        """Log density of the continuous part of ``S`` on ``s > 1`` (``-inf`` elsewhere).

        "chi2": ``rho(s) = (2k / s^3) f_{chi2_k}(k / s^2)`` (B.3 item 4). "chernoff":
        ``rho(s) = (k / s)(1 - s^{-2})(s^{-2} e^{1 - s^{-2}})^{k/2}``, the derivative of the
        survival function of item 5.
        """
        s = np.asarray(s, dtype=float)
        if self.exact:
            return np.full_like(s, -np.inf)
        k = float(self.sketch_dim)
        inside = s > 1.0
        sc = np.where(inside, s, 2.0)
        y = 1.0 / (sc * sc)
        if self.envelope == "chi2":
            x = k * y
            logf = (
                (k / 2.0 - 1.0) * np.log(x)
                - x / 2.0
                - (k / 2.0) * math.log(2.0)
                - special.gammaln(k / 2.0)
            )
            val = math.log(2.0 * k) - 3.0 * np.log(sc) + logf
        else:
            val = math.log(k) - np.log(sc) + np.log1p(-y) + (k / 2.0) * (np.log(y) + 1.0 - y)
        return np.where(inside, val, -np.inf)

    def pdf(self, s: float | np.ndarray) -> np.ndarray:
        """Density of the continuous part of ``S`` (see :meth:`logpdf`)."""
        return np.exp(self.logpdf(s))

    def isf(self, p: float | np.ndarray) -> np.ndarray:
        """Inverse survival function: the smallest ``s`` with ``P(S > s) <= p``.

        Returns 1 where ``p >= P(S > 1)`` (the atom). Closed forms: "chi2"
        ``s = sqrt(k / (2 gammaincinv(k/2, p)))``; "chernoff" ``s = y^{-1/2}`` with
        ``y = -W_0(-p^{2/k} / e)`` (Lambert W, principal branch).

        Args:
            p: Tail probability in ``(0, 1]``.
        """
        p = np.asarray(p, dtype=float)
        if np.any((p <= 0.0) | (p > 1.0)):
            raise ValueError("isf needs tail probabilities in (0, 1]")
        if self.exact:
            return np.ones_like(p)
        k = float(self.sketch_dim)
        if self.envelope == "chi2":
            pp = np.minimum(p, 1.0 - self.atom())
            x = special.gammaincinv(k / 2.0, pp)  # = k / (2 s^2)
            s = np.sqrt(k / (2.0 * x))
            return np.where(p >= 1.0 - self.atom(), 1.0, s)
        arg = -np.exp((2.0 / k) * np.log(p) - 1.0)
        y = -np.real(special.lambertw(arg, 0))
        with np.errstate(divide="ignore"):
            s = 1.0 / np.sqrt(y)
        return np.where(p >= 1.0, 1.0, s)

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
        "chernoff": ``1 + integral_1^inf P(S > s) ds`` by quadrature.
        """
        if self.exact:
            return 1.0
        k = self.sketch_dim
        if k == 1:
            return math.inf
        if self.envelope == "chi2":
            log_ratio = special.gammaln((k - 1) / 2.0) - special.gammaln(k / 2.0)
            cont = (
                math.sqrt(k / 2.0) * math.exp(log_ratio) * special.gammainc((k - 1) / 2.0, k / 2.0)
            )
            return float(self.atom() + cont)
        val, _ = integrate.quad(lambda s: float(self.sf(s)), 1.0, np.inf, epsabs=1e-14, limit=200)
        return 1.0 + val

    def s_max(self, eta: float = DEFAULT_ETA) -> float:
        """The cap ``s_max`` with ``P(S > s_max) = eta`` (THEORY.md C.3 item 1 table)."""
        if self.exact:
            return 1.0
        return float(self.isf(eta))

    # ------------------------------------------------------------------ quadrature
    def quadrature(
        self, *, eta: float = DEFAULT_ETA, panels: int = 40, order: int = 16
    ) -> EnvelopeQuadrature:
        """Quadrature nodes and weights of the law of ``S`` on ``[1, s_max]`` (THEORY.md C.3).

        The atom (if any) is a node at ``s = 1``; the continuous part uses composite
        Gauss-Legendre in ``u = log s`` on ``[0, log s_max]``, ``panels`` panels of ``order``
        nodes, weight ``rho(s) s du``. The mass ``eta`` above ``s_max`` is left out (``tail_mass``).
        Results are cached.

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
        return _quadrature(self.sketch_dim, self.envelope, float(eta), int(panels), int(order))


@functools.lru_cache(maxsize=64)
def _quadrature(
    sketch_dim: int | None, envelope: str, eta: float, panels: int, order: int
) -> EnvelopeQuadrature:
    env = SensitivityEnvelope(sketch_dim=sketch_dim, envelope=envelope)
    if env.exact:
        one = np.ones(1)
        return EnvelopeQuadrature(nodes=one, weights=one.copy(), tail_mass=0.0, s_max=1.0)
    s_max = env.s_max(eta)
    gl_x, gl_w = np.polynomial.legendre.leggauss(order)
    edges = np.linspace(0.0, math.log(s_max), panels + 1)
    half = np.diff(edges)[:, None] / 2.0
    mid = (edges[:-1] + edges[1:])[:, None] / 2.0
    u = (mid + half * gl_x[None, :]).ravel()
    du = (half * gl_w[None, :]).ravel()
    s = np.exp(u)
    w = np.exp(env.logpdf(s) + u) * du  # rho(s) ds = rho(s) s du
    atom = env.atom()
    if atom > 0.0:
        s = np.concatenate([[1.0], s])
        w = np.concatenate([[atom], w])
    total = float(w.sum())
    if abs(total - (1.0 - eta)) > 1e-9:
        raise RuntimeError(
            f"envelope quadrature for k={sketch_dim} ({envelope}) sums to {total!r}, not "
            f"1 - eta = {1.0 - eta!r}; increase panels/order"
        )
    s.setflags(write=False)
    w.setflags(write=False)
    return EnvelopeQuadrature(nodes=s, weights=w, tail_mass=eta, s_max=s_max)
