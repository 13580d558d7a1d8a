"""The per-unit layout of ``units=``: unit-level (document- or user-level) randomized clipping
(docs/privacy/units.md).

A *unit* is the privacy record: a document longer than the context split into windows, or
all of a user's messages. Each sequence ``j`` of a batch belongs to one unit ``u(j)``
(``units``, a ``(B,)`` integer tensor with values ``0..U-1``), and each unit contributes the
sum of its sequences' gradients, clipped once:

    c_u = min(1, C / (n_hat_u + 1e-6)),   n_hat_u ~ || sum_{j: u(j) = u} grad loss_j ||.

**Packing.** For a *token-wise* module (its forward acts on every position of the sequence
axis independently, with shared parameters: ``nn.Linear``, ``nn.Embedding``, layer and RMS
norms, Hugging Face ``Conv1D``) the gradient of a sequence is a sum over its positions, so the
summed gradient of a unit is the per-sample gradient of the unit's sequences *concatenated
along the position axis*. For ``nn.Linear``, ``sum_j A_j^T G_j = [A_1; ...; A_n]^T [G_1; ...;
G_n]``. The backward hook therefore packs the layer's stored input and output gradient from
``(B, T, ...)`` to ``(U, n_max, T, ...)`` (unit ``u``'s sequences in its first ``n_u`` slots,
zero elsewhere; a zero output gradient contributes nothing to any of these gradients) and
runs the module's usual norm path on ``U`` "samples":

* sketched ``nn.Linear``: one probe ``Omega_u`` per unit per layer (the sampler draws one per
  sample, and the samples are now the units), shared by the unit's sequences,
  ``n_hat_u^2 = || (sum_j A_j^T G_j) Omega_u ||_F^2``-type Hutchinson estimate; independent
  across units and steps as before;
* exact layers (embeddings with ``padding_idx``, biases, norms, the joint sketch of a tied
  embedding/LM head, LoRA factors): the per-sequence gradients are summed within the unit
  before the norm, because the norm is that of the packed sample;
* book-keeping: the stash holds the packed tensors, so the clipped sum
  ``sum_u c_u (sum_{j in u} G_j^T A_j)`` is the one backward pass's weighted sum with each
  sequence scaled by its unit's factor (no second pass, no change to the clipped-sum code).

Clip factors, norms and the per-unit losses are ``(U,)``. A module that is not token-wise
(convolutions over the sequence, recurrent layers, a custom module whose type is not in
:data:`TOKENWISE_TYPES`) is refused when ``units=`` is passed (:func:`check_unit_routes`):
concatenating its inputs would not give the unit's summed gradient.

**Distributed training.** Under DDP, DPDDP or FSDP2 each rank packs its own sequences, so a
unit's sequences must all be on one rank:
:class:`~opacus_rc.units.DistributedUnitDataLoader` gives every sampled unit to
exactly one rank. FSDP2 all-gathers a layer's whole weight in forward and backward, so the
stored inputs and output gradients, hence the packed per-unit norms, are those of the whole
layer on every rank (no reduction of norms across shards is needed); the clipped sums are
reduce-scattered into the shards as for sequences (:mod:`opacus_rc.grad_sample.fsdp`). A unit
cut across physical batches (below) is refused under them
(:func:`~opacus_rc.units.criterion.unit_layout_for_loss`).

**A unit cut across physical batches** (virtual steps within a unit,
``UnitBatchMemoryManager(split_units=True)``, the criterion's ``unit_split=``, a
:class:`UnitSplit`; docs/privacy/units.md#units-split). The part of the *open* unit (begun, not
finished) in each physical batch is computed from the book-keeping stash and added to an
:class:`~opacus_rc.units.split.OpenUnit` buffer of unclipped summed gradients instead of the
clipped sum; when its last sequence is in, its norm is taken from the buffer with the batch
path's estimator and a fresh probe (:func:`~opacus_rc.units.split.unit_norm_kinds`), and
``c_u x buffer`` joins the clipped sum (:func:`~opacus_rc.units.split.write_split_clipped_sums`).
The optimizer refuses to end a logical step with a unit open
(:func:`~opacus_rc.units.split.check_no_open_unit`). These live in :mod:`opacus_rc.units.split`;
the criterion's ``units=`` and ``unit_split=`` are checked and recorded in
:mod:`opacus_rc.units.criterion`. This module (the layout) imports neither.

Cost: the packed copies are ``U n_max T`` positions per layer instead of ``B T`` (no copy at
all when every unit has the same number of sequences and they are contiguous in the batch, as
:class:`~opacus_rc.units.UnitDataLoader` yields them); the work of every norm is
linear in the unit's tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from opacus_rc._compat.opacus import fsdp_base_type
from opacus_rc.registry import qualified_name

__all__ = [
    "TOKENWISE_TYPES",
    "UnitLayout",
    "UnitSplit",
    "check_unit_routes",
    "pack_for_units",
    "register_tokenwise",
]

#: Qualified names (``module.qualname``) of module types whose forward acts on each position
#: independently with shared parameters, so that packing a unit's sequences along the position
#: axis gives the unit's summed gradient (see the module docstring). Extend with
#: :func:`register_tokenwise`. Names, not classes, so that ``transformers`` is not imported: a
#: set of :func:`~opacus_rc.registry.qualified_name` strings, not a registry of functions.
TOKENWISE_TYPES: set[str] = {
    "torch.nn.modules.linear.Linear",
    "torch.nn.modules.sparse.Embedding",
    "torch.nn.modules.normalization.LayerNorm",
    "torch.nn.modules.normalization.RMSNorm",
    "opacus.layers.dp_multihead_attention.SequenceBias",
    "transformers.pytorch_utils.Conv1D",
    "transformers.models.llama.modeling_llama.LlamaRMSNorm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm",
    "transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm",
    "transformers.models.gemma.modeling_gemma.GemmaRMSNorm",
    "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm",
}


def register_tokenwise(module_type: type[nn.Module]) -> type[nn.Module]:
    """Declare ``module_type`` token-wise (usable as a class decorator).

    Only correct for a module whose output at position ``t`` depends on its input at ``t``
    only, through parameters shared by all positions (its per-sample gradient is then a sum
    over positions). Exact type match.

    Returns:
        ``module_type``, unchanged.
    """
    TOKENWISE_TYPES.add(qualified_name(module_type))
    return module_type


def check_unit_routes(model: nn.Module) -> None:
    """Refuse unit-level clipping if a module of ``model`` with trainable parameters of its
    own is not token-wise (:data:`TOKENWISE_TYPES`).

    Args:
        model: The wrapped model.

    Raises:
        NotImplementedError: Naming the modules and what to do.
    """
    bad = [
        f"'{name or '<root>'}' ({type(m).__name__})"
        for name, m in model.named_modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
        and qualified_name(fsdp_base_type(m)) not in TOKENWISE_TYPES  # FSDPLinear -> Linear
    ]
    if bad:
        raise NotImplementedError(
            f"units= (unit-level clipping) needs every trainable module to act on each "
            f"position independently, so that a unit's summed gradient is the gradient of its "
            f"concatenated sequences; {bad[:5]} are not known to be token-wise. Freeze them, or "
            "declare a type token-wise with opacus_rc.units.register_tokenwise "
            "(only if its output at each position depends on that position's input only)"
        )


class UnitSplit(NamedTuple):
    """Where a physical batch cuts a unit (virtual steps that split units; module docstring).

    With contiguous packing only the batch's first and last units can be cut, so two flags say
    everything. :class:`~opacus_rc.units.UnitBatchMemoryManager` with
    ``split_units=True`` yields one per physical batch; pass it to the criterion as
    ``unit_split=``.
    """

    #: The batch's first unit (unit 0) began in the previous physical batch of the same
    #: logical batch.
    continued: bool
    #: The batch's last unit (unit ``U - 1``) continues in the next physical batch.
    continues: bool


class UnitLayout:
    """Which sequences of a batch belong to which unit, and how they are packed.

    Args:
        units: ``(B,)`` integer tensor, ``units[j]`` the unit of sequence ``j``, values
            ``0..U-1`` with every unit present.

    Attributes:
        units: The ``(B,)`` long tensor.
        batch_size: ``B``.
        num_units: ``U``.
        max_sequences: ``n_max``, the largest number of sequences of one unit in the batch.

    Raises:
        TypeError: If ``units`` is not an integer tensor.
        ValueError: If it is not 1-D, has a negative value, or leaves a unit index out.
    """

    def __init__(self, units: torch.Tensor) -> None:
        if (
            not isinstance(units, torch.Tensor)
            or units.dtype.is_floating_point
            or (units.dtype in (torch.bool, torch.complex64, torch.complex128))
        ):
            raise TypeError(
                "units must be an integer torch.Tensor of shape (B,) mapping each sequence of "
                f"the batch to its unit 0..U-1; got {type(units).__name__}"
                + (f" of dtype {units.dtype}" if isinstance(units, torch.Tensor) else "")
            )
        if units.dim() != 1:
            raise ValueError(f"units must have shape (B,), got {tuple(units.shape)}")
        units = units.long()
        B = units.numel()
        if B == 0:
            U, n_max, dest, counts = 0, 1, None, units.new_zeros(0)
        else:
            lo, hi = int(units.min()), int(units.max())  # one host synchronisation per step
            if lo < 0:
                raise ValueError(f"units must be >= 0, got a minimum of {lo}")
            U = hi + 1
            counts = torch.bincount(units, minlength=U)
            if bool((counts == 0).any()):
                missing = torch.nonzero(counts == 0).flatten()[:5].tolist()
                raise ValueError(
                    f"units must number the units of the batch 0..U-1 without gaps; units "
                    f"{missing} (of 0..{U - 1}) have no sequence. Relabel them, e.g. with "
                    "torch.unique(units, return_inverse=True)[1]"
                )
            n_max = int(counts.max())
            # slot of sequence j within its unit: its rank among the unit's sequences in
            # batch order (a stable sort groups each unit's sequences, keeping their order).
            order = torch.sort(units, stable=True).indices
            starts = torch.cumsum(counts, 0) - counts
            slot = torch.empty_like(units)
            slot[order] = torch.arange(B, device=units.device) - starts[units[order]]
            dest = units * n_max + slot
            if U * n_max == B and bool((dest == torch.arange(B, device=dest.device)).all()):
                dest = None  # contiguous, equal sizes: packing is a view
        self.units = units
        self.batch_size = B
        self.num_units = U
        self.max_sequences = n_max
        self.counts = counts
        self._dest = dest
        #: The :class:`UnitSplit` of this physical batch, or None (whole units).
        self.split: UnitSplit | None = None

    @property
    def buffered(self) -> list[int]:
        """The units whose part in this batch goes to the open-unit buffer instead of the
        clipped sum: unit 0 if it continues an open unit, unit ``U - 1`` if it continues in the
        next batch (each once)."""
        if self.split is None or self.num_units == 0:
            return []
        out = [0] if self.split.continued else []
        if self.split.continues and self.num_units - 1 not in out:
            out.append(self.num_units - 1)
        return out

    def same_as(self, other: UnitLayout) -> bool:
        """Whether ``other`` maps the same sequences to the same units (and cuts the same)."""
        return (
            self.batch_size == other.batch_size
            and self.split == other.split
            and bool(torch.equal(self.units.cpu(), other.units.cpu()))
        )

    def sum_per_unit(self, values: torch.Tensor) -> torch.Tensor:
        """``(U,)`` sums of the ``(B,)`` ``values`` over each unit's sequences
        (differentiable)."""
        out = values.new_zeros((self.num_units, *values.shape[1:]))
        return out.index_add(0, self.units.to(values.device), values)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, *rest) -> (U, n_max, *rest)`` (``(U, *rest)`` when ``n_max = 1``): unit
        ``u``'s sequences in its first slots, in batch order, zeros in the others."""
        rest = x.shape[1:]
        if self._dest is None:
            flat = x
        else:
            flat = x.new_zeros((self.num_units * self.max_sequences, *rest))
            flat[self._dest.to(x.device)] = x
        if self.max_sequences == 1:
            return flat.reshape(self.num_units, *rest)
        return flat.reshape(self.num_units, self.max_sequences, *rest)


def pack_for_units(
    layout: UnitLayout,
    module: nn.Module,
    activations: list[Any],
    backprops: torch.Tensor,
    *,
    loss_reduction: str,
) -> tuple[list[Any], torch.Tensor]:
    """A hooked module's stored inputs and output gradient, packed per unit.

    Every tensor input whose first dimension is the batch is packed
    (:meth:`UnitLayout.pack`); the output gradient too, rescaled from Opacus' per-sequence
    scaling (``B`` times the gradient of the mean over sequences, under
    ``loss_reduction="mean"``) to the per-unit losses (``U`` times the gradient of the mean
    over units, which is what the DP loss backpropagates with ``units=``). The module's
    ``max_batch_len`` becomes ``U``, so that Opacus' per-sample-gradient accumulation sizes its
    buffers by units.

    Args:
        layout: The step's :class:`UnitLayout`.
        module: The hooked module (token-wise, :func:`check_unit_routes`).
        activations: Its stored inputs, batch first.
        backprops: ``(B, ...)`` output gradient from Opacus' ``rearrange_grad_samples``.
        loss_reduction: ``"mean"`` or ``"sum"``.

    Returns:
        ``(activations, backprops)`` with ``U`` in place of ``B``.

    Raises:
        ValueError: If the output gradient's batch size is not the layout's.
    """
    B = layout.batch_size
    if backprops.dim() == 0 or backprops.shape[0] != B:
        raise ValueError(
            f"units=: the output gradient of {type(module).__name__} has shape "
            f"{tuple(backprops.shape)}, but units has {B} entries (one per sequence of the "
            "batch, batch first)"
        )
    if loss_reduction == "mean":
        # Opacus multiplied by max_batch_len (B at a module's first use, U at a later use).
        n = getattr(module, "max_batch_len", B)
        backprops = backprops * (layout.num_units / n)
    packed = [
        layout.pack(a) if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == B else a
        for a in activations
    ]
    packed_backprops = layout.pack(backprops)
    if (
        getattr(layout, "max_sequences", None) == 1  # (a packed-row layout has none)
        and isinstance(module, nn.Linear)
        and backprops.dim() == 2
        and len(packed) == 1
        and isinstance(packed[0], torch.Tensor)
        and packed[0].dim() == 2
    ):
        # An nn.Linear on (B, d) inputs: with one sequence in every unit of this batch the
        # units are (U, d), where its sampler takes the exact rank-one norm; with two or more
        # in some unit they are (U, n_max, d), sketched. n_max depends on which units the batch
        # holds, so a unit's estimator would depend on the other units: keep the sequence axis
        # (U, 1, d), sketched like every other batch (docs/privacy/estimators.md#estimators-stash).
        packed[0] = packed[0].unsqueeze(1)
        packed_backprops = packed_backprops.unsqueeze(1)
    module.max_batch_len = layout.num_units
    return packed, packed_backprops
