"""A weight tied between an input embedding and an LM head: the joint sketch of its summed gradient.

Language models such as SmolLM2, Llama 3.2 1B and Gemma tie the input embedding to the output
head (``tie_word_embeddings=True``: ``lm_head.weight is embed_tokens.weight``, ``W`` of shape
``V x d``). Autograd sums the gradients of both uses, so for sample ``i``

    grad_W loss_i = M_i = E_i + H_i,
    E_i = sum_{t: x_{i,t} != P} e_{x_{i,t}} g_{i,t}^T   (embedding: ids x_i, output gradient rows
                                                       g_{i,t} in R^d, padding id P skipped),
    H_i = G_i^T A_i                                    (head: input A_i (T' x d), output
                                                       gradient G_i (T' x V)),

and the per-sample norm the clip factor needs is ``||E_i + H_i||_F``, not
``sqrt(||E_i||^2 + ||H_i||^2)``: the cross term ``2 <E_i, H_i>_F`` is not zero (the logits'
gradient of a token and its input embedding's gradient share rows of ``W``).

**The joint sketch** (docs/privacy/estimators.md#estimators-hutchinson, the ``d``-side Hutchinson
estimator applied to ``M_i``). One fresh per-sample probe ``Omega_i`` (``d x k``, entries ``N(0,
1/k)``, drawn by :func:`~opacus_rc.sketching.draw_gaussian_probes` from the module's sketch
generator) serves both parts:

    Y_i = M_i Omega_i = G_i^T (A_i Omega_i) + sum_t e_{x_{i,t}} (g_{i,t}^T Omega_i)   (V x k),
    n_hat_i = ||Y_i||_F^2 = tr(Omega_i^T M_i^T M_i Omega_i).

The head's part is two batched products, the embedding's an ``index_add_`` of the ``(B, T, k)``
rows ``g Omega`` into rows ``x_{i,t}`` of ``Y_i`` (padding positions skipped, as autograd skips
them). Since ``E[Omega Omega^T] = I_d``, ``n_hat_i`` is unbiased, and its law is exactly that of
a Hutchinson sketch of ``M_i`` with ``k`` columns: ``n_hat_i / ||M_i||_F^2 = sum_j w_j
chi2_{k,j} / k`` with ``w`` the normalised squared singular values of ``M_i``, so
``Var(n_hat_i / n_i) <= 2 / k``. The step is therefore accounted with the module's
:class:`~opacus_rc.sketching.SketchSpec` unchanged (the envelope with ``k = sketch_dim``,
docs/privacy/envelope.md#envelope-definition; with Hutch++ selected, the tied weight still uses this
Hutchinson sketch with ``k = sketch_dim`` columns, which the Hutchinson envelope of the ``k`` tail
columns certifies, docs/privacy/hutchpp.md#hutchpp-privacy). The probes are independent of every
other layer's (fresh draws).

Cost: ``2 B T' k (d + V)`` (head) plus ``2 B T d k`` (embedding) FLOPs; ``B V k + B d k``
floats held from the first of the two backward hooks (the head's, in a language model) to the
second (the embedding's). No ``B x V x d`` tensor and no ``T x T`` Gram matrix is formed. The
order of the two hooks does not matter: whichever fires first draws ``Omega`` and starts ``Y``.

**Float32 range** (as :mod:`~opacus_rc.grad_sample.linear` and
:mod:`~opacus_rc.grad_sample.embedding`): each part is computed with its factors scaled per
sample by powers of two (exact in floating point) so that each sample's largest entry lies in
``[0.5, 1)``, which gives the part an exponent ``e_part``; the two parts are added at
``e = max(e_head, e_emb)`` (the other part multiplied by ``2^(e_part - e)``, exact unless it
underflows, in which case it lies below the float32 resolution of the larger part), and
``n_hat_i = 2^(2e) ||Y_i / 2^e||_F^2`` is rescaled in float64. Everything is accumulated in
float32 (float64 for float64 inputs) with autocast off, whatever the input dtype. The scaling
depends on the data only, never on the probes, so the estimator's law is unchanged; it takes no
data-dependent branch (no host synchronisation).

**Book-keeping** needs nothing new: both modules stash their inputs and output gradients, and
their clipped sums (:func:`~opacus_rc.grad_sample.linear.compute_linear_clipped_sum`:
``sum_i c_i G_i^T A_i``; :func:`~opacus_rc.grad_sample.embedding.compute_embedding_clipped_sum`:
the ``index_add_`` of ``c_i g_{i,t}``) are both added into ``W.grad``
(:func:`~opacus_rc.grad_sample.bookkeeping.write_clipped_sums`), which gives
``sum_i c_i (H_i + E_i) = sum_i c_i M_i``. In two-pass mode the second backward sums both uses.

Routing (which tyings are supported) lives in :mod:`~opacus_rc.grad_sample.routing`
(:class:`~opacus_rc.grad_sample.routing.TiedGroup`); this module holds the math
(:class:`JointSketch`, :func:`tied_hutchinson_sqnorm`) and the per-step state
(:class:`TiedSketches`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from opacus_rc.grad_sample.embedding import _ids_and_rows, _padding_index
from opacus_rc.grad_sample.routing import TiedGroup
from opacus_rc.sketching import (
    autocast_off,
    draw_gaussian_probes,
    pow2_scale,
    sample_absmax,
    validate_sketch_dim,
)

__all__ = ["JointSketch", "TiedSketches", "tied_hutchinson_sqnorm"]


def _pow2_exponent(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-sample ``e`` (int32, ``(B,)``) with ``max |t_i| * 2^-e`` in ``[0.5, 1)``.

    ``e = 0`` where the sample is all zeros, empty or not finite (a non-finite entry then gives
    a non-finite norm, which the module refuses), and ``e >= -100``
    (:func:`~opacus_rc.sketching.pow2_scale`). Always 0 in float64.
    """
    B = t.shape[0]
    if dtype == torch.float64 or t.numel() == 0:
        return torch.zeros(B, dtype=torch.int32, device=t.device)
    amax = sample_absmax(t).to(dtype)
    return pow2_scale(amax)[1]


def _pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2^exponent`` as a ``(B, 1, 1)`` tensor of ``dtype`` (0 where it underflows)."""
    one = torch.ones(exponent.shape, dtype=dtype, device=exponent.device)
    return torch.ldexp(one, exponent.to(dtype)).view(-1, 1, 1)


def _record_pow2_exponent(t: torch.Tensor, layout: Any, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_pow2_exponent` per record of packed rows ``(R, T, ...)``: ``(N,)`` int32.

    Each record's largest absolute entry over its tokens (a segment maximum over the
    ``(R, T)`` token-to-record map, padding left out): the value the record laid out alone
    (zeros after its end) gives, with no re-layout.
    """
    n = layout.num_records
    if dtype == torch.float64 or t.numel() == 0:
        return torch.zeros(n, dtype=torch.int32, device=t.device)
    R, T = layout.record_ids.shape
    flat = t.reshape(R * T, -1)
    amax = torch.maximum(flat.amax(dim=1), flat.amin(dim=1).neg()).to(dtype)  # (R T,)
    rid = layout.record_ids.to(t.device).reshape(-1)
    keep = rid >= 0
    amax = torch.where(keep, amax, torch.zeros_like(amax))
    out = torch.zeros(n, dtype=dtype, device=t.device)
    out.scatter_reduce_(0, rid.clamp(min=0), amax, reduce="amax", include_self=True)
    return pow2_scale(out)[1]


class JointSketch:
    """The running sketch ``Y_i = M_i Omega_i`` of one tied weight (see the module docstring).

    Add each part once (:meth:`add_linear`, :meth:`add_embedding`, in any order), then read
    :meth:`norm`. ``Y`` is stored scaled, ``Y_i / 2^{e_i}``.

    Args:
        probes: ``Omega`` of shape ``(B, d, k)``, entries ``N(0, 1/k)`` (already scaled); its
            dtype is the accumulation dtype (float32 or float64).
        num_embeddings: ``V``.
    """

    def __init__(self, probes: torch.Tensor, *, num_embeddings: int) -> None:
        if probes.dim() != 3:
            raise ValueError(f"probes must have shape (B, d, k); got {tuple(probes.shape)}")
        self.probes = probes
        self.num_embeddings = num_embeddings
        self._y: torch.Tensor | None = None
        self._exponent: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """``B``."""
        return self.probes.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The accumulation dtype."""
        return self.probes.dtype

    def _check(self, what: str, batch: int, d: int) -> None:
        B, rows, _ = self.probes.shape
        if batch != B or d != rows:
            raise ValueError(
                f"tied weight sketch: the {what} has batch size {batch} and width {d}, the "
                f"probes were drawn for batch size {B} and width {rows}; both modules sharing "
                "the weight must see the same batch (an input broadcast across the batch, "
                "e.g. ids of shape [1, T], cannot be measured per sample)"
            )

    def _align(self, exponent: torch.Tensor) -> torch.Tensor | None:
        """Bring ``Y`` to the common exponent ``max(e_Y, exponent)`` (per sample).

        Returns:
            The ``(B, 1, 1)`` factor ``2^(exponent - e)`` that the new part, scaled by
            ``2^-exponent``, must be multiplied by (``None`` for the first part).
        """
        if self._exponent is None:
            self._exponent = exponent
            return None
        e = torch.maximum(self._exponent, exponent)
        if self._y is not None:
            self._y.mul_(_pow2(self._exponent - e, self.dtype))
        self._exponent = e
        return _pow2(exponent - e, self.dtype)

    def add_linear(self, activations: torch.Tensor, backprops: torch.Tensor) -> None:
        """Add the head's part ``G_i^T (A_i Omega_i)``.

        Args:
            activations: ``A``, ``(B, T', d)``, any floating dtype.
            backprops: ``G``, ``(B, T', V)``, rescaled to per-sample losses.

        Raises:
            ValueError: Shapes that disagree with each other or with the probes.
        """
        B, T, d = activations.shape
        if backprops.shape != (B, T, self.num_embeddings):
            raise ValueError(
                f"tied weight sketch: head input {tuple(activations.shape)} and output gradient "
                f"{tuple(backprops.shape)} disagree (V = {self.num_embeddings})"
            )
        self._check("head input", B, d)
        dtype, omega = self.dtype, self.probes.to(activations.device)
        with autocast_off(backprops.device):
            A = activations.to(dtype)
            G = backprops.to(dtype)
            e_a, e_g = _pow2_exponent(A, dtype), _pow2_exponent(G, dtype)
            # Scaling the small operands by powers of two equals scaling A and G, exactly.
            U = torch.bmm(A, omega * _pow2(-e_a, dtype))  # (B, T', k)
            part = torch.bmm(G.transpose(1, 2), U * _pow2(-e_g, dtype))  # (B, V, k)
            del U
            part = part.to(self.probes.device)
            factor = self._align((e_a + e_g).to(self.probes.device))
            if factor is not None:
                part.mul_(factor)
            if self._y is None:
                self._y = part
            else:
                self._y.add_(part)

    def add_embedding(
        self, ids: torch.Tensor, backprops: torch.Tensor, *, padding_idx: int | None
    ) -> None:
        """Add the embedding's part ``sum_t e_{x_{i,t}} (g_{i,t}^T Omega_i)`` (padding skipped).

        Args:
            ids: ``(B, T)`` integer ids in ``[0, V)``.
            backprops: ``(B, T, d)`` output gradient rows, rescaled to per-sample losses.
            padding_idx: The (normalised) padding id, or None.

        Raises:
            ValueError: Shapes that disagree with each other or with the probes.
        """
        B, T, d = backprops.shape
        if ids.shape != (B, T):
            raise ValueError(
                f"tied weight sketch: ids {tuple(ids.shape)} and embedding output gradient "
                f"{tuple(backprops.shape)} disagree"
            )
        self._check("embedding output gradient", B, d)
        dtype = self.dtype
        device = self.probes.device
        with autocast_off(backprops.device):
            g = backprops.to(device=device, dtype=dtype)
            ids = ids.to(device)
            if padding_idx is not None:  # autograd gives the padding row nothing
                g = g.masked_fill((ids == padding_idx).unsqueeze(-1), 0)
            e_g = _pow2_exponent(g, dtype)
            values = torch.bmm(g, self.probes * _pow2(-e_g, dtype))  # (B, T, k)
            factor = self._align(e_g)
            if factor is not None:
                values.mul_(factor)
            B, V, k = values.shape[0], self.num_embeddings, values.shape[2]
            if self._y is None:
                self._y = torch.zeros(B, V, k, device=device, dtype=dtype)
            rows = (ids + torch.arange(B, device=device).view(B, 1) * V).reshape(B * T)
            self._y.view(B * V, k).index_add_(0, rows, values.reshape(B * T, k))

    def add_linear_packed(
        self,
        activations: torch.Tensor,
        backprops: torch.Tensor,
        *,
        layout: Any,
        scale: float = 1,
    ) -> None:
        """Add the head's part per record of packed rows (``record_ids=``), ``O(tokens)``.

        Record ``r``'s part is ``sum_{t in r} G_t (a_t^T Omega_r)``, taken chunk by chunk
        (:class:`~opacus_rc.grad_sample.packed.RecordLayout`) and summed per record with an
        ``index_add``: the value of :meth:`add_linear` on the record's tokens laid out alone,
        with the same probe and the same per-record power-of-two scaling (each record's
        largest entry of ``A`` and of ``G``), up to float rounding. No ``(N, max T_r, ...)``
        re-layout.

        Args:
            activations: ``A``, ``(R, T, d)``.
            backprops: ``G``, ``(R, T, V)``, rescaled to per-record losses.
            layout: The batch's :class:`~opacus_rc.grad_sample.packed.RecordLayout`
                (``N`` records: the probes' batch size).
            scale: The part is that of ``scale * G`` (the rescale to per-record losses,
                applied to the ``T x k`` products rather than copied into ``G``).

        Raises:
            ValueError: Shapes that disagree with each other, the layout or the probes.
        """
        R, T = layout.record_ids.shape
        if (
            activations.dim() != 3
            or tuple(activations.shape[:2]) != (R, T)
            or tuple(backprops.shape) != (R, T, self.num_embeddings)
        ):
            raise ValueError(
                f"tied weight sketch: head input {tuple(activations.shape)} and output gradient "
                f"{tuple(backprops.shape)} are not packed rows ({R}, {T}, ...) with "
                f"V = {self.num_embeddings}"
            )
        self._check("head input", layout.num_records, activations.shape[2])
        dtype, omega = self.dtype, self.probes.to(activations.device)
        chunk = layout.chunk_record.to(activations.device)
        with autocast_off(backprops.device):
            e_a = _record_pow2_exponent(activations, layout, dtype)
            e_g = _record_pow2_exponent(backprops, layout, dtype)
            if layout.segments is not None:  # CPU: views of each record's runs, no copy
                d, V = activations.shape[2], self.num_embeddings
                A2 = activations.reshape(R * T, d).to(dtype)
                G2 = backprops.reshape(R * T, V).to(dtype)
                # As the chunks: A's scale on Omega, then G's on A Omega (no combined factor
                # that could underflow).
                scaled, inv_g = omega * _pow2(-e_a, dtype), _pow2(-e_g, dtype) * scale
                part = torch.zeros(
                    layout.num_records, V, omega.shape[2], dtype=dtype, device=G2.device
                )
                for r, start, end in layout.segments:  # Y_r += G_s^T (A_s Omega_r)
                    U = (A2[start:end] @ scaled[r]).mul_(inv_g[r])
                    part[r].addmm_(G2[start:end].t(), U)
                self._add_part(part, e_a + e_g)
                return
            scaled = (omega * _pow2(-e_a, dtype))[chunk]  # (C, d, k)
            U = torch.bmm(layout.gather(activations, dtype=dtype), scaled)  # (C, L, k)
            del scaled
            U.mul_((_pow2(-e_g, dtype) * scale)[chunk])
            Yc = torch.bmm(layout.gather(backprops, dtype=dtype).transpose(1, 2), U)  # (C, V, k)
            del U
            n = layout.num_records
            part = torch.zeros(n, *Yc.shape[1:], dtype=dtype, device=Yc.device)
            part.index_add_(0, chunk, Yc)
            del Yc
            self._add_part(part, e_a + e_g)

    def _add_part(self, part: torch.Tensor, exponent: torch.Tensor) -> None:
        """Add a whole ``(N, V, k)`` part scaled by ``2^-exponent`` (per sample)."""
        part = part.to(self.probes.device)
        factor = self._align(exponent.to(self.probes.device))
        if factor is not None:
            part.mul_(factor)
        if self._y is None:
            self._y = part
        else:
            self._y.add_(part)

    def add_embedding_packed(
        self,
        ids: torch.Tensor,
        backprops: torch.Tensor,
        *,
        padding_idx: int | None,
        layout: Any,
        scale: float = 1,
    ) -> None:
        """Add the embedding's part per record of packed rows (``record_ids=``), ``O(tokens)``.

        Record ``r``'s part is the ``index_add`` of the rows ``g_t^T Omega_r`` (``t`` in
        ``r``, padding id skipped) at rows ``x_t`` of ``Y_r``: :meth:`add_embedding` on the
        record's tokens laid out alone, same probe and per-record scaling, up to rounding.

        Args:
            ids: ``(R, T)`` integer ids in ``[0, V)``.
            backprops: ``(R, T, d)``, rescaled to per-record losses.
            padding_idx: The (normalised) padding id, or None.
            layout: The batch's :class:`~opacus_rc.grad_sample.packed.RecordLayout`.
            scale: The part is that of ``scale * g`` (applied to the probes, not to ``g``).

        Raises:
            ValueError: Shapes that disagree with each other, the layout or the probes.
        """
        R, T = layout.record_ids.shape
        if (
            tuple(ids.shape) != (R, T)
            or backprops.dim() != 3
            or tuple(backprops.shape[:2]) != (R, T)
        ):
            raise ValueError(
                f"tied weight sketch: ids {tuple(ids.shape)} and embedding output gradient "
                f"{tuple(backprops.shape)} are not packed rows ({R}, {T}, ...)"
            )
        self._check("embedding output gradient", layout.num_records, backprops.shape[2])
        dtype = self.dtype
        device = self.probes.device
        with autocast_off(backprops.device):
            g = backprops.to(device=device, dtype=dtype)
            ids = ids.to(device).long()
            if padding_idx is not None:  # autograd gives the padding row nothing
                g = g.masked_fill((ids == padding_idx).unsqueeze(-1), 0)
            chunk = layout.chunk_record.to(device)
            e_g = _record_pow2_exponent(g, layout, dtype)
            if layout.segments is not None:  # CPU: views of each record's runs, no copy
                n, V, k = layout.num_records, self.num_embeddings, self.probes.shape[2]
                scaled = self.probes * (_pow2(-e_g, dtype) * scale)
                factor = self._align(e_g)
                if self._y is None:
                    self._y = torch.zeros(n, V, k, device=device, dtype=dtype)
                g2, ids2 = g.reshape(R * T, g.shape[2]), ids.reshape(R * T)
                for r, start, end in layout.segments:  # rows x_t of Y_r += g_t^T Omega_r
                    values = g2[start:end] @ scaled[r]
                    if factor is not None:
                        values.mul_(factor[r])
                    self._y[r].index_add_(0, ids2[start:end], values)
                return
            scaled = (self.probes * (_pow2(-e_g, dtype) * scale))[chunk]  # (C, d, k)
            values = torch.bmm(layout.gather(g), scaled)  # (C, L, k), zero at empty slots
            del scaled
            factor = self._align(e_g)
            if factor is not None:
                values.mul_(factor[chunk])
            n, V, k = layout.num_records, self.num_embeddings, values.shape[2]
            if self._y is None:
                self._y = torch.zeros(n, V, k, device=device, dtype=dtype)
            rows = chunk.unsqueeze(1) * V + layout.gather(ids)  # (C, L)
            self._y.view(n * V, k).index_add_(0, rows.reshape(-1), values.reshape(-1, k))

    def sqnorm_and_exponent(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(||Y_i / 2^{e_i}||_F^2 in float64, e_i)``: ``n_hat_i = 2^{2 e_i}`` times the first.

        Raises:
            RuntimeError: If no part was added.
        """
        if self._y is None or self._exponent is None:
            raise RuntimeError("tied weight sketch: no part was added")
        with autocast_off(self._y.device):
            sq = torch.linalg.vector_norm(self._y, dim=(1, 2)).double().square()
        return sq, self._exponent

    def norm(self) -> torch.Tensor:
        """``(B,)`` norm estimates ``sqrt(n_hat_i)``: float32, float64 for a float64 sketch."""
        sq, exponent = self.sqnorm_and_exponent()
        out = torch.ldexp(sq.sqrt(), exponent.to(sq.device, torch.float64))
        return out.to(torch.float64 if self.dtype == torch.float64 else torch.float32)

    def release(self) -> None:
        """Drop the probes and the sketch (never kept beyond the step)."""
        self._y = None
        self._exponent = None
        self.probes = torch.empty(0)


def _record_sums(G: torch.Tensor, layout: Any, dtype: torch.dtype) -> torch.Tensor:
    """``(N, V)``: each record's sum of the token rows of ``G`` (``(R, T, V)``), no padding."""
    R, T = layout.record_ids.shape
    rid = layout.record_ids.to(G.device).reshape(-1)
    rows = G.reshape(R * T, -1).to(dtype).masked_fill((rid < 0).unsqueeze(1), 0)
    return rows.new_zeros(layout.num_records, rows.shape[1]).index_add_(0, rid.clamp(min=0), rows)


def _dtype_of(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _linear_factors(
    layer: nn.Linear, activations: list[torch.Tensor], backprops: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, G)`` as ``(B, T', d)`` and ``(B, T', V)`` (rank-2 inputs have ``T' = 1``)."""
    A, G = activations[0], backprops
    if A.dim() < 2 or A.shape[:-1] != G.shape[:-1]:
        raise ValueError(
            f"tied nn.Linear: input of shape {tuple(A.shape)} does not match output gradient "
            f"of shape {tuple(G.shape)} (batch first, same leading dimensions expected)"
        )
    B = A.shape[0]
    T = math.prod(A.shape[1:-1])
    return A.reshape(B, T, A.shape[-1]), G.reshape(B, T, G.shape[-1])


def tied_hutchinson_sqnorm(
    activations: torch.Tensor,
    head_backprops: torch.Tensor,
    ids: torch.Tensor,
    embedding_backprops: torch.Tensor,
    *,
    sketch_dim: int,
    padding_idx: int | None = None,
    generator: torch.Generator | None = None,
    probes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Joint Hutchinson estimate of ``||G_i^T A_i + sum_t e_{x_{i,t}} g_{i,t}^T||_F^2``.

    The squared per-sample norm of the summed gradient of a weight tied between an
    ``nn.Linear`` head and an ``nn.Embedding`` (see the module docstring;
    docs/privacy/estimators.md#estimators-hutchinson, ``d``-side sketch). What the module computes
    across the two backward hooks, in one call.

    Args:
        activations: Head input ``A``, ``(B, T', d)``.
        head_backprops: Head output gradient ``G``, ``(B, T', V)``.
        ids: Embedding ids ``x``, ``(B, T)``, integers in ``[0, V)``.
        embedding_backprops: Embedding output gradient ``g``, ``(B, T, d)``.
        sketch_dim: ``k``.
        padding_idx: Padding id in ``[0, V)`` (its positions give no gradient), or None.
        generator: Generator for the probes (ignored with ``probes``).
        probes: Explicit ``Omega``, ``(B, d, k)``, already scaled (for tests: the result is then
            exactly ``||M_i Omega_i||_F^2``).

    Returns:
        ``(B,)`` float64 squared-norm estimates.

    Raises:
        TypeError, ValueError: Invalid ``sketch_dim`` or inconsistent shapes.
    """
    validate_sketch_dim(sketch_dim)
    B, _, d = activations.shape
    dtype = _dtype_of(activations, head_backprops, embedding_backprops)
    if probes is None:
        probes = draw_gaussian_probes(
            B, d, sketch_dim, generator=generator, device=head_backprops.device, dtype=dtype
        )
    elif probes.shape != (B, d, sketch_dim):
        raise ValueError(f"probes must have shape ({B}, {d}, {sketch_dim}); got {probes.shape}")
    sketch = JointSketch(probes.to(dtype), num_embeddings=head_backprops.shape[-1])
    sketch.add_linear(activations, head_backprops)
    sketch.add_embedding(ids, embedding_backprops, padding_idx=padding_idx)
    sq, exponent = sketch.sqnorm_and_exponent()
    return torch.ldexp(sq, 2 * exponent.to(sq.device, torch.float64))


class _Pending:
    """A tied weight whose first module's part is in, waiting for the other's (one backward)."""

    __slots__ = ("done", "sketch")

    def __init__(self, sketch: JointSketch, done: nn.Module) -> None:
        self.sketch = sketch
        self.done = done


class TiedSketches:
    """The tied groups of one model and the joint sketches of the current backward.

    Called by the randomized-clipping module's backward hook for a module routed ``TIED``
    (:meth:`sample`). The first of a group's two modules draws the probes and adds its part;
    the second adds its part and returns the shared weight's norm, which is then recorded
    once. A group with one part only when the clip factors are asked for raises
    (:meth:`check_complete`): no partial norm is ever accounted.

    Args:
        groups: The supported tyings (:func:`~opacus_rc.grad_sample.routing.find_tied_groups`).
        name_of: Qualified name of a module or parameter (for messages).
    """

    def __init__(self, groups: Iterable[TiedGroup], *, name_of: Callable[[object], str]) -> None:
        self.groups = list(groups)
        self._name_of = name_of
        self._group_of = {id(m): g for g in self.groups for m in g.modules}
        self._pending: dict[int, _Pending] = {}

    @property
    def supported_parameters(self) -> frozenset[int]:
        """``id`` of every shared weight of a supported tying."""
        return frozenset(id(g.weight) for g in self.groups)

    def group_of(self, module: nn.Module) -> TiedGroup | None:
        """The group ``module`` belongs to, or None."""
        return self._group_of.get(id(module))

    def _describe(self, group: TiedGroup) -> str:
        return (
            f"'{self._name_of(group.weight)}', shared by '{group.embedding_name}' (Embedding) "
            f"and '{group.linear_name}' (Linear)"
        )

    def sample(
        self,
        module: nn.Module,
        activations: list[torch.Tensor],
        backprops: torch.Tensor,
        *,
        sketch_dim: int,
        generator: torch.Generator | None,
        layout: Any = None,
        scale: float = 1,
    ) -> tuple[dict[nn.Parameter, torch.Tensor], frozenset[int]]:
        """One tied module's backward: its part of the joint sketch, and its other norms.

        Args:
            module: The embedding or the linear layer of a group.
            activations: Its forward inputs (batch first).
            backprops: Its output gradient, rescaled to per-sample losses.
            sketch_dim: ``k``.
            generator: The sketch generator for the probes' device.
            layout: Packed rows (``record_ids=``): the batch's
                :class:`~opacus_rc.grad_sample.packed.RecordLayout`; ``activations`` and
                ``backprops`` are then ``(R, T, ...)`` token rows, and the norms are per
                record (``N`` probes, one per record, drawn as for ``N`` samples; each part
                taken straight from the packed rows: :meth:`JointSketch.add_linear_packed`,
                :meth:`JointSketch.add_embedding_packed`). Both modules of a group must get
                the same layout.
            scale: With ``layout``: the output gradient of the per-record losses is
                ``scale * backprops`` (folded into the norms, not copied into the gradient).

        Returns:
            ``(norms, deferred)``: ``{parameter: (B,) norm}`` (the head's own bias, exact; the
            shared weight once both parts are in) and the ``id`` of the shared weight if its
            norm waits for the other module's part.

        Raises:
            RuntimeError: The same module's part arrives twice before the other's.
            ValueError: Inconsistent shapes or batch sizes, or an unsupported embedding option.
        """
        group = self._group_of[id(module)]
        weight = group.weight
        norms: dict[nn.Parameter, torch.Tensor] = {}
        if module is group.linear:
            A, G = _linear_factors(group.linear, activations, backprops)
            bias = group.linear.bias
            if bias is not None and bias.requires_grad:
                acc = _dtype_of(A, G)
                with autocast_off(G.device):
                    if layout is None:
                        g_sum = G.sum(dim=1, dtype=acc)  # (B, V): the exact bias gradient
                    else:  # each record's summed output gradient rows (padding left out)
                        g_sum = _record_sums(G, layout, acc)
                    norms[bias] = torch.linalg.vector_norm(g_sum.double(), dim=1).to(acc)
                    if scale != 1:
                        norms[bias] = norms[bias] * scale
            dtype, batch, d = _dtype_of(A, G), A.shape[0], A.shape[-1]
        else:
            ids, G = _ids_and_rows(group.embedding, activations, backprops, "tied sketch")
            dtype, batch, d = _dtype_of(G), G.shape[0], G.shape[-1]
        if layout is not None:
            batch = layout.num_records
        if not weight.requires_grad:  # frozen after make_private: nothing to sketch
            return norms, frozenset()
        pending = self._pending.get(id(weight))
        if pending is not None and pending.done is module:
            self.clear()
            raise RuntimeError(
                f"the tied weight {self._describe(group)}: the backward of "
                f"'{self._name_of(module)}' ran twice before the other module's; each must run "
                "once per step (call backward after every training forward)"
            )
        if pending is None:
            probes = draw_gaussian_probes(
                batch, d, sketch_dim, generator=generator, device=G.device, dtype=dtype
            )
            pending = _Pending(
                JointSketch(probes, num_embeddings=group.embedding.num_embeddings), module
            )
            self._pending[id(weight)] = pending
            first = True
        else:
            first = False
        try:
            if module is group.linear:
                if layout is None:
                    pending.sketch.add_linear(A, G)
                else:
                    pending.sketch.add_linear_packed(A, G, layout=layout, scale=scale)
            else:
                pad = _padding_index(group.embedding)
                if layout is None:
                    pending.sketch.add_embedding(ids, G, padding_idx=pad)
                else:
                    pending.sketch.add_embedding_packed(
                        ids, G, padding_idx=pad, layout=layout, scale=scale
                    )
        except BaseException:
            self.clear()
            raise
        if first:
            return norms, frozenset((id(weight),))
        del self._pending[id(weight)]
        norms[weight] = pending.sketch.norm()
        pending.sketch.release()
        return norms, frozenset()

    def check_complete(self) -> None:
        """Raise if a shared weight got one module's part only in this backward (cleared).

        Raises:
            RuntimeError: Naming the weight, both modules and the one whose backward ran.
        """
        if not self._pending:
            return
        pid, pending = next(iter(self._pending.items()))
        group = next(g for g in self.groups if id(g.weight) == pid)
        ran = self._name_of(pending.done)
        self.clear()
        raise RuntimeError(
            f"the tied weight {self._describe(group)} got a gradient from '{ran}' but the "
            "other module's backward did not run in this step: its per-sample norm must be "
            "that of the summed gradient of both uses, so no partial norm is accounted and "
            "this step is refused. Run both modules once in every training forward with both "
            "outputs reaching the loss (e.g. pass input_ids, not inputs_embeds), or untie or "
            "freeze the weight."
        )

    def clear(self) -> None:
        """Drop every pending sketch and its probes."""
        for pending in self._pending.values():
            pending.sketch.release()
        self._pending = {}
