"""Randomized trace estimators for per-sample squared gradient norms of factored operators.

Pure torch; no Opacus import. The math is in ``docs/privacy/estimators.md#estimators`` (Hutchinson:
docs/privacy/estimators.md#estimators-hutchinson; Hutch++:
docs/privacy/estimators.md#estimators-hutchpp) and in Ullah et al., "Efficient DP-SGD for LLMs with
Randomized Clipping", arXiv:2605.24879, ICML 2026.

For sample ``i`` of a linear layer with input activations ``A_i`` (``T x d``) and output
gradients ``G_i`` (``T x p``), the weight gradient is ``M_i = G_i^T A_i`` (``p x d``) and the
quantity estimated is ``n_i = ||M_i||_F^2 = tr(O_i)`` with ``O_i = M_i M_i^T``. The estimators
only ever multiply ``A_i`` and ``G_i`` by thin ``(., k)`` matrices: no ``T x T``, ``p x d`` or
``p x p`` matrix is formed.

Every estimator in :data:`ESTIMATORS` has the signature
``(activations, backprops, *, sketch_dim, generator, **options) -> Tensor`` and returns the
``(B,)`` squared-norm estimates.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from collections.abc import Callable

import torch

from opacus_rc.sketch_spec import SketchSpec
from opacus_rc.validation import validate_choice, validate_sketch_dim

__all__ = [
    "ESTIMATORS",
    "GRADIENT_ESTIMATORS",
    "MAX_UPSCALE_EXPONENT",
    "RANGE_SAFE_ESTIMATORS",
    "SketchGenerators",
    "SketchSpec",
    "draw_gaussian_probes",
    "autocast_off",
    "get_estimator",
    "pow2_scale",
    "sample_absmax",
    "hutchinson_sqnorm",
    "hutchpp_sqnorm",
    "hutchinson_sqnorm_of_gradients",
    "hutchpp_sqnorm_of_gradients",
    "validate_sketch_dim",
]

_SIDES = ("auto", "output", "input")


def _check_factors(activations: torch.Tensor, backprops: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate the factor shapes and return ``(B, T, d, p)``."""
    if activations.dim() != 3 or backprops.dim() != 3:
        raise ValueError(
            "activations and backprops must be 3-D (B, T, d) and (B, T, p); got shapes "
            f"{tuple(activations.shape)} and {tuple(backprops.shape)}. Flatten extra sequence "
            "dimensions into T first."
        )
    B, T, d = activations.shape
    if backprops.shape[:2] != (B, T):
        raise ValueError(
            "activations and backprops must agree on (B, T); got "
            f"{tuple(activations.shape)} and {tuple(backprops.shape)}"
        )
    return B, T, d, backprops.shape[2]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, float32 otherwise (fp32 accumulation for bf16/fp16)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _resolve_side(side: str, p: int, d: int, probes: torch.Tensor | None) -> str:
    """Pick the side of ``M = G^T A`` that the Gaussian probes multiply.

    ``"output"`` sketches the ``p`` side (docs/privacy/estimators.md#estimators-hutchinson, the
    default orientation), ``"input"`` the ``d`` side; both give the same law. ``"auto"`` picks the
    smaller dimension (fewer probe entries, ``B * min(p, d) * k``); with explicit ``probes`` it
    picks the side their shape matches (the output side when both match).
    """
    if side not in _SIDES:
        raise ValueError(f"side must be one of {', '.join(map(repr, _SIDES))}; got {side!r}")
    if side != "auto":
        return side
    if probes is not None:
        rows = probes.shape[-2]
        if rows == p:
            return "output"
        if rows == d:
            return "input"
        raise ValueError(
            f"probes have {rows} rows but the layer has p={p} outputs and d={d} inputs"
        )
    return "output" if p <= d else "input"


def _check_probes(
    probes: torch.Tensor, *, batch: int, rows: int, name: str = "probes"
) -> torch.Tensor:
    """Validate explicit probes of shape ``(B, rows, k)`` or ``(rows, k)``; return ``(B, rows,
    k)``."""
    if probes.dim() == 2:
        probes = probes.unsqueeze(0).expand(batch, -1, -1)
    if probes.dim() != 3 or probes.shape[0] != batch or probes.shape[1] != rows:
        raise ValueError(
            f"{name} must have shape ({batch}, {rows}, k) or ({rows}, k); got {tuple(probes.shape)}"
        )
    return probes


def _scale_views(
    scale: tuple[torch.Tensor, torch.Tensor] | None, batch: int, *, swap: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(s_A, s_G)`` as ``(B, 1, 1)`` views (swapped with the factors), or ``(None, None)``."""
    if scale is None:
        return None, None
    s_a, s_g = (t.reshape(batch, 1, 1) for t in scale)
    return (s_g, s_a) if swap else (s_a, s_g)


def _sum_of_squares(V: torch.Tensor, sum_dtype: torch.dtype | None) -> torch.Tensor:
    """``(B,)`` sums of the squared entries of a ``(B, m, n)`` sketch, in ``sum_dtype`` (or
    ``V``'s dtype); a wider dtype takes the squares in it, so none overflows."""
    if sum_dtype is None or sum_dtype == V.dtype:
        return V.pow(2).sum(dim=(1, 2))
    # The norm kernel converts as it reads (no wider copy of V): 1.5-2x faster on a CPU.
    return torch.linalg.vector_norm(V, dim=(1, 2), dtype=sum_dtype).square()


def _scaled(t: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """``t * s`` (per-sample power of two, broadcast over the batch), or ``t``."""
    return t if s is None else t * s.to(t.dtype)


# ----------------------------------------------------------------------------------------------
# Numerics shared by the samplers
# ----------------------------------------------------------------------------------------------

#: Largest upward scaling ``2^MAX_UPSCALE_EXPONENT`` of a sample with tiny entries: finite in
#: float32 (a subnormal maximum would otherwise ask for 2^149).
MAX_UPSCALE_EXPONENT = 100


def sample_absmax(t: torch.Tensor) -> torch.Tensor:
    """Per-sample largest absolute entry of a batch-first tensor, ``max_j |t[i, j...]|``.

    The value ``torch.linalg.vector_norm(t, ord=inf, dim=(1, ..., n-1))`` gives (NaN where a
    sample holds a NaN, inf where it holds an infinity and no NaN, 0 for an empty sample), in
    two plain reductions, ``max(t.amax(), -t.amin())``: no ``|t|`` temporary and none of the
    norm kernel's per-element cost (12-25x faster on a CPU at ``(1, 1024, 576)`` float32,
    ``benchmarks/step_overhead.py``). Negation and ``max`` are exact, so the result, and the
    power-of-two scale :func:`pow2_scale` derives from it, equal the norm's bit for bit.

    Args:
        t: ``(B, ...)`` floating-point tensor (any layout; not copied).

    Returns:
        ``(B,)`` tensor in ``t``'s dtype.

    Raises:
        ValueError: If ``t`` has fewer than 2 dimensions.
    """
    if t.dim() < 2:
        raise ValueError(
            f"sample_absmax needs a batch-first tensor (B, ...); got shape {tuple(t.shape)}"
        )
    if t.numel() == 0:
        return torch.zeros(t.shape[0], dtype=t.dtype, device=t.device)
    dims = tuple(range(1, t.dim()))
    return torch.maximum(t.amax(dim=dims), t.amin(dim=dims).neg())


def pow2_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(2^-e, e)`` with ``amax * 2^-e`` in ``[0.5, 1)`` and ``e >= -100``.

    Scaling by a power of two is exact in floating point, so a sketch of the scaled factors is
    the scaled sketch. ``e = 0`` where ``amax`` is 0 or not finite (a non-finite factor then
    gives a non-finite norm, which the module refuses).

    Args:
        amax: ``(B,)`` largest absolute entry per sample (float32 or float64).

    Returns:
        ``(scale, exponent)``: ``scale = 2^-e`` in ``amax``'s dtype and ``e`` as int32, each
        ``(B,)``.
    """
    ok = torch.isfinite(amax) & (amax > 0)
    _, exponent = torch.frexp(torch.where(ok, amax, torch.ones_like(amax)))
    exponent = torch.where(ok, exponent, torch.zeros_like(exponent)).clamp(
        min=-MAX_UPSCALE_EXPONENT
    )
    return torch.ldexp(torch.ones_like(amax), -exponent), exponent


def autocast_off(device: torch.device | str) -> contextlib.AbstractContextManager:
    """Autocast disabled on ``device``.

    A no-op context where autocast does not exist (e.g. ``meta``) or is not enabled on the
    device (the common case: disabling it would change nothing, and building a
    ``torch.autocast`` costs ~25 us of Python per call, several calls per layer per step).
    """
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# Probes
# ----------------------------------------------------------------------------------------------


def draw_gaussian_probes(
    batch: int,
    rows: int,
    cols: int,
    *,
    generator: torch.Generator | None,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Draw independent per-sample Gaussian sketches with entries ``N(0, 1/cols)``.

    docs/privacy/estimators.md#estimators-hutchinson: with ``Omega_uv ~ N(0, 1/k)``, ``E[Omega
    Omega^T] = I``. One ``(rows, cols)`` matrix per sample, independent across samples (required by
    the ``"hidden"`` threat model, docs/privacy/threat_models.md#threat-models). Draws are made in
    float32 on the generator's device and then moved, so the same generator state gives the same
    probes whatever the input dtype and device. This is the single place where the library draws
    sketch randomness.

    Args:
        batch: ``B``, number of independent sketches.
        rows: Rows of each sketch (the sketched dimension).
        cols: ``k``, columns of each sketch.
        generator: Source of randomness; ``None`` uses torch's default generator.
        device: Device of the returned tensor.
        dtype: dtype of the returned tensor.

    Returns:
        Tensor of shape ``(batch, rows, cols)``.
    """
    gen_device = generator.device if generator is not None else torch.device(device)
    omega = torch.randn(
        (batch, rows, cols), generator=generator, device=gen_device, dtype=torch.float32
    )
    omega.mul_(1.0 / math.sqrt(cols))
    return omega.to(device=device, dtype=dtype)


class SketchGenerators:
    """The sources of sketch randomness of one grad-sample module: one generator per device.

    Each is created lazily on the device of the tensors it draws for and seeded from the
    operating system's CSPRNG (:mod:`secrets`), so probes are drawn where they are used (no
    host-device copy) and are unpredictable (the ``"hidden"`` threat model,
    docs/privacy/threat_models.md#threat-models). A user-supplied generator (reproducible
    experiments; accounted as not secret) serves every device instead: its probes are drawn on its
    device and moved. Meta tensors (FLOP counting) draw on the CPU.

    Args:
        user_generator: The caller's generator, or None.
    """

    def __init__(self, *, user_generator: torch.Generator | None = None) -> None:
        self._user = user_generator
        self._by_device: dict[torch.device, torch.Generator] = {}

    def for_device(self, device: torch.device | str) -> torch.Generator:
        """The generator for tensors on ``device`` (created and OS-seeded on first use)."""
        if self._user is not None:
            return self._user
        device = torch.device(device)
        if device.type == "meta":
            device = torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self._by_device.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(secrets.randbits(63))
            self._by_device[device] = gen
        return gen

    def reseed(self) -> None:
        """Reseed every generator this object created from :mod:`secrets` (secure mode)."""
        for gen in self._by_device.values():
            gen.manual_seed(secrets.randbits(63))


# ----------------------------------------------------------------------------------------------
# Estimators
# ----------------------------------------------------------------------------------------------


def hutchinson_sqnorm(
    activations: torch.Tensor,
    backprops: torch.Tensor,
    *,
    sketch_dim: int,
    generator: torch.Generator | None = None,
    probes: torch.Tensor | None = None,
    side: str = "auto",
    scale: tuple[torch.Tensor, torch.Tensor] | None = None,
    sum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r"""Hutchinson estimate of the per-sample squared Frobenius norm ``||G_i^T A_i||_F^2``.

    docs/privacy/estimators.md#estimators-hutchinson (Hutchinson 1989; DP-SGD-RC, arXiv:2605.24879,
    Sec. 3): with a per-sample sketch ``Omega_i`` (``p x k``, entries ``N(0, 1/k)``),

    .. math:: \hat n_i = tr(\Omega_i^T O_i \Omega_i) = \|A_i^T (G_i \Omega_i)\|_F^2 ,

    computed with two batched matrix products, ``U = G Omega`` (``B x T x k``) then
    ``V^T = U^T A`` (``B x k x d``). Unbiased because ``E[Omega Omega^T] = I``. The ratio to the
    truth is ``W = sum_j w_j chi2_k / k`` with ``w`` the normalised eigenvalues of ``O_i``, so
    ``Var W = (2/k) sum_j w_j^2 in [2/(k rank), 2/k]``. Sketching the ``d`` side instead
    (``Omega'`` of shape ``d x k``, ``||G^T (A Omega')||^2``) has the same law.

    Cost: ``2 B T k (p + d)`` FLOPs, ``B T k + B k min(p, d)`` extra floats.

    Args:
        activations: ``A``, shape ``(B, T, d)``.
        backprops: ``G``, shape ``(B, T, p)``, already scaled to the per-sample loss.
        sketch_dim: ``k``, the number of Gaussian columns per sample (>= 1).
        generator: Generator the probes are drawn from (ignored if ``probes`` is given).
            ``None`` uses torch's default generator.
        probes: Explicit sketch, shape ``(B, r, k)`` or ``(r, k)`` (shared) with ``r = p``
            (output side) or ``r = d`` (input side), **already scaled** (entries
            ``N(0, 1/k)``). For testing: the result is then exactly ``tr(Omega^T O Omega)``.
        side: ``"output"`` (``p`` side), ``"input"`` (``d`` side) or ``"auto"`` (the smaller
            one; with ``probes``, the side their shape matches).
        scale: Optional per-sample powers of two ``(s_A, s_G)``, each of shape ``(B,)``: the
            estimate is then that of ``(s_A A, s_G G)``, formed without scaled copies of the
            factors (the small operands are scaled instead, which is exact in floating point).
            Used to keep float32 intermediates in range (:mod:`opacus_rc.grad_sample.linear`).
        sum_dtype: dtype in which the squares of the sketch ``V`` are summed, and of the result
            (``None``: the compute dtype). ``torch.float64`` keeps the estimate finite wherever
            ``V`` is (see :data:`RANGE_SAFE_ESTIMATORS`).

    Returns:
        Tensor of shape ``(B,)``: estimates of ``||G_i^T A_i||_F^2`` (squared units of the
        gradient). float32 for float32/bf16/fp16 inputs (accumulated in float32 with autocast
        off), float64 for float64 inputs; ``sum_dtype`` where given.

    Raises:
        TypeError: If ``sketch_dim`` is not an int.
        ValueError: If ``sketch_dim < 1``, the shapes are inconsistent, or ``probes`` has the
            wrong shape.
    """
    if type(sketch_dim) is not int or sketch_dim < 1:  # the validator raises (or passes numpy's)
        validate_sketch_dim(sketch_dim)
    B, _, d, p = _check_factors(activations, backprops)
    side = _resolve_side(side, p, d, probes)
    # The input side of M = G^T A is the output side of M^T = A^T G: swap the factors.
    A, G = (activations, backprops) if side == "output" else (backprops, activations)
    s_a, s_g = _scale_views(scale, B, swap=side != "output")
    rows = G.shape[2]
    dtype = _compute_dtype(A, G)
    if probes is None:
        omega = draw_gaussian_probes(
            B, rows, sketch_dim, generator=generator, device=G.device, dtype=dtype
        )
    else:
        omega = _check_probes(probes, batch=B, rows=rows).to(device=G.device, dtype=dtype)
    with autocast_off(G.device):
        # Scaling the small operand by a power of two equals scaling the large one, exactly.
        U = torch.bmm(G.to(dtype), _scaled(omega, s_g))  # (B, T, k)
        # V^T = U^T A (B, k, d) rather than V = A^T U: the same entries, and the batched product
        # reads A as stored instead of through a transposed view (1.0-2.3x faster on a CPU).
        Vt = torch.bmm(_scaled(U, s_a).transpose(1, 2), A.to(dtype))  # (B, k, d)
        return _sum_of_squares(Vt, sum_dtype)


def _hutchpp_probes(
    B: int,
    d: int,
    p: int,
    s: int,
    k: int,
    generator: torch.Generator | None,
    head_probes: torch.Tensor | None,
    probes: torch.Tensor | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hutch++'s head sketch ``S`` (``B x d x s``) then tail sketch ``Omega`` (``B x p x k``):
    drawn in this order from ``generator``, or the given ones checked (one place, so that the
    factor and gradient forms draw the same probes)."""
    if head_probes is None:
        S = draw_gaussian_probes(B, d, s, generator=generator, device=device, dtype=dtype)
    else:
        S = _check_probes(head_probes, batch=B, rows=d, name="head_probes").to(device, dtype)
    if probes is None:
        omega = draw_gaussian_probes(B, p, k, generator=generator, device=device, dtype=dtype)
    else:
        omega = _check_probes(probes, batch=B, rows=p).to(device=device, dtype=dtype)
    return S, omega


def hutchpp_sqnorm(
    activations: torch.Tensor,
    backprops: torch.Tensor,
    *,
    sketch_dim: int,
    head_dim: int | None = None,
    generator: torch.Generator | None = None,
    probes: torch.Tensor | None = None,
    head_probes: torch.Tensor | None = None,
    scale: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    r"""Hutch++ estimate of ``||G_i^T A_i||_F^2`` with an exact head
    (docs/privacy/estimators.md#estimators-hutchpp).

    Meyer, Musco, Musco and Woodruff, "Hutch++", SOSA 2021, adaptive form with an **exact**
    head. Per sample, with ``s = head_dim`` head columns (``d`` side) and ``k = sketch_dim``
    tail columns (``p`` side), drawn independently:

    ``Y = A^T (G (G^T (A S))) = M^T M S`` (``d x s``), ``Q = qr(Y).Q``,
    ``head = ||G^T (A Q)||_F^2 = ||M Q||_F^2`` (exact),
    ``Z = (G Omega)^T A = Omega^T M`` (``k x d``), ``tail = ||Z - (Z Q) Q^T||_F^2``,
    ``n_hat = head + tail``.

    Unbiased since ``E[tail | Q] = ||M (I - Q Q^T)||_F^2``; exact when ``rank(M) <= s``;
    ``Var(n_hat | Q) = (2/k) ||(I - QQ^T) M^T M (I - QQ^T)||_F^2``. Privacy is certified by the
    Hutchinson envelope with ``k`` = tail columns (docs/privacy/hutchpp.md#hutchpp-privacy, Theorem
    H), which needs the tail sketch independent of the head sketch: they are separate draws here.

    Cost: about ``2 B T (3 s + k)(p + d)`` FLOPs plus a batched ``d x s`` QR.

    Args:
        activations: ``A``, shape ``(B, T, d)``.
        backprops: ``G``, shape ``(B, T, p)``, already scaled to the per-sample loss.
        sketch_dim: ``k``, Gaussian tail columns per sample (>= 1).
        head_dim: ``s``, head columns per sample (>= 1); defaults to ``sketch_dim``.
        generator: Generator for both sketches (head first, then tail). ``None`` uses torch's
            default generator.
        probes: Explicit tail sketch, ``(B, p, k)`` or ``(p, k)``, entries ``N(0, 1/k)``.
        head_probes: Explicit head sketch, ``(B, d, s)`` or ``(d, s)`` (any law).
        scale: Optional per-sample powers of two ``(s_A, s_G)``, as in
            :func:`hutchinson_sqnorm`.

    Returns:
        Tensor of shape ``(B,)``; dtype as in :func:`hutchinson_sqnorm`.

    Raises:
        TypeError: If ``sketch_dim`` or ``head_dim`` is not an int.
        ValueError: If a dimension is < 1 or a shape is inconsistent.
    """
    validate_sketch_dim(sketch_dim)
    s = sketch_dim if head_dim is None else validate_sketch_dim(head_dim, "head_dim")
    B, _, d, p = _check_factors(activations, backprops)
    dtype = _compute_dtype(activations, backprops)
    device = backprops.device
    S, omega = _hutchpp_probes(
        B, d, p, s, sketch_dim, generator, head_probes, probes, device=device, dtype=dtype
    )
    s_a, s_g = _scale_views(scale, B, swap=False)
    with autocast_off(device):
        A = activations.to(dtype)
        G = backprops.to(dtype)
        At = A.transpose(1, 2)
        Gt = G.transpose(1, 2)
        # Each product scales its small operand (exact for powers of two; see hutchinson_sqnorm).
        X = torch.bmm(G, _scaled(torch.bmm(Gt, _scaled(torch.bmm(A, _scaled(S, s_a)), s_g)), s_g))
        Y = torch.bmm(At, _scaled(X, s_a))  # (B, d, s)
        Q = torch.linalg.qr(Y, mode="reduced").Q  # (B, d, min(d, s)); scale-invariant
        head = torch.bmm(Gt, _scaled(torch.bmm(A, _scaled(Q, s_a)), s_g)).pow(2).sum(dim=(1, 2))
        Z = torch.bmm(_scaled(torch.bmm(G, _scaled(omega, s_g)), s_a).transpose(1, 2), A)
        resid = Z - torch.bmm(torch.bmm(Z, Q), Q.transpose(1, 2))
        tail = resid.pow(2).sum(dim=(1, 2))
        return head + tail


def _check_gradients(grads: torch.Tensor) -> tuple[int, int, int]:
    """Validate per-sample weight gradients ``(B, p, d)`` and return ``(B, p, d)``."""
    if grads.dim() != 3:
        raise ValueError(
            f"per-sample gradients must be 3-D (B, p, d); got shape {tuple(grads.shape)}"
        )
    B, p, d = grads.shape
    return B, p, d


def hutchinson_sqnorm_of_gradients(
    grads: torch.Tensor,
    *,
    sketch_dim: int,
    generator: torch.Generator | None = None,
    probes: torch.Tensor | None = None,
    side: str = "auto",
    scale: torch.Tensor | None = None,
    sum_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r""":func:`hutchinson_sqnorm` from the per-sample gradients ``M_i = G_i^T A_i`` themselves.

    The same estimator with the same probes: the probes are drawn exactly as
    :func:`hutchinson_sqnorm` draws them for factors ``A`` (``B x T x d``) and ``G``
    (``B x T x p``) with ``M_i = G_i^T A_i`` (one ``(B, r, k)`` draw, ``r`` the side's
    dimension, ``"auto"`` the smaller of ``p`` and ``d``), and the estimate
    ``||M_i^T Omega_i||_F^2`` (output side) or ``||M_i Omega'_i||_F^2`` (input side) is the
    value :func:`hutchinson_sqnorm` computes as ``||A_i^T (G_i Omega_i)||_F^2``, up to float
    rounding (matrix products associate). So a layer whose per-sample gradients are kept
    (:mod:`opacus_rc.grad_sample.norms`, the smaller stash) has the law, and, for the same
    generator state, the values, of the same layer sketched from ``A`` and ``G``: which of the
    two stashes a step keeps never changes a norm estimate's distribution
    (docs/privacy/estimators.md#estimators-hutchinson).

    Cost: ``2 B p d k`` FLOPs (against ``2 B T k (p + d)`` from the factors).

    Args:
        grads: ``M``, shape ``(B, p, d)``: per-sample weight gradients.
        sketch_dim: ``k`` (>= 1).
        generator: Generator the probes are drawn from (ignored if ``probes`` is given).
        probes: Explicit sketch, as in :func:`hutchinson_sqnorm`.
        side: ``"output"``, ``"input"`` or ``"auto"``, as in :func:`hutchinson_sqnorm`.
        scale: Optional ``(B,)`` per-sample powers of two ``s``: the estimate is then that of
            ``s M`` (the probes are scaled, not ``M``; exact in floating point).
        sum_dtype: dtype in which the squares of the sketch are summed, and of the result, as
            in :func:`hutchinson_sqnorm`.

    Returns:
        Tensor of shape ``(B,)``: estimates of ``||M_i||_F^2``; float32 for float32/bf16/fp16
        gradients (autocast off), float64 for float64; ``sum_dtype`` where given.

    Raises:
        TypeError: If ``sketch_dim`` is not an int.
        ValueError: If ``sketch_dim < 1`` or a shape is inconsistent.
    """
    if type(sketch_dim) is not int or sketch_dim < 1:
        validate_sketch_dim(sketch_dim)
    B, p, d = _check_gradients(grads)
    side = _resolve_side(side, p, d, probes)
    # Output side: M^T Omega (d x k), Omega p x k; input side: M Omega' (p x k), Omega' d x k.
    M = grads.transpose(1, 2) if side == "output" else grads
    rows = M.shape[2]
    dtype = _compute_dtype(grads)
    if probes is None:
        omega = draw_gaussian_probes(
            B, rows, sketch_dim, generator=generator, device=grads.device, dtype=dtype
        )
    else:
        omega = _check_probes(probes, batch=B, rows=rows).to(device=grads.device, dtype=dtype)
    with autocast_off(grads.device):
        s = None if scale is None else scale.reshape(B, 1, 1)
        V = torch.bmm(M.to(dtype), _scaled(omega, s))
        return _sum_of_squares(V, sum_dtype)


def hutchpp_sqnorm_of_gradients(
    grads: torch.Tensor,
    *,
    sketch_dim: int,
    head_dim: int | None = None,
    generator: torch.Generator | None = None,
    probes: torch.Tensor | None = None,
    head_probes: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    r""":func:`hutchpp_sqnorm` from the per-sample gradients ``M_i = G_i^T A_i`` themselves.

    The same estimator with the same probes (the head sketch ``S``, ``B x d x s``, drawn first,
    then the tail sketch ``Omega``, ``B x p x k``, as :func:`hutchpp_sqnorm` draws them):
    ``Y = M^T M S``, ``Q = qr(Y).Q``, ``head = ||M Q||_F^2``, ``Z = Omega^T M``,
    ``tail = ||Z - (Z Q) Q^T||_F^2``; equal to :func:`hutchpp_sqnorm` of the factors up to float
    rounding, so the law does not depend on which stash a step keeps.

    Args:
        grads: ``M``, shape ``(B, p, d)``.
        sketch_dim: ``k``, tail columns (>= 1).
        head_dim: ``s``, head columns (>= 1); defaults to ``sketch_dim``.
        generator: Generator for both sketches (head first, then tail).
        probes: Explicit tail sketch, ``(B, p, k)`` or ``(p, k)``.
        head_probes: Explicit head sketch, ``(B, d, s)`` or ``(d, s)``.
        scale: Optional ``(B,)`` per-sample powers of two ``s``: the estimate of ``s M``.

    Returns:
        Tensor of shape ``(B,)``; dtype as in :func:`hutchinson_sqnorm_of_gradients`.

    Raises:
        TypeError: If ``sketch_dim`` or ``head_dim`` is not an int.
        ValueError: If a dimension is < 1 or a shape is inconsistent.
    """
    validate_sketch_dim(sketch_dim)
    s = sketch_dim if head_dim is None else validate_sketch_dim(head_dim, "head_dim")
    B, p, d = _check_gradients(grads)
    dtype = _compute_dtype(grads)
    device = grads.device
    S, omega = _hutchpp_probes(
        B, d, p, s, sketch_dim, generator, head_probes, probes, device=device, dtype=dtype
    )
    sc = None if scale is None else scale.reshape(B, 1, 1)
    with autocast_off(device):
        M = grads.to(dtype)
        Mt = M.transpose(1, 2)
        # Each product with M scales its other operand first (exact for powers of two).
        Y = torch.bmm(Mt, _scaled(torch.bmm(M, _scaled(S, sc)), sc))  # (B, d, s)
        Q = torch.linalg.qr(Y, mode="reduced").Q
        head = torch.bmm(M, _scaled(Q, sc)).pow(2).sum(dim=(1, 2))
        Z = torch.bmm(_scaled(omega, sc).transpose(1, 2), M)  # (B, k, d)
        resid = Z - torch.bmm(torch.bmm(Z, Q), Q.transpose(1, 2))
        tail = resid.pow(2).sum(dim=(1, 2))
        return head + tail


#: Sketched squared-norm estimators, by the name used in :class:`SketchSpec`.
ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "hutchinson": hutchinson_sqnorm,
    "hutch++": hutchpp_sqnorm,
}

#: Factor-form estimator -> the same estimator computed from per-sample weight gradients
#: ``(B, p, d)`` (same probes, same law; :func:`hutchinson_sqnorm_of_gradients`). A sketched
#: layer may keep its per-sample gradients instead of its input and output gradient only where
#: its estimator is a key here (:mod:`opacus_rc.grad_sample.norms`); keyed by the function, so
#: an estimator registered in :data:`ESTIMATORS` under a built-in name is not mistaken for it.
GRADIENT_ESTIMATORS: dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = {
    hutchinson_sqnorm: hutchinson_sqnorm_of_gradients,
    hutchpp_sqnorm: hutchpp_sqnorm_of_gradients,
}


#: Estimators that take ``sum_dtype=``, and whose sketch ``V`` is finite wherever the
#: per-sample gradient's scale is in float32's range: ``V`` is ``Omega^T M_i`` (or ``M_i
#: Omega'``), a projection of the gradient (entries ``N(0, ||row||^2 / k)`` given ``M_i``),
#: formed through one ``(B, T, k)`` intermediate, ``G_i Omega`` (entries bounded by the rows of
#: ``G_i``). With the squares summed in float64 their estimate of ``||M_i||_F^2`` is finite up to
#: gradient norms near float32's largest value (3.4e38), without the per-sample max-abs scaling
#: of the factors that other estimators need (:mod:`opacus_rc.grad_sample.linear`); beyond it,
#: or where rows of both factors near 1e19 cancel in ``M_i``, the estimate is inf and the step
#: refuses it (never a finite wrong norm). At the other end, factor or sketch entries in
#: float32's subnormal range (below 1.2e-38) lose precision that scaled factors would keep: a
#: layer whose output gradients are that small has a norm of at most ``T * 1.2e-38 *
#: max|A_i|``, negligible next to a clipping bound for activations of any realistic size.
RANGE_SAFE_ESTIMATORS: frozenset[Callable[..., torch.Tensor]] = frozenset(
    {hutchinson_sqnorm, hutchinson_sqnorm_of_gradients}
)


def get_estimator(name: str) -> Callable[..., torch.Tensor]:
    """Look up an estimator in :data:`ESTIMATORS`.

    Args:
        name: Estimator name, e.g. ``"hutchinson"`` or ``"hutch++"``.

    Returns:
        The estimator function.

    Raises:
        ValueError: If ``name`` is not a key of :data:`ESTIMATORS`; the message lists them.
    """
    if name not in ESTIMATORS:  # the validator raises, listing the names
        validate_choice("sketch", name, tuple(ESTIMATORS))
    return ESTIMATORS[name]
