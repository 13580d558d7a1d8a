"""The criterion's ``record_ids=``: per-record clipping inside packed rows
(docs/packing.md#packing-step).

A packed batch holds ``R`` rows of ``T`` tokens and ``N`` records (several records per row, a
record longer than a row cut across rows; :func:`opacus_rc.packing.pack_records`). With
``record_ids=`` (``(R, T)``, the record ``0..N-1`` of each token, -1 at padding; or restarting
``position_ids=``) the DP criterion returned by ``make_private``
(:class:`~opacus_rc.optimizers.DPLossRandomizedClipping`) computes

* the per-record losses (:func:`packed_record_losses`): each record's mean (``"mean"``) or sum
  (``"sum"``) over its counted per-token losses, wherever its tokens lie: what the criterion
  gives the record alone, unpadded, with ``shape=``;
* optionally grouped into units (``units=``, ``(N,)``: several records of one user clipped
  together, each unit's loss the sum of its records');
* the step's layout (:class:`PackedRecordLayout`, built once per batch), which the backward
  hooks use exactly as they use a ``units=`` layout (:func:`opacus_rc.units.pack_for_units`):
  every hooked layer's input and output gradient is re-laid from ``(R, T, ...)`` to
  ``(N, max T_r, ...)``, one row per record (or unit) holding its tokens in order, zeros
  after its end, and the layer's usual norm path (sketched or exact ``nn.Linear``, embeddings,
  the joint sketch of a tied embedding and LM head, biases, layer and RMS norms, LoRA factors)
  runs on ``N`` samples. For a token-wise module a record's gradient is a sum over its tokens,
  and a zero output-gradient row adds nothing, so the norms, the clip factors and the
  book-keeping clipped sum are per record; one backward pass with book-keeping, the second
  pass of ``sum_r c_r loss_r`` without. Three kinds of module skip the re-layout (outside
  an activation-checkpointed step and FSDP2; :meth:`PackedRecordLayout.record_norms`), their
  cost linear in the packed tokens whatever the longest record: an ``nn.Linear`` on the
  sketched route (Hutchinson), its per-record sketch from the packed rows (in chunks, or on a
  CPU per run of a record's consecutive tokens) and its clipped sum from ``R T`` token rows
  weighted by their record's factor; a weight tied between the input embedding and the LM
  head, its joint sketch per record from the packed rows (one probe per record shared by both
  parts) and both modules' clipped sums from token rows; and the norm layers
  (``nn.LayerNorm``, ``nn.RMSNorm``, the ``transformers`` RMSNorms), their exact per-record
  gradients by one ``index_add`` over the token-to-record map.

The optimizer clips ``N`` (or ``U``) records; its divisor (the public expected batch size,
counted in records or units) and the accounting are unchanged. A module that is not
token-wise is refused (:func:`~opacus_rc.units.check_unit_routes`).

**Attention inside records** (:class:`PackedAttentionGuard`, attached by ``make_private``):
at every criterion call with ``record_ids=`` the 4D ``attention_mask`` of the forward that
produced the logits, if any, is checked (a real token allowed to attend another record's token
or padding is refused, :class:`~opacus_rc.batch_independence.BatchIndependenceError`), and at
the first packed batch (with ``check_batch_independence=True``) each of a few record segments'
logits alone must equal its logits inside the pack
(:func:`~opacus_rc.packing.check_records_independent`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from opacus_rc._compat.opacus import wrapped_module
from opacus_rc.batch_independence import BatchIndependenceError  # noqa: F401  (raised)
from opacus_rc.grad_sample.packed import RecordLayout
from opacus_rc.packed_attention import PACKED_SDPA, segment_starts
from opacus_rc.packing import (
    check_mask_structure,
    check_records_independent,
    record_ids_from_position_ids,
)
from opacus_rc.units.layout import check_unit_routes
from opacus_rc.units.split import _check_split

__all__ = [
    "VARLEN_ATTENTION",
    "PackedAttentionGuard",
    "check_varlen_segments",
    "PackedRecordLayout",
    "packed_record_losses",
    "record_losses_for_loss",
]

#: Segments the first packed batch's logits check runs alone (those not at the start of their
#: row first: the ones that could see another record).
CHECKED_SEGMENTS = 4


class PackedRecordLayout:
    """The step's layout of a packed batch: each record (or unit) one sample.

    The interface of :class:`~opacus_rc.units.UnitLayout` that the backward hooks use
    (:func:`~opacus_rc.units.pack_for_units`): ``batch_size`` (the rows ``R``), ``num_units``
    (``N`` records, or ``U`` units), ``split`` (None: a record is never cut across physical
    batches), :meth:`pack` and :meth:`same_as`.

    Args:
        record_ids: ``(R, T)`` integer tensor, the sample (record or unit) ``0..N-1`` of each
            token, -1 at padding.
        num_records: ``N``.

    Attributes:
        records: The :class:`~opacus_rc.grad_sample.packed.RecordLayout` (built once per batch).
        record_ids: The ``(R, T)`` long tensor.
        batch_size: ``R``.
        num_units: ``N``.
        split: None.

    Raises:
        ValueError: As :meth:`RecordLayout.from_record_ids`.
    """

    #: Marks the layout for the step's two packed-row branches (norms, clipped sums).
    packed_rows = True

    def __init__(self, record_ids: torch.Tensor, *, num_records: int) -> None:
        self.records = RecordLayout.from_record_ids(record_ids, num_records=num_records)
        self.record_ids = self.records.record_ids
        self.batch_size = int(self.record_ids.shape[0])
        self.num_units = int(num_records)
        self.split = None
        self.buffered: list[int] = []
        #: ids of the modules whose book-keeping stash holds token rows (the fast path).
        self._token_rows: set[int] = set()
        #: Tensors re-laid per record by :meth:`pack` (``(N, max T_r, ...)``) in this step:
        #: 0 when every hooked module took a packed-row path.
        self.relaid = 0

    def record_norms(
        self,
        step: Any,
        module: nn.Module,
        route: Any,
        params: tuple[nn.Parameter, ...],
        activations: list[Any],
        backprops: torch.Tensor,
        loss_reduction: str,
    ) -> bool:
        """Per-record norms straight from the packed rows, where the module allows it.

        A tied embedding or LM head (:meth:`_tied_norms`) and a norm layer
        (:meth:`_norm_layer_norms`) have their own branches; the rest of this docstring is
        the ``nn.Linear`` branch: the sketched per-record norms of an ``nn.Linear``.

        The chunked estimator
        :func:`~opacus_rc.grad_sample.packed.linear_record_sketched_sqnorms` (one fresh probe
        per record from the step's sketch generator, the same draw as the per-sample sampler
        on ``N`` samples; ``O(T_r k (p + d))`` per record, no row padded to
        the longest record) and the bias's exact norm (each record's summed output gradient);
        with book-keeping the layer keeps its input and output gradient as ``R T`` token rows,
        clipped by their record's factor (:meth:`write_clipped_sums`): one ``(p x R T) @ (R T
        x d)`` product, as in the backward pass.

        Taken for a trainable ``nn.Linear`` on the sketched route with the Hutchinson
        estimator, 3-D ``(R, T, d)`` input, outside an activation-checkpointed step and
        FSDP2; anything else returns False and goes through :meth:`pack` and the module's
        usual norm path.

        Returns:
            Whether the norms were recorded here.
        """
        from opacus_rc._compat.opacus import count_down_use
        from opacus_rc.grad_sample.bookkeeping import BookkeepingStash
        from opacus_rc.grad_sample.packed import linear_record_sketched_sqnorms
        from opacus_rc.grad_sample.routing import NormPath
        from opacus_rc.sketching import hutchinson_sqnorm

        R, T = self.record_ids.shape
        A = activations[0] if len(activations) == 1 else None
        if route.path is NormPath.TIED:
            return self._tied_norms(step, module, params, A, backprops, loss_reduction)
        if route.path in (NormPath.EXACT, NormPath.GRAD_SAMPLER) and _is_norm_layer(module):
            return self._norm_layer_norms(step, module, params, A, backprops, loss_reduction)
        if not (
            type(module) is nn.Linear
            and route.path is NormPath.SKETCHED
            and step.estimator is hutchinson_sqnorm
            and type(step).__name__ == "PrivateStep"  # not FSDP2's reduce-scattered sums
            and not step.smaller_stash
            and module.weight.requires_grad
            and isinstance(A, torch.Tensor)
            and A.dim() == 3
            and tuple(A.shape[:2]) == (R, T)
            and backprops.dim() == 3
            and tuple(backprops.shape[:2]) == (R, T)
        ):
            return False
        n = self.num_units
        G = backprops
        # As pack_for_units: to the per-record losses' gradient, G times this scale; folded
        # into the norms and the stash's clip factors (both linear in G), not copied into G.
        scale = self._scale(module, loss_reduction)
        dtype = torch.float64 if torch.float64 in (A.dtype, G.dtype) else torch.float32
        sq = linear_record_sketched_sqnorms(
            A,
            G,
            layout=self.records,
            sketch_dim=step.config.sketch_dim,
            generator=step.generator_for(G.device),
        )
        norms = {module.weight: sq.clamp(min=0).sqrt().to(dtype)}
        if module.bias is not None and module.bias.requires_grad:
            where = self.record_ids.to(G.device).reshape(-1)
            keep = (where >= 0).unsqueeze(1)
            rows = G.reshape(R * T, -1).to(dtype).masked_fill(~keep, 0)
            g_sum = rows.new_zeros(n, rows.shape[1]).index_add(0, where.clamp(min=0), rows)
            norms[module.bias] = torch.linalg.vector_norm(g_sum.double(), dim=1).to(dtype)
        if scale != 1:
            norms = {p: v * scale for p, v in norms.items()}
        for p in params:
            count_down_use(p)
        step.record_norms(norms)
        if step.bookkeeping:
            d, p_out = A.shape[2], G.shape[2]
            step.stash(
                BookkeepingStash(
                    module,
                    params,
                    activations=[A.reshape(R * T, 1, d)],
                    backprops=G.reshape(R * T, 1, p_out),
                    scale=scale,
                )
            )
            self._token_rows.add(id(module))
        if not getattr(module, "activations", None):  # its last use (the hook returns here)
            del module.max_batch_len
        return True

    def _packed_rows(self, step: Any, x: Any, backprops: torch.Tensor, *, ids: bool) -> bool:
        """Whether a module's input ``x`` and output gradient are ``(R, T, ...)`` token rows
        in a plain (not checkpointed, not FSDP2) step: the packed-row paths' condition."""
        R, T = self.record_ids.shape
        return (
            type(step).__name__ == "PrivateStep"  # not FSDP2's reduce-scattered sums
            and not step.smaller_stash
            and isinstance(x, torch.Tensor)
            and x.dim() == (2 if ids else 3)
            and tuple(x.shape[:2]) == (R, T)
            and backprops.dim() == 3
            and tuple(backprops.shape[:2]) == (R, T)
        )

    def _scale(self, module: nn.Module, loss_reduction: str) -> float:
        """The factor from Opacus' output gradient to the per-record losses' (``N /
        max_batch_len`` under ``"mean"``, as :func:`~opacus_rc.units.pack_for_units`); the
        module's ``max_batch_len`` becomes ``N``."""
        n = self.num_units
        scale = 1
        if loss_reduction == "mean":
            scale = n / getattr(module, "max_batch_len", self.batch_size)
        module.max_batch_len = n
        return scale

    def _tied_norms(
        self,
        step: Any,
        module: nn.Module,
        params: tuple[nn.Parameter, ...],
        x: Any,
        backprops: torch.Tensor,
        loss_reduction: str,
    ) -> bool:
        """A tied embedding or LM head (the joint sketch,
        :class:`~opacus_rc.grad_sample.tied.TiedSketches`) straight from the packed rows:
        each part summed per record (chunk by chunk, or on a CPU run by run of the record's
        consecutive tokens), one probe per record shared by both parts
        (the same draw as on ``N`` re-laid samples), ``O(tokens)``. With book-keeping the
        module keeps its ``R T`` token rows, clipped by their record's factor."""
        from opacus_rc._compat.opacus import count_down_use
        from opacus_rc.grad_sample.bookkeeping import BookkeepingStash

        group = step.tied.group_of(module)
        if group is None or not self._packed_rows(
            step, x, backprops, ids=module is group.embedding
        ):
            return False
        G = backprops  # times scale: folded into the norms and the stash's clip factors
        scale = self._scale(module, loss_reduction)
        norms, deferred = step.tied.sample(
            module,
            [x],
            G,
            sketch_dim=step.config.sketch_dim,
            generator=step.generator_for(G.device),
            layout=self.records,
            scale=scale,
        )
        have = {id(p) for p in norms}
        missing = [p for p in params if id(p) not in have and id(p) not in deferred]
        if missing:  # the tied sketch covers the shared weight and the head's bias only
            step.tied.clear()
            raise RuntimeError(
                f"record_ids=: the tied module '{step.name_of(module)}' has "
                f"{len(missing)} trainable parameter(s) its joint sketch gives no norm for"
            )
        for p in params:
            count_down_use(p)
        step.record_norms(norms)
        if step.bookkeeping and params:
            R, T = self.record_ids.shape
            rows = x.reshape(R * T, 1) if x.dim() == 2 else x.reshape(R * T, 1, x.shape[2])
            step.stash(
                BookkeepingStash(
                    module,
                    params,
                    activations=[rows],
                    backprops=G.reshape(R * T, 1, G.shape[2]),
                    scale=scale,
                )
            )
            self._token_rows.add(id(module))
        if not getattr(module, "activations", None):
            del module.max_batch_len
        return True

    def _norm_layer_norms(
        self,
        step: Any,
        module: nn.Module,
        params: tuple[nn.Parameter, ...],
        x: Any,
        backprops: torch.Tensor,
        loss_reduction: str,
    ) -> bool:
        """A LayerNorm / RMSNorm straight from the packed rows: its exact per-record
        gradients (:func:`~opacus_rc.grad_sample.norm_layers.norm_layer_record_grads`, one
        ``index_add`` over the token-to-record map, ``O(tokens)``), recorded as the
        per-sample-gradient paths do
        (:meth:`~opacus_rc.grad_sample.norms.ModuleNorms.record_grad_samples`; with
        book-keeping the ``(N, D)`` gradients are the clipped sum's stash)."""
        from opacus_rc.grad_sample.norm_layers import norm_layer_record_grads

        if not params or not self._packed_rows(step, x, backprops, ids=False):
            return False
        if tuple(x.shape) != tuple(backprops.shape) or x.shape[2:] != params[0].shape[-1:]:
            return False
        scale = self._scale(module, loss_reduction)  # on the (N, D) gradients, not on G
        grads = norm_layer_record_grads(
            module, x, backprops, record_ids=self.record_ids, num_records=self.num_units
        )
        keep = {id(p) for p in params}
        grads = {p: g if scale == 1 else g * scale for p, g in grads.items() if id(p) in keep}
        step.norms.record_grad_samples(
            module, params, grads, step=step, bookkeeping=step.bookkeeping
        )
        if not getattr(module, "activations", None):
            del module.max_batch_len
        return True

    def write_clipped_sums(
        self, ready: list[Any], coef: torch.Tensor, *, clipped_sums: Any, name_of: Any
    ) -> None:
        """``p.grad += sum_r c_r grad_p loss_r``: the stashes of :meth:`record_norms` hold
        token rows, clipped by ``coef[record_ids]`` (0 at padding); the others (re-laid per
        record by :meth:`pack`) by ``coef``.

        Args:
            ready: The step's stashes.
            coef: ``(N,)`` clip factors.
            clipped_sums: Module type -> clipped-sum function.
            name_of: Qualified names, for errors.
        """
        from opacus_rc.grad_sample.bookkeeping import write_clipped_sums

        tokens = [s for s in ready if id(s.module) in self._token_rows]
        others = [s for s in ready if id(s.module) not in self._token_rows]
        if others:
            write_clipped_sums(others, coef, clipped_sums=clipped_sums, name_of=name_of)
        if tokens:
            rid = self.record_ids.to(coef.device).reshape(-1)
            per_token = torch.where(rid >= 0, coef[rid.clamp(min=0)], coef.new_zeros(()))
            write_clipped_sums(tokens, per_token, clipped_sums=clipped_sums, name_of=name_of)

    def same_as(self, other: Any) -> bool:
        """Whether ``other`` is a packed layout of the same tokens and records."""
        return (
            isinstance(other, PackedRecordLayout)
            and other.num_units == self.num_units
            and other.record_ids.shape == self.record_ids.shape
            and bool(torch.equal(other.record_ids.cpu(), self.record_ids.cpu()))
        )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(R, T, ...) -> (N, max T_r, ...)``: each record's tokens in order, zeros after.

        Raises:
            ValueError: If ``x`` is not ``(R, T, ...)``: the module's input is not per token
                (it is not token-wise), and per-record norms cannot be taken from it.
        """
        R, T = self.record_ids.shape
        if x.dim() < 2 or tuple(x.shape[:2]) != (R, T):
            raise ValueError(
                f"record_ids=: a hooked module's input or output gradient has shape "
                f"{tuple(x.shape)}, not the packed rows' (R, T) = ({R}, {T}) first: "
                "per-record clipping inside packed rows needs every trainable module to act on "
                "each token of the (R, T) batch (pass record_ids of the model's input_ids "
                "shape, batch first)"
            )
        self.relaid += 1
        return self.records.per_record(x)


def _is_norm_layer(module: nn.Module) -> bool:
    """A normalisation layer with the closed forms of
    :mod:`opacus_rc.grad_sample.norm_layers` (``nn.LayerNorm``, ``nn.RMSNorm``, the registered
    ``transformers`` RMSNorms), by exact type."""
    from opacus_rc.grad_sample.norm_layers import norm_layer_per_sample_grads
    from opacus_rc.grad_sample.norms import STASH_GRAD_SAMPLERS

    t = type(module)
    return (
        t in (nn.LayerNorm, nn.RMSNorm) or STASH_GRAD_SAMPLERS.get(t) is norm_layer_per_sample_grads
    )


def _integer_tensor(value: Any, name: str, dims: int) -> torch.Tensor:
    if (
        not isinstance(value, torch.Tensor)
        or value.dim() != dims
        or value.is_floating_point()
        or value.is_complex()
        or value.dtype == torch.bool
    ):
        shape = getattr(value, "shape", None)
        raise TypeError(
            f"{name} must be an integer torch.Tensor with {dims} dimension(s), got "
            f"{type(value).__name__} of shape {None if shape is None else tuple(shape)}"
        )
    return value.long()


def _numbered(ids: torch.Tensor, what: str, members: str) -> int:
    """``max + 1`` of ``ids >= 0`` after checking they number ``0..n-1`` without gaps."""
    valid = ids[ids >= 0]
    if bool((ids < -1).any()) if what == "record_ids" else bool((ids < 0).any()):
        low = -1 if what == "record_ids" else 0
        raise ValueError(f"{what} must be >= {low}, got a minimum of {int(ids.min())}")
    if valid.numel() == 0:
        return 0
    n = int(valid.max()) + 1  # one host synchronisation per batch
    counts = torch.bincount(valid, minlength=n)
    if bool((counts == 0).any()):
        missing = torch.nonzero(counts == 0).flatten()[:5].tolist()
        raise ValueError(
            f"{what} must number the {members} of the batch 0..{n - 1} without gaps; "
            f"{missing} have no entry. Relabel them, e.g. with "
            "torch.unique(ids, return_inverse=True)[1]"
        )
    return n


def packed_record_losses(
    token_losses: torch.Tensor,
    *,
    record_ids: torch.Tensor,
    counted: torch.Tensor,
    num_records: int,
    reduction: str,
) -> torch.Tensor:
    """Per-record losses from per-token losses (differentiable).

    Args:
        token_losses: ``(R, T')`` per-token losses.
        record_ids: ``(R, T')`` record of each loss position (-1: none).
        counted: ``(R, T')`` bool, the positions whose loss counts (target not ignored, a
            record).
        num_records: ``N``.
        reduction: ``"mean"`` (each record's mean over its counted positions, 0 for a record
            with none: what Opacus' criterion gives one unpacked sequence with ``shape=``) or
            ``"sum"``.

    Returns:
        ``(N,)`` losses in ``token_losses``' dtype.

    Raises:
        ValueError: If ``reduction`` is neither ``"mean"`` nor ``"sum"``.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    where = torch.where(counted, record_ids, torch.zeros_like(record_ids)).reshape(-1)
    values = torch.where(counted, token_losses, torch.zeros_like(token_losses)).reshape(-1)
    out = token_losses.new_zeros(num_records).index_add(0, where, values)
    if reduction == "mean":
        counts = token_losses.new_zeros(num_records).index_add(
            0, where, counted.reshape(-1).to(token_losses.dtype)
        )
        out = out / counts.clamp(min=1)
    return out


def record_losses_for_loss(
    module: Any,
    token_losses: torch.Tensor,
    targets: Any,
    *,
    shape: Any,
    record_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    units: torch.Tensor | None,
    ignore_index: int | None,
    reduction: str,
) -> torch.Tensor:
    """The criterion's ``record_ids=`` (module docstring): per-record (or per-unit) losses,
    the step's :class:`PackedRecordLayout` recorded, the packed batch's attention checked.

    Called by :class:`~opacus_rc.optimizers.DPLossRandomizedClipping` with the per-token
    losses of ``criterion(logits.reshape(-1, V), targets.reshape(-1), shape=(R, T'),
    record_ids=...)``.

    **Which record a loss belongs to.** The loss at position ``t`` is computed from the model's
    output at token ``t``, so it belongs to token ``t``'s record: ``record_ids[:, t]``. Targets
    may be aligned with the tokens (``T' = T``: already shifted) or shifted here (``T' = T -
    1``: logits ``[:, :-1]`` against labels ``[:, 1:]``, the causal LM loss); then a counted
    target must lie in the same record as the token predicting it (``record_ids[:, t + 1] ==
    record_ids[:, t]``), else it is refused: its gradient would flow through one record and
    depend on another. Targets at padding (record -1) count in no loss.

    Args:
        module: The randomized-clipping grad-sample module (or hooks object).
        token_losses: ``(R T',)`` per-token losses (reduction ``"none"``).
        targets: The criterion's targets (``(R T',)`` or ``(R, T')``), for ``ignore_index``.
        shape: The criterion's ``shape=``, ``(R, T', ...)``.
        record_ids: ``(R, T)`` long, the record ``0..N-1`` of each token, -1 at padding (the
            tokens of the model's input, ``T = T'`` or ``T' + 1``), or None.
        position_ids: ``(R, T)`` restarting position ids instead of ``record_ids`` (TRL's
            padding-free batches: a record starts at each 0;
            :func:`~opacus_rc.packing.record_ids_from_position_ids`), or None.
        units: Optional ``(N,)`` unit ``0..U-1`` of each record: clip per unit.
        ignore_index: The criterion's ``ignore_index`` (None: every position counts).
        reduction: ``"mean"`` or ``"sum"`` (the loss's reduction per record).

    Returns:
        ``(N,)`` per-record losses, or ``(U,)`` per-unit losses (sums of their records').

    Raises:
        TypeError: ``record_ids`` and ``position_ids`` both given, a non-integer map, or a
            module that is not the randomized-clipping module.
        ValueError: ``shape=`` missing, shapes that do not match, records or units not numbered
            ``0..N-1`` without gaps, a counted target predicted across records, ``units=`` not
            matching the loader's batch (:meth:`~opacus_rc.units.UnitBatchRecord.check`), an
            open cut unit, ``batch_first=False``, or a step whose other criterion calls
            disagree.
        NotImplementedError: A trainable module that is not token-wise.
        BatchIndependenceError: The packed batch's attention crosses records
            (:class:`PackedAttentionGuard`).
    """
    if record_ids is not None and position_ids is not None:
        raise TypeError("pass record_ids= or position_ids= to the criterion, not both")
    step = getattr(module, "private_step", None)
    if step is None:
        raise TypeError(
            "record_ids= needs the randomized-clipping module "
            "(make_private(..., clipping='randomized'))"
        )
    if shape is None or len(shape) < 2:
        raise ValueError(
            "record_ids= needs a per-token loss: criterion(logits.reshape(-1, V), "
            "targets.reshape(-1), shape=(R, T'), record_ids=record_ids)"
        )
    R, Tl = int(shape[0]), int(shape[1])
    if record_ids is None:
        rid = record_ids_from_position_ids(_integer_tensor(position_ids, "position_ids", 2))
    else:
        rid = _integer_tensor(record_ids, "record_ids", 2)
    rid = rid.to(token_losses.device)
    if rid.shape[0] != R or rid.shape[1] not in (Tl, Tl + 1):
        raise ValueError(
            f"record_ids of shape {tuple(rid.shape)} for per-token losses of shape ({R}, {Tl}): "
            "record_ids must be (R, T) over the model's tokens, with the losses over the same T "
            "positions (targets already shifted) or T - 1 (logits[:, :-1] against labels[:, 1:])"
        )
    if token_losses.numel() != R * Tl:
        raise ValueError(
            f"{token_losses.numel()} per-token losses for shape=({R}, {Tl}): flatten the "
            "logits and targets (criterion(logits.reshape(-1, V), targets.reshape(-1), ...))"
        )
    if not module.clipping_config.batch_first:
        raise ValueError("record_ids= needs batch_first=True")
    model = wrapped_module(module)
    try:
        check_unit_routes(model)
    except NotImplementedError as err:
        raise NotImplementedError(
            "record_ids= (per-record clipping inside packed rows) needs every trainable module "
            "to act on each token alone, so that a record's gradient is the sum over its own "
            f"tokens; {err}"
        ) from None
    num_records = _numbered(rid, "record_ids", "records")
    layout_ids, n = rid, num_records
    if units is not None:
        units = _integer_tensor(units, "units", 1).to(rid.device)
        if units.numel() != num_records:
            raise ValueError(
                f"units has {units.numel()} entries for {num_records} records: pass one unit "
                "per record (records numbered by record_ids)"
            )
        n = _numbered(units, "units", "units")
        layout_ids = torch.where(rid >= 0, units[rid.clamp(min=0)], rid)
    record = getattr(module, "unit_batch_record", None)
    if record is not None:
        record.check(units, None)
    _check_split(step, None)  # no unit of an earlier physical batch is left open

    # The record of each loss position: the token computing it.
    tok = token_losses.reshape(R, Tl)
    rec = rid[:, :Tl]
    counted = rec >= 0
    if ignore_index is not None and isinstance(targets, torch.Tensor):
        counted = counted & (targets.reshape(R, Tl).to(rid.device) != ignore_index)
    if Tl + 1 == rid.shape[1]:
        across = counted & (rid[:, 1:] != rec)
        if bool(across.any()):
            row, t = (int(v) for v in across.nonzero()[0])
            raise ValueError(
                f"{int(across.sum())} counted target(s) are predicted across a record "
                f"boundary (the first: row {row}, token {t} of record {int(rec[row, t])} "
                f"predicts a token of record {int(rid[row, t + 1])}): its gradient would flow "
                "through one record and depend on another. Set the label of each record "
                "segment's first token to ignore_index (opacus_rc.packing.pack_records does)"
            )
    losses = packed_record_losses(
        tok, record_ids=rec, counted=counted, num_records=num_records, reduction=reduction
    )
    if units is not None:
        losses = losses.new_zeros(n).index_add(0, units, losses)
    guard = getattr(module, "packed_attention_guard", None)
    if guard is not None:
        guard.check(rid)
    step.set_units(PackedRecordLayout(layout_ids, num_records=n))
    return losses


class PackedAttentionGuard:
    """Checks that a packed batch's attention stays inside records (a forward pre-hook).

    ``make_private`` attaches one to the model. At each training forward (hooks enabled,
    gradients on) it keeps a reference to the keyword inputs until the DP criterion is called
    with ``record_ids=``, which calls :meth:`check`:

    * every batch: a 4D ``attention_mask`` that lets a real token attend another record's token
      or padding is refused (:func:`~opacus_rc.packing.check_mask_structure`; ``O(R T^2)``
      comparisons, no forward); without a 4D mask, a varlen attention (the registered
      :data:`~opacus_rc.packed_attention.PACKED_SDPA`, ``flash_attention_2/3/4``)
      whose records (from ``cu_seq_lens_q`` or ``position_ids``) are not the packed records is
      refused (:func:`~opacus_rc.packed_loss.check_varlen_segments`, ``O(R T)``);
    * every batch: a boolean 4D mask under the ``eager`` attention is refused (eager adds the
      mask to the scores: a boolean mask masks nothing);
    * the first packed batch with a record after another in its row (with ``full_check``), and
      again after the attention implementation changes:
      :func:`~opacus_rc.packing.check_records_independent` on :data:`CHECKED_SEGMENTS` record
      segments, their logits alone against inside the pack (one forward of the batch and one
      per segment, under :func:`~opacus_rc.batch_independence.independence_forward`). A batch
      whose rows each hold one record checks nothing a pack can get wrong, so the check stays
      due. Under FSDP it does not run (its forwards would gather shards on one rank only), and
      says so.

    Args:
        model: The model the user calls (pre-hook target).
        hooks: The grad-sample module or hooks object.
        full_check: Run the logits check at the first packed batch
            (``check_batch_independence``).
    """

    def __init__(self, model: nn.Module, *, hooks: Any, full_check: bool) -> None:
        self.model = model
        self.hooks = hooks
        self.full_check = bool(full_check)
        #: Whether the logits check ran on a record after another in its row, or was given up.
        self.full_checked = False
        #: The attention implementation the logits check ran under (a change re-runs it).
        self._checked_attention: str | None = None
        self._kwargs: dict[str, Any] | None = None
        self.handle = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def remove(self) -> None:
        """Detach the pre-hook."""
        self.handle.remove()

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.hooks is not None and not getattr(self.hooks, "hooks_enabled", True):
            return
        self._kwargs = dict(kwargs) if not args else None

    def check(self, record_ids: torch.Tensor) -> None:
        """Check the last training forward's inputs against ``record_ids`` (class docstring).

        Args:
            record_ids: ``(R, T)`` record of each token, -1 at padding.

        Raises:
            BatchIndependenceError: Attention across records (the mask, or the logits).
        """
        kwargs, self._kwargs = self._kwargs, None
        if kwargs is None:
            return
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.is_meta:
            return  # the meta device (FLOPs and memory counted): no values, nothing released
        impl = _attn_implementation(self.model)
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            if mask.dtype == torch.bool and impl == "eager":
                raise BatchIndependenceError(
                    "a boolean 4D attention_mask under the eager attention: eager adds the mask "
                    "to the attention scores, so a boolean mask masks nothing and every record "
                    "attends the others; pass the mask in the model's dtype (0 where attended, "
                    "the dtype's minimum elsewhere: PackingCollator(mask_dtype=model.dtype)) or "
                    "use attn_implementation='sdpa'"
                )
            check_mask_structure(mask, record_ids)
        else:
            check_varlen_segments(self.model, kwargs, record_ids)
        if self.full_checked and impl != self._checked_attention:
            self.full_checked = False  # another attention: its records are checked anew
        if self.full_checked or not self.full_check:
            return
        self._checked_attention = impl
        if _is_fsdp(self.model):
            self.full_checked = True
            warnings.warn(
                "the packed-attention logits check does not run under FSDP (its forwards would "
                "gather sharded parameters on one rank only): make sure each record's attention "
                "stays inside it (a 4D attention_mask is still checked at every batch)",
                UserWarning,
                stacklevel=3,
            )
            return
        ids = kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.is_meta:
            self.full_checked = True
            return
        result = check_records_independent(
            _unwrap_data_parallel(self.model),
            kwargs,
            record_ids=record_ids,
            max_segments=CHECKED_SEGMENTS,
            hooks=self.hooks,
        )
        # Done only where a record after another in its row was compared: that is the case a
        # pack can get wrong (a first batch of one record per row would otherwise use it up).
        self.full_checked = any(start > 0 for _, _, start, _ in result.segments)


#: Attention implementations that find a packed row's records from ``cu_seq_lens_q`` or
#: ``position_ids`` alone (no 4D mask): ``transformers``' flash kernels and the varlen SDPA of
#: :mod:`opacus_rc.packed_attention`.
VARLEN_ATTENTION = (
    PACKED_SDPA,
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)


def _attn_implementation(model: nn.Module) -> str | None:
    """The ``config._attn_implementation`` of the (first) Hugging Face model inside ``model``."""
    for module in model.modules():
        config = getattr(module, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if isinstance(impl, str):
            return impl
    return None


def check_varlen_segments(
    model: nn.Module, inputs: dict[str, Any], record_ids: torch.Tensor
) -> None:
    """Refuse a varlen attention whose records are not the packed batch's records.

    Runs when the model's attention implementation (``config._attn_implementation``) is one of
    :data:`~opacus_rc.packed_loss.VARLEN_ATTENTION` and no 4D mask is given (otherwise nothing
    is checked here: the 4D mask, or the first batch's logits check, cover the other paths).
    Such an attention keeps each segment of a row apart, the segments starting at the
    boundaries of ``cu_seq_lens_q`` if given, else wherever ``position_ids`` (``0..T-1`` if
    absent, as a Llama-style model makes them) is not the previous position plus one
    (:func:`~opacus_rc.packed_attention.segment_starts`). Every record segment of
    ``record_ids`` must start a segment and hold no other start. A flash attention given a 2D
    padding mask with a zero unpads each row as one sequence and is refused;
    ``opacus_rc_packed_sdpa`` keeps padding out of every segment and accepts it (a record may
    then follow padding inside a segment: it attends none of it).

    Args:
        model: The model (any wrapper around a Hugging Face model).
        inputs: The forward's keyword inputs.
        record_ids: ``(R, T)`` record of each token, -1 at padding.

    Raises:
        BatchIndependenceError: A record's attention would reach another record or padding
            before it.
    """
    impl = _attn_implementation(model)
    if impl not in VARLEN_ATTENTION:
        return
    rid = record_ids
    R, T = rid.shape
    mask = inputs.get("attention_mask")
    fix = (
        "Pass position_ids restarting at 0 at each record (opacus_rc.packing.PackingCollator "
        "gives them), or cu_seq_lens_q over the records (with flash attention, no 2D padding "
        "mask)"
    )
    if (
        impl != PACKED_SDPA
        and isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and not bool(mask.bool().all())
    ):
        raise BatchIndependenceError(
            f"the packed batch's attention crosses records: {impl} with a 2D padding mask "
            "unpads each row as one sequence, so the records of a row attend each other. " + fix
        )
    pos = inputs.get("position_ids")
    cu = inputs.get("cu_seq_lens_q")
    if isinstance(pos, torch.Tensor) and pos.is_meta:
        return
    if not isinstance(pos, torch.Tensor) and not isinstance(cu, torch.Tensor):
        pos = torch.arange(T, device=rid.device).unsqueeze(0)
    try:
        starts = segment_starts(
            (R, T),
            position_ids=pos if isinstance(pos, torch.Tensor) else None,
            cu_seq_lens=cu if isinstance(cu, torch.Tensor) else None,
        ).to(rid.device)
    except ValueError as err:
        raise BatchIndependenceError(
            f"the packed batch's attention crosses records: {impl} cannot find its records "
            f"({err}). " + fix
        ) from err
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tuple(mask.shape) == (R, T):
        # opacus_rc_packed_sdpa: padding attends nothing and is attended by nothing, so a
        # real token starts a segment where the real token before it is in another segment.
        keep = mask.to(rid.device).bool()
        seg = starts.long().cumsum(1)
        at = torch.arange(T, device=rid.device).expand(R, T)
        before = torch.where(keep, at, -1).cummax(1).values
        before = torch.cat([before.new_full((R, 1), -1), before[:, :-1]], dim=1)
        seg_before = torch.where(before >= 0, seg.gather(1, before.clamp(min=0)), -1)
        starts = keep & (seg_before != seg)
    first = torch.ones_like(rid, dtype=torch.bool)
    first[:, 1:] = rid[:, 1:] != rid[:, :-1]
    real = rid >= 0
    wrong = real & (first != starts)
    if bool(wrong.any()):
        r, t = (int(v) for v in wrong.nonzero()[0])
        what = (
            "starts no attention segment (it attends the tokens before it)"
            if bool(first[r, t])
            else "starts a new attention segment inside its record"
        )
        raise BatchIndependenceError(
            f"the packed batch's attention crosses records: {impl} finds the records from "
            f"{'cu_seq_lens_q' if isinstance(cu, torch.Tensor) else 'position_ids'}, and in "
            f"row {r} token {t} of record {int(rid[r, t])} {what} ({int(wrong.sum())} such "
            "tokens). " + fix
        )


def _unwrap_data_parallel(module: nn.Module) -> nn.Module:
    """The module inside DDP / DPDDP wrappers (whose forward would issue collectives)."""
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(
        module, (DistributedDataParallel, DifferentiallyPrivateDistributedDataParallel)
    ):
        module = module.module
    return module


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())
