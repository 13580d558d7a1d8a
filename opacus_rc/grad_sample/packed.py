"""Per-record gradient norms and clipped sums inside packed rows (docs/packing.md#packing).

A packed batch holds ``R`` rows of ``T`` tokens and ``N`` records, with ``record_ids``
``(R, T)`` the record of each token (-1 at padding; :func:`opacus_rc.packing.pack_records`).
When attention stays inside each record (:func:`opacus_rc.packing.check_records_independent`),
the output gradient rows of a token-wise module at record ``r``'s tokens depend on record ``r``
alone, and the record's gradient of an ``nn.Linear`` (input rows ``a_t``, ``d``; output gradient
rows ``g_t``, ``p``) is

    M_r = sum_{t in r} g_t a_t^T    (p x d),

a sum over the record's tokens wherever they lie (several rows for a record cut across rows).
Pass ``units[record_ids]`` (and ``num_records = U``) to clip per unit instead: a unit's gradient
is the same sum over the tokens of all its records.

**The layout** (:class:`RecordLayout`, built once per batch and shared by every layer). The
valid tokens are sorted by record (stably) and cut into *chunks* of ``chunk_size = L`` tokens
of one record each; ``C <= R T / L + N`` chunks. A record of ``l`` tokens occupies
``ceil(l / L)`` chunks, so the layout wastes at most ``L - 1`` slots per record (where padding
every record to the longest one, ``N x max l``, would waste most of a ragged batch). Every
per-record quantity below is a batched product over chunks followed by an ``index_add`` over
the chunks of each record: linear in each record's tokens. On a CPU the layout also lists the
*runs* of each record (its consecutive tokens in the flat ``R T`` order: one per row it lies
in), and the sketches take two products per run on views of the packed rows instead (no
copy, no padded slot; the same estimate up to rounding).

* :func:`linear_record_sketched_sqnorms`: the Hutchinson estimate of
  ``||M_r||_F^2`` of :func:`opacus_rc.sketching.hutchinson_sqnorm`, with one fresh probe
  ``Omega_r`` (``p x k`` or ``d x k``, entries ``N(0, 1/k)``, drawn by
  :func:`~opacus_rc.sketching.draw_gaussian_probes` for ``N`` samples) per record:
  ``V_r = sum_{chunks c of r} A_c^T (G_c Omega_r)`` (``d x k``), ``n_hat_r = ||V_r||_F^2``.
  ``O(T_r k (p + d))`` per record; it is the estimator of the record's tokens laid out alone
  (same probes, same definition: equal up to rounding).
* :func:`linear_record_sqnorms`: exact ``||M_r||_F^2`` (and the bias's ``||sum_t g_t||^2``),
  either by the Gram identity over pairs of chunks of one record,
  ``sum_{t, s in r} (a_t . a_s)(g_t . g_s)`` (``O(T_r^2 (p + d))``), or by forming each
  record's ``M_r`` (``O(T_r p d)`` time, ``N p d`` memory), whichever costs fewer operations.
* :func:`linear_record_clipped_sum`: ``sum_r c_r M_r`` (and the bias's), one pass over the
  packed tensors with each token row weighted by its record's factor (book-keeping).
* :func:`embedding_record_sqnorms` and :func:`embedding_record_clipped_sum`: the same for an
  ``nn.Embedding``, exact: ``||grad_W||_F^2 = sum_v ||sum_{t in r: x_t = v} g_t||^2``, the
  ``padding_idx`` row excluded (autograd gives it nothing).
* :func:`tied_record_sketched_sqnorms`: a weight tied between the input embedding and the LM
  head, the joint sketch of :func:`opacus_rc.grad_sample.tied.tied_hutchinson_sqnorm` per
  record, ``||(H_r + E_r) Omega_r||_F^2`` with one ``d x k`` probe per record. The clipped sum
  of a tied weight is the head's plus the embedding's (both functions above).

Accumulation is in float32 (float64 for float64 inputs) with autocast off. No power-of-two
rescaling is done here (the module samplers of :mod:`opacus_rc.grad_sample.linear` do it):
these are the pure building blocks, float32 overflow above ``~1.8e19`` per norm is not guarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opacus_rc.sketching import autocast_off, draw_gaussian_probes
from opacus_rc.validation import validate_sketch_dim

__all__ = [
    "RecordLayout",
    "embedding_record_clipped_sum",
    "embedding_record_sqnorms",
    "linear_record_clipped_sum",
    "linear_record_sketched_sqnorms",
    "linear_record_sqnorms",
    "tied_record_sketched_sqnorms",
]

_METHODS = ("auto", "gram", "materialize")


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@dataclass(frozen=True)
class RecordLayout:
    """The tokens of each record of a packed batch, in chunks of one record (module docstring).

    Build it with :meth:`from_record_ids` once per batch (one host synchronisation: the number
    of chunks is data dependent) and pass it to every layer's function.

    Attributes:
        record_ids: ``(R, T)`` long, the record (or unit) of each token, -1 at padding.
        num_records: ``N``.
        chunk_size: ``L``.
        token_index: ``(C, L)`` long, the flat index ``row * T + t`` of each chunk slot's
            token, ``R * T`` (a zero row) at empty slots.
        chunk_record: ``(C,)`` long, the record of each chunk.
        pair_left, pair_right: ``(P,)`` long, every ordered pair of chunks of one record
            (``P = sum_r ceil(T_r / L)^2``), for the Gram identity.
        tokens: ``(N,)`` long, tokens per record (0 for a record with none in the batch).
        record_index: ``(N, max T_r)`` long, the flat index of each record's tokens in
            order of position in the packed rows (row-major), ``R * T`` past its end; for
            :meth:`per_record`.
        token_empty, record_empty: ``(E,)`` long, the flat positions in ``token_index``
            and ``record_index`` that hold ``R * T`` (no token): zeroed after a gather.
        segments: On a CPU, the runs of consecutive flat token indices of one record, as
            ``(record, start, end)`` Python ints (a record inside one row is one run, a record
            cut across rows one per row), in record order; None on other devices.
    """

    record_ids: torch.Tensor
    num_records: int
    chunk_size: int
    token_index: torch.Tensor
    chunk_record: torch.Tensor
    pair_left: torch.Tensor
    pair_right: torch.Tensor
    tokens: torch.Tensor
    record_index: torch.Tensor
    token_empty: torch.Tensor | None = None
    record_empty: torch.Tensor | None = None
    segments: tuple[tuple[int, int, int], ...] | None = None

    @classmethod
    def from_record_ids(
        cls,
        record_ids: torch.Tensor,
        *,
        num_records: int | None = None,
        chunk_size: int = 64,
    ) -> RecordLayout:
        """The layout of ``record_ids``.

        Args:
            record_ids: ``(R, T)`` integer tensor, the record of each token (values
                ``0..N-1``), -1 at padding. Pass ``units[record_ids]`` to clip per unit.
            num_records: ``N``; default ``max(record_ids) + 1`` (records with no token get a
                zero norm).
            chunk_size: ``L >= 1``, tokens per chunk (a record wastes at most ``L - 1`` slots;
                larger chunks mean fewer, longer products).

        Returns:
            The :class:`RecordLayout`, on ``record_ids``' device.

        Raises:
            ValueError: If ``record_ids`` is not a 2-D integer tensor, has a value below -1 or
                not below ``num_records``, or ``chunk_size < 1``.
        """
        if (
            not isinstance(record_ids, torch.Tensor)
            or record_ids.dim() != 2
            or record_ids.is_floating_point()
            or record_ids.is_complex()
            or record_ids.dtype == torch.bool
        ):
            raise ValueError(
                "record_ids must be a (R, T) integer tensor (-1 at padding), got "
                f"{type(record_ids).__name__} of shape {tuple(getattr(record_ids, 'shape', ()))}"
            )
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        rid = record_ids.long()
        device = rid.device
        R, T = rid.shape
        hi = int(rid.max()) if rid.numel() else -1
        lo = int(rid.min()) if rid.numel() else -1
        n = hi + 1 if num_records is None else int(num_records)
        if lo < -1 or hi >= n:
            raise ValueError(
                f"record_ids must lie in [-1, {n}) (num_records={n}), got values in [{lo}, {hi}]"
            )
        flat = rid.reshape(-1)
        tok = (flat >= 0).nonzero().squeeze(1)
        rec = flat[tok]
        rec, order = torch.sort(rec, stable=True)
        tok = tok[order]
        counts = torch.bincount(rec, minlength=n)
        first = counts.cumsum(0) - counts
        pos = torch.arange(rec.numel(), device=device) - first[rec]  # index inside the record
        L = chunk_size
        nch = (counts + L - 1) // L
        cstart = nch.cumsum(0) - nch
        C = int(nch.sum())
        token_index = torch.full((C * L,), R * T, dtype=torch.long, device=device)
        token_index[(cstart[rec] + pos // L) * L + pos % L] = tok
        records = torch.arange(n, device=device)
        chunk_record = torch.repeat_interleave(records, nch)
        pairs = nch * nch
        pair_record = torch.repeat_interleave(records, pairs)
        q = torch.arange(int(pairs.sum()), device=device) - (pairs.cumsum(0) - pairs)[pair_record]
        k = nch[pair_record]
        segments = None
        if device.type == "cpu":  # runs of one record's consecutive tokens (host ints)
            cut = torch.ones_like(tok, dtype=torch.bool)
            cut[1:] = (rec[1:] != rec[:-1]) | (tok[1:] != tok[:-1] + 1)
            starts = cut.nonzero().squeeze(1)
            lengths = torch.diff(starts, append=starts.new_tensor([tok.numel()]))
            segments = tuple(
                (r, t, t + m)
                for r, t, m in zip(
                    rec[starts].tolist(), tok[starts].tolist(), lengths.tolist(), strict=True
                )
            )
        longest = int(counts.max()) if n else 0
        record_index = torch.full((n * longest,), R * T, dtype=torch.long, device=device)
        record_index[rec * longest + pos] = tok
        return cls(
            record_ids=rid,
            num_records=n,
            chunk_size=L,
            token_index=token_index.view(C, L),
            chunk_record=chunk_record,
            pair_left=cstart[pair_record] + q // k.clamp(min=1),
            pair_right=cstart[pair_record] + q % k.clamp(min=1),
            tokens=counts,
            record_index=record_index.view(n, longest),
            token_empty=(token_index == R * T).nonzero().squeeze(1),
            record_empty=(record_index == R * T).nonzero().squeeze(1),
            segments=segments,
        )

    @property
    def num_chunks(self) -> int:
        """``C``."""
        return int(self.chunk_record.numel())

    def gather(self, x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The chunks of ``x``: ``(R, T, F)`` to ``(C, L, F)``, zeros at empty slots.

        Args:
            x: Per-token rows ``(R, T, F)`` (or ``(R, T)``, giving ``(C, L)``).
            dtype: Cast to this dtype first (default: ``x``'s).

        Returns:
            The gathered tensor.

        Raises:
            ValueError: If ``x``'s leading shape is not the layout's ``(R, T)``.
        """
        return self._take(x, self.token_index, dtype, self.token_empty)

    def per_record(self, x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Each record as one sample: ``(R, T, F)`` to ``(N, max T_r, F)``, zero-padded.

        A record's tokens, wherever they lie in the packed rows, become one row, so that the
        per-sample norm and clipped-sum functions of token-wise modules
        (:mod:`opacus_rc.grad_sample.linear`, ``.embedding``, ``.tied``, ...) give per-record
        results unchanged (a zero output-gradient row adds nothing; pad the ids of an
        embedding with its ``padding_idx`` or give them zero gradient rows). The same
        re-layout as ``units=`` packing (:func:`opacus_rc.units.pack_for_units`), along the
        token axis; it costs ``N max T_r`` rows instead of the chunks' ``C L``.

        Args:
            x: Per-token values ``(R, T, ...)``.
            dtype: Cast to this dtype first (default: ``x``'s).

        Returns:
            ``(N, max T_r, ...)``; zeros (``0`` for integer ids) past each record's end.

        Raises:
            ValueError: If ``x``'s leading shape is not the layout's ``(R, T)``.
        """
        return self._take(x, self.record_index, dtype, self.record_empty)

    def _take(
        self,
        x: torch.Tensor,
        index: torch.Tensor,
        dtype: torch.dtype | None,
        empty: torch.Tensor | None,
    ) -> torch.Tensor:
        R, T = self.record_ids.shape
        if tuple(x.shape[:2]) != (R, T):
            raise ValueError(
                f"a tensor of shape {tuple(x.shape)} for packed rows of shape ({R}, {T})"
            )
        rest = x.shape[2:]
        flat = x.reshape(R * T, *rest)
        if empty is None or R * T == 0:
            if dtype is not None:
                flat = flat.to(dtype)
            flat = torch.cat([flat, flat.new_zeros(1, *rest)])
            return flat[index]
        # One copy: the rows (an empty slot reads row 0), cast, then the empty slots zeroed.
        idx = index.reshape(-1).to(flat.device)
        out = flat.index_select(0, idx.clamp(max=R * T - 1))
        if dtype is not None:
            out = out.to(dtype)
        out.index_fill_(0, empty.to(out.device), 0)
        return out.view(*index.shape, *rest)


def _check_linear(
    activations: torch.Tensor, backprops: torch.Tensor, layout: RecordLayout
) -> tuple[int, int]:
    R, T = layout.record_ids.shape
    if (
        activations.dim() != 3
        or backprops.dim() != 3
        or tuple(activations.shape[:2]) != (R, T)
        or tuple(backprops.shape[:2]) != (R, T)
    ):
        raise ValueError(
            f"activations {tuple(activations.shape)} and backprops {tuple(backprops.shape)} must "
            f"be (R, T, d) and (R, T, p) with (R, T) = {(R, T)}, the layout's record_ids"
        )
    return activations.shape[2], backprops.shape[2]


def linear_record_sqnorms(
    activations: torch.Tensor,
    backprops: torch.Tensor,
    *,
    layout: RecordLayout,
    bias: bool = False,
    method: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact per-record squared norms of an ``nn.Linear``'s gradients in packed rows.

    ``||M_r||_F^2 = ||sum_{t in r} g_t a_t^T||_F^2`` and, with ``bias``, ``||sum_{t in r}
    g_t||^2``. ``method="gram"`` sums ``(a_t . a_s)(g_t . g_s)`` over the token pairs of each
    record (pairs of its chunks, ``O(T_r^2 (p + d))``); ``"materialize"`` forms each ``M_r``
    from its chunks (``O(T_r p d)``, ``N p d`` memory); ``"auto"`` takes the one with fewer
    multiplications (``P L^2 (p + d)`` against ``C L p d``).

    Args:
        activations: ``A``, ``(R, T, d)``: the layer's input rows.
        backprops: ``G``, ``(R, T, p)``: the output gradient rows, each the gradient of its
            record's loss (padding rows anything: they are left out).
        layout: The batch's :class:`RecordLayout`.
        bias: Also return the bias's squared norms.
        method: ``"auto"``, ``"gram"`` or ``"materialize"``.

    Returns:
        ``(weight (N,), bias (N,) or None)``, float32 (float64 for float64 inputs).

    Raises:
        ValueError: If the shapes disagree with the layout or ``method`` is unknown.
    """
    d, p = _check_linear(activations, backprops, layout)
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    dtype = _acc_dtype(activations, backprops)
    n, L = layout.num_records, layout.chunk_size
    with autocast_off(backprops.device):
        Ac = layout.gather(activations, dtype=dtype)  # (C, L, d)
        Gc = layout.gather(backprops, dtype=dtype)  # (C, L, p)
        if method == "auto":
            gram = layout.pair_left.numel() * L * L * (p + d)
            mat = layout.num_chunks * L * p * d
            method = "gram" if gram <= mat else "materialize"
        out = torch.zeros(n, dtype=dtype, device=backprops.device)
        if method == "gram":
            left, right = layout.pair_left, layout.pair_right
            aa = torch.bmm(Ac[left], Ac[right].transpose(1, 2))  # (P, L, L)
            gg = torch.bmm(Gc[left], Gc[right].transpose(1, 2))
            weight = out.index_add(0, layout.chunk_record[left], (aa * gg).sum(dim=(1, 2)))
        else:
            M = torch.zeros(n, p, d, dtype=dtype, device=backprops.device)
            M.index_add_(0, layout.chunk_record, torch.bmm(Gc.transpose(1, 2), Ac))
            weight = M.pow(2).sum(dim=(1, 2))
        bias_sq = None
        if bias:
            g_sum = torch.zeros(n, p, dtype=dtype, device=backprops.device)
            g_sum.index_add_(0, layout.chunk_record, Gc.sum(dim=1))
            bias_sq = g_sum.pow(2).sum(dim=1)
    return weight, bias_sq


def linear_record_sketched_sqnorms(
    activations: torch.Tensor,
    backprops: torch.Tensor,
    *,
    layout: RecordLayout,
    sketch_dim: int,
    generator: torch.Generator | None = None,
    probes: torch.Tensor | None = None,
    side: str = "auto",
    method: str = "auto",
) -> torch.Tensor:
    """Hutchinson estimates of each record's ``||sum_{t in r} g_t a_t^T||_F^2`` in packed rows.

    The estimator of :func:`opacus_rc.sketching.hutchinson_sqnorm` on each record's tokens,
    with one fresh probe per record (``N`` samples drawn by
    :func:`~opacus_rc.sketching.draw_gaussian_probes`, the same draw as ``hutchinson_sqnorm``
    on ``N`` samples with the same generator): output side ``n_hat_r = ||sum_c A_c^T (G_c
    Omega_r)||_F^2`` with ``Omega_r`` ``p x k``; input side (``d x k``) the same with ``A`` and
    ``G`` swapped. Unbiased; ``Var n_hat_r = (2/k) ||M_r M_r^T||_F^2``.

    Args:
        activations: ``A``, ``(R, T, d)``.
        backprops: ``G``, ``(R, T, p)``.
        layout: The batch's :class:`RecordLayout`.
        sketch_dim: ``k >= 1``.
        generator: Source of the probes (None: torch's default generator); ignored with
            ``probes``.
        probes: Explicit ``(N, rows, k)`` probes, already scaled (for tests).
        side: ``"output"`` (``p``), ``"input"`` (``d``) or ``"auto"`` (the smaller; with
            ``probes``, the side their rows match, output first), as ``hutchinson_sqnorm``.
        method: ``"chunks"`` (batched products over the layout's chunks, then an
            ``index_add``), ``"segments"`` (two products per run of a record's consecutive
            tokens, on views of the packed rows: no copy and no padded slot; the layout's
            ``segments``, CPU only) or ``"auto"`` (segments where the layout has them). The
            same estimate up to rounding.

    Returns:
        ``(N,)`` estimates, float32 (float64 for float64 inputs).

    Raises:
        TypeError: If ``sketch_dim`` is not an int.
        ValueError: If ``sketch_dim < 1``, a shape disagrees, ``side`` or ``method`` is
            unknown, or ``"segments"`` is asked of a layout without them.
    """
    validate_sketch_dim(sketch_dim)
    d, p = _check_linear(activations, backprops, layout)
    if side not in ("auto", "output", "input"):
        raise ValueError(f"side must be 'auto', 'output' or 'input', got {side!r}")
    if side == "auto":
        if probes is not None:
            side = "output" if probes.shape[-2] == p else "input"
        else:
            side = "output" if p <= d else "input"
    A, G = (activations, backprops) if side == "output" else (backprops, activations)
    rows = G.shape[2]
    n = layout.num_records
    dtype = _acc_dtype(activations, backprops)
    if probes is None:
        omega = draw_gaussian_probes(
            n, rows, sketch_dim, generator=generator, device=G.device, dtype=dtype
        )
    else:
        if probes.dim() != 3 or tuple(probes.shape[:2]) != (n, rows):
            raise ValueError(f"probes must have shape ({n}, {rows}, k), got {tuple(probes.shape)}")
        omega = probes.to(device=G.device, dtype=dtype)
    if method not in ("auto", "chunks", "segments"):
        raise ValueError(f"method must be 'auto', 'chunks' or 'segments', got {method!r}")
    if method == "segments" and layout.segments is None:
        raise ValueError("method='segments' needs a layout built on a CPU (layout.segments)")
    with autocast_off(G.device):
        if method != "chunks" and layout.segments is not None:
            R, T = layout.record_ids.shape
            A2 = A.reshape(R * T, A.shape[2]).to(dtype)
            G2 = G.reshape(R * T, rows).to(dtype)
            V = torch.zeros(n, A2.shape[1], omega.shape[2], dtype=dtype, device=G.device)
            for r, start, end in layout.segments:  # V_r += A_s^T (G_s Omega_r)
                V[r].addmm_(A2[start:end].t(), G2[start:end] @ omega[r])
            return V.pow(2).sum(dim=(1, 2))
        Ac = layout.gather(A, dtype=dtype)
        Gc = layout.gather(G, dtype=dtype)
        U = torch.bmm(Gc, omega[layout.chunk_record])  # (C, L, k)
        Vc = torch.bmm(U.transpose(1, 2), Ac)  # (C, k, d): V^T, A read as stored
        V = torch.zeros(n, *Vc.shape[1:], dtype=dtype, device=G.device)
        V.index_add_(0, layout.chunk_record, Vc)
        return V.pow(2).sum(dim=(1, 2))


def _token_weights(
    record_ids: torch.Tensor, coef: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``coef[record_ids]``, 0 at padding: ``(R, T)``."""
    rid = record_ids.long()
    if coef.dim() != 1 or (rid.numel() and int(rid.max()) >= coef.numel()):
        raise ValueError(
            f"clip factors of shape {tuple(coef.shape)} for record ids up to "
            f"{int(rid.max()) if rid.numel() else -1} (one factor per record expected)"
        )
    w = coef.to(dtype)[rid.clamp(min=0)]
    return torch.where(rid >= 0, w, torch.zeros_like(w))


def linear_record_clipped_sum(
    activations: torch.Tensor,
    backprops: torch.Tensor,
    *,
    record_ids: torch.Tensor,
    coef: torch.Tensor,
    bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The clipped gradient sum ``sum_r c_r sum_{t in r} g_t a_t^T`` of an ``nn.Linear``.

    One pass: each token's output gradient row is weighted by its record's factor (0 at
    padding), then one ``(p x R T) @ (R T x d)`` product, as in the backward pass.

    Args:
        activations: ``A``, ``(R, T, d)``.
        backprops: ``G``, ``(R, T, p)``.
        record_ids: ``(R, T)``, -1 at padding.
        coef: ``(N,)`` clip factors.
        bias: Also return the bias's ``sum_r c_r sum_{t in r} g_t``.

    Returns:
        ``(weight (p, d), bias (p,) or None)`` in at least float32 (float64 for float64
        inputs).

    Raises:
        ValueError: If the shapes disagree.
    """
    if (
        activations.dim() != 3
        or backprops.dim() != 3
        or activations.shape[:2] != backprops.shape[:2]
        or tuple(record_ids.shape) != tuple(activations.shape[:2])
    ):
        raise ValueError(
            f"activations {tuple(activations.shape)}, backprops {tuple(backprops.shape)} and "
            f"record_ids {tuple(record_ids.shape)} must be (R, T, d), (R, T, p) and (R, T)"
        )
    dtype = _acc_dtype(activations, backprops)
    with autocast_off(backprops.device):
        w = _token_weights(record_ids, coef, dtype).unsqueeze(-1)
        Gw = (backprops.to(dtype) * w).reshape(-1, backprops.shape[-1])
        weight = Gw.t() @ activations.to(dtype).reshape(-1, activations.shape[-1])
        return weight, (Gw.sum(dim=0) if bias else None)


def _check_embedding(
    ids: torch.Tensor, backprops: torch.Tensor, record_ids: torch.Tensor
) -> tuple[int, int, int]:
    if (
        ids.dim() != 2
        or ids.is_floating_point()
        or backprops.dim() != 3
        or tuple(backprops.shape[:2]) != tuple(ids.shape)
        or tuple(record_ids.shape) != tuple(ids.shape)
    ):
        raise ValueError(
            f"ids {tuple(ids.shape)}, backprops {tuple(backprops.shape)} and record_ids "
            f"{tuple(record_ids.shape)} must be (R, T) integers, (R, T, d) and (R, T)"
        )
    R, T = ids.shape
    return R, T, backprops.shape[2]


def embedding_record_sqnorms(
    ids: torch.Tensor,
    backprops: torch.Tensor,
    *,
    layout: RecordLayout,
    num_embeddings: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """Exact per-record squared norms of an ``nn.Embedding`` weight's gradient in packed rows.

    ``||grad_W||_F^2 = sum_{v != padding_idx} ||sum_{t in r: x_t = v} g_t||^2``: the valid
    tokens are grouped by ``(record, id)`` (a sort of ``record * V + id``), their gradient rows
    summed per group with ``index_add``, and the groups' squared norms summed per record.
    ``O(R T d)`` plus the sort.

    Args:
        ids: ``(R, T)`` token ids.
        backprops: ``(R, T, d)`` output gradient rows.
        layout: The batch's :class:`RecordLayout` (its ``record_ids`` are used).
        num_embeddings: ``V``.
        padding_idx: The embedding's ``padding_idx`` (non-negative), whose row gets no gradient.

    Returns:
        ``(N,)`` squared norms, float32 (float64 for float64 inputs).

    Raises:
        ValueError: If the shapes disagree.
    """
    rid = layout.record_ids
    R, T, d = _check_embedding(ids, backprops, rid)
    dtype = _acc_dtype(backprops)
    n = layout.num_records
    keep = rid >= 0
    if padding_idx is not None:
        keep &= ids != padding_idx
    tok = keep.reshape(-1).nonzero().squeeze(1)
    key = rid.reshape(-1)[tok] * int(num_embeddings) + ids.reshape(-1)[tok].long()
    with autocast_off(backprops.device):
        rows = backprops.reshape(R * T, d)[tok].to(dtype)
        uniq, group = torch.unique(key, return_inverse=True)
        sums = torch.zeros(uniq.numel(), d, dtype=dtype, device=backprops.device)
        sums.index_add_(0, group, rows)
        out = torch.zeros(n, dtype=dtype, device=backprops.device)
        return out.index_add(0, uniq // int(num_embeddings), sums.pow(2).sum(dim=1))


def embedding_record_clipped_sum(
    ids: torch.Tensor,
    backprops: torch.Tensor,
    *,
    record_ids: torch.Tensor,
    coef: torch.Tensor,
    num_embeddings: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """The clipped gradient sum ``sum_r c_r grad_W loss_r`` of an ``nn.Embedding``.

    One ``index_add`` of the rows ``c_{r(t)} g_t`` at rows ``x_t`` of a ``(V, d)`` zero tensor,
    padding tokens (record -1) and ``padding_idx`` skipped.

    Args:
        ids: ``(R, T)`` token ids.
        backprops: ``(R, T, d)``.
        record_ids: ``(R, T)``, -1 at padding.
        coef: ``(N,)`` clip factors.
        num_embeddings: ``V``.
        padding_idx: The embedding's ``padding_idx`` (non-negative), or None.

    Returns:
        ``(V, d)`` in float32 (float64 for float64 inputs).

    Raises:
        ValueError: If the shapes disagree.
    """
    R, T, d = _check_embedding(ids, backprops, record_ids)
    dtype = _acc_dtype(backprops)
    with autocast_off(backprops.device):
        w = _token_weights(record_ids, coef, dtype)
        if padding_idx is not None:
            w = torch.where(ids == padding_idx, torch.zeros_like(w), w)
        rows = (backprops.to(dtype) * w.unsqueeze(-1)).reshape(R * T, d)
        out = torch.zeros(int(num_embeddings), d, dtype=dtype, device=backprops.device)
        return out.index_add(0, ids.reshape(-1).long(), rows)


def tied_record_sketched_sqnorms(
    head_activations: torch.Tensor,
    head_backprops: torch.Tensor,
    ids: torch.Tensor,
    embedding_backprops: torch.Tensor,
    *,
    layout: RecordLayout,
    sketch_dim: int,
    generator: torch.Generator | None = None,
    probes: torch.Tensor | None = None,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """Joint Hutchinson estimates of each record's tied-weight gradient norm in packed rows.

    For a weight ``W`` (``V x d``) shared by an LM head (input rows ``a_t``, output gradient
    rows ``G_t``, ``V``) and an input embedding (ids ``x_t``, output gradient rows ``g_t``,
    ``d``), record ``r``'s gradient is ``M_r = sum_{t in r} G_t a_t^T + sum_{t in r, x_t != P}
    e_{x_t} g_t^T``, and its estimate is ``||M_r Omega_r||_F^2`` with one fresh probe
    ``Omega_r`` (``d x k``, entries ``N(0, 1/k)``, ``N`` samples drawn by
    :func:`~opacus_rc.sketching.draw_gaussian_probes` as
    :func:`~opacus_rc.grad_sample.tied.tied_hutchinson_sqnorm` draws ``B``):
    ``Y_r = sum_c G_c^T (A_c Omega_r)`` plus the ``index_add`` of the rows ``g_t Omega_r`` at
    rows ``x_t`` of ``Y_r``. Unbiased, with the law of a Hutchinson sketch of ``M_r``.
    ``O(T_r k (V + d))`` per record and ``N V k`` floats for ``Y``.

    Args:
        head_activations: ``(R, T, d)``.
        head_backprops: ``(R, T, V)``.
        ids: ``(R, T)`` embedding ids.
        embedding_backprops: ``(R, T, d)``.
        layout: The batch's :class:`RecordLayout` (the same tokens feed both modules).
        sketch_dim: ``k >= 1``.
        generator: Source of the probes (ignored with ``probes``).
        probes: Explicit ``(N, d, k)`` probes (for tests).
        padding_idx: The embedding's ``padding_idx`` (non-negative), or None.

    Returns:
        ``(N,)`` estimates, float32 (float64 for float64 inputs).

    Raises:
        TypeError: If ``sketch_dim`` is not an int.
        ValueError: If ``sketch_dim < 1`` or a shape disagrees.
    """
    validate_sketch_dim(sketch_dim)
    d, V = _check_linear(head_activations, head_backprops, layout)
    _check_embedding(ids, embedding_backprops, layout.record_ids)
    if embedding_backprops.shape[2] != d:
        raise ValueError(
            f"embedding gradient rows of width {embedding_backprops.shape[2]} for a head "
            f"input of width {d}: a tied weight has one d"
        )
    n = layout.num_records
    dtype = _acc_dtype(head_activations, head_backprops, embedding_backprops)
    device = head_backprops.device
    if probes is None:
        omega = draw_gaussian_probes(
            n, d, sketch_dim, generator=generator, device=device, dtype=dtype
        )
    elif probes.shape != (n, d, sketch_dim):
        raise ValueError(f"probes must have shape ({n}, {d}, {sketch_dim}), got {probes.shape}")
    else:
        omega = probes.to(device=device, dtype=dtype)
    with autocast_off(device):
        per_chunk = omega[layout.chunk_record]  # (C, d, k)
        U = torch.bmm(layout.gather(head_activations, dtype=dtype), per_chunk)  # (C, L, k)
        Yc = torch.bmm(layout.gather(head_backprops, dtype=dtype).transpose(1, 2), U)
        Y = torch.zeros(n, V, sketch_dim, dtype=dtype, device=device)
        Y.index_add_(0, layout.chunk_record, Yc)
        g = embedding_backprops.to(dtype)
        if padding_idx is not None:
            g = g.masked_fill((ids == padding_idx).unsqueeze(-1), 0)
        rows = torch.bmm(layout.gather(g), per_chunk)  # (C, L, k), zero at empty slots
        where = layout.chunk_record.unsqueeze(1) * V + layout.gather(ids.long())  # (C, L)
        Y.view(n * V, sketch_dim).index_add_(0, where.reshape(-1), rows.reshape(-1, sketch_dim))
        return Y.pow(2).sum(dim=(1, 2))
