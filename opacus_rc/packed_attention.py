"""Varlen attention for packed rows without flash-attn: causal SDPA on each record segment
(docs/packing.md#packing-varlen).

A packed or padding-free row holds several records; attention must stay inside each record
(docs/packing.md#packing-exact). With ``flash_attention_2`` ``transformers`` runs the varlen
kernel on the records given by restarting ``position_ids`` (or ``cu_seq_lens_q``), and each
record costs ``T_r^2``. Without flash-attn (on the CPU, or a GPU without the package) the
other paths keep records apart with a ``(R, 1, T, T)`` block-diagonal mask (given, or built by
``transformers`` from restarting ``position_ids``), and SDPA then costs all ``T^2`` pairs of a
row: on a row of many short records most of them masked.

:func:`packed_sdpa_attention_forward` is the varlen path on any device: it splits each row
into its record segments and runs ``torch.nn.functional.scaled_dot_product_attention(...,
is_causal=True)`` on each segment alone, so a row costs ``sum_r T_r^2``. It is registered
through ``transformers``' public extension points (``AttentionInterface.register`` for the
attention, ``AttentionMaskInterface.register`` for the mask: no 4D mask is built, only a 2D
padding mask with a zero is passed on) when the user calls :func:`register_packed_sdpa`,
never at import::

    from opacus_rc.packed_attention import register_packed_sdpa

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=register_packed_sdpa())
    # or, on a built model: model.set_attn_implementation(register_packed_sdpa())

**Records** come from ``cu_seq_lens_q`` / ``cu_seq_lens_k`` when the model is given them
(``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)``: cumulative record
lengths over the flattened ``B * T`` tokens), otherwise from ``position_ids``: a record starts
wherever a position is not the previous one plus one (as
``transformers.masking_utils.find_packed_sequence_indices``; ``opacus_rc.packing`` gives
restarting positions, and its padding run its own positions ``0..``, so padding is a segment of
its own). A Llama-style model that is given no ``position_ids`` makes them ``0..T-1``: each row
is then one causal record, which is ordinary (padded) causal attention.

**Padding** (a 2D ``attention_mask`` with a zero, as a padded batch passes it): inside each
segment only the real tokens attend, causally, to the real tokens before them; padding
attends nothing and its output is zero. A real token therefore never attends padding, with
left, right or inner padding, which is what SDPA with the 2D mask gives a real token.
Right padding of ``opacus_rc.packing`` rows is its own segment anyway.

**Refused** (``ValueError`` naming the fix): no ``position_ids`` and no ``cu_seq_lens_q``; a 4D
``attention_mask`` (use ``attn_implementation="sdpa"`` with it); attention dropout > 0;
``softcap``; a sliding window (``module.sliding_window`` or ``sliding_window=``);
``output_attentions=True``; non-causal attention; attention sinks (``s_aux``) or a position
bias; a KV cache with queries shorter than the keys (generation: switch back to ``"sdpa"``);
``cu_seq_lens_k`` different from ``cu_seq_lens_q``, or records that cross rows.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = [
    "PACKED_SDPA",
    "packed_sdpa_attention_forward",
    "register_packed_sdpa",
    "segment_starts",
    "uses_packed_sdpa",
]

#: The name under which :func:`register_packed_sdpa` registers the varlen attention (pass it as
#: ``attn_implementation=``).
PACKED_SDPA = "opacus_rc_packed_sdpa"

_FIX = (
    "pass position_ids restarting at 0 at each record (opacus_rc.packing.PackingCollator, "
    "TRL's padding_free=True) or cu_seq_lens_q (DataCollatorWithFlattening("
    "return_flash_attn_kwargs=True))"
)


def register_packed_sdpa() -> str:
    """Register :func:`packed_sdpa_attention_forward` with ``transformers``; return its name.

    Registers the attention (``transformers.AttentionInterface.register``) and a mask function
    that builds no 4D mask and passes on a 2D padding mask only when it has a zero
    (``transformers.AttentionMaskInterface.register``). Idempotent: a second call sets the same
    functions again and returns the same name.

    Returns:
        :data:`PACKED_SDPA`, to pass as ``attn_implementation=`` to ``from_pretrained`` /
        ``from_config`` or to ``model.set_attn_implementation``.

    Raises:
        ImportError: If ``transformers`` is not installed.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    # register() sets one key of transformers' class-wide table: a second call sets the same
    # functions again, nothing else changes.
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention_forward)
    AttentionMaskInterface.register(PACKED_SDPA, _padding_mask_only)
    return PACKED_SDPA


def uses_packed_sdpa(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the Hugging Face model inside a wrapper) runs :data:`PACKED_SDPA`.

    Args:
        model: Any module; its submodules' ``config._attn_implementation`` are read.

    Returns:
        True if the first Hugging Face config found names :data:`PACKED_SDPA`.
    """
    for module in model.modules():
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if isinstance(impl, str):
            return impl == PACKED_SDPA
    return False


def _padding_mask_only(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """The mask function of :data:`PACKED_SDPA`: no 4D mask; the 2D padding mask, boolean,
    only if it has a zero (``None`` otherwise)."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask.bool()


def segment_starts(
    shape: tuple[int, int],
    *,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Where each segment (record) of packed rows starts.

    Args:
        shape: ``(B, T)``, the rows.
        position_ids: ``(B, T)`` or ``(1, T)``; a segment starts at token 0 of each row and
            wherever a position is not the previous one plus one.
        cu_seq_lens: ``(S + 1,)`` cumulative segment lengths over the flattened ``B * T``
            tokens, from 0 to ``B * T``; used instead of ``position_ids`` when given.

    Returns:
        ``(B, T)`` boolean, True at the first token of each segment (always at token 0).

    Raises:
        ValueError: If neither is given, ``position_ids`` has another shape, or
            ``cu_seq_lens`` does not run from 0 to ``B * T`` increasing, or has a segment
            crossing rows.
    """
    B, T = shape
    if cu_seq_lens is not None:
        cu = cu_seq_lens.reshape(-1).long()
        if (
            cu.numel() < 2
            or int(cu[0]) != 0
            or int(cu[-1]) != B * T
            or bool((cu.diff() <= 0).any())
        ):
            raise ValueError(
                f"cu_seq_lens must increase from 0 to B * T = {B * T} (the flattened tokens of "
                f"{B} rows of {T}), got {cu.tolist()[:8]}...: pass the collator's "
                "cu_seq_lens_q for these input_ids"
            )
        starts = torch.zeros(B * T, dtype=torch.bool, device=cu.device)
        starts[cu[:-1]] = True
        starts = starts.view(B, T)
        # A segment crossing rows: a row start (a multiple of T) that is no segment start.
        if not bool(starts[:, 0].all()):
            raise ValueError(
                "cu_seq_lens has a record crossing rows: flatten the batch into one row "
                "(DataCollatorWithFlattening does) or cut records at row ends"
            )
        return starts
    if position_ids is None:
        raise ValueError(f"no position_ids and no cu_seq_lens_q to find the records: {_FIX}")
    pos = position_ids
    if pos.dim() != 2 or pos.shape[1] != T or pos.shape[0] not in (1, B):
        raise ValueError(f"position_ids of shape {tuple(pos.shape)} for rows of shape {(B, T)}")
    pos = pos.expand(B, T)
    starts = torch.ones((B, T), dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    return starts


#: The last plan and its key (the rows' shape, weak references to the position ids,
#: cu_seq_lens and mask and their versions): every layer of one forward gets the same objects,
#: so the segments are found (one host read) once per forward, not once per layer.
_last_plan: tuple[tuple[Any, ...], list[list[tuple[int, int, Any]]]] | None = None


def _key(*tensors: torch.Tensor | None) -> tuple[Any, ...]:
    return tuple(
        (None, None) if t is None else (weakref.ref(t), t._version, tuple(t.shape)) for t in tensors
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    for (ra, va, *sa), (rb, vb, *sb) in zip(a, b):
        if (ra is None) != (rb is None):
            return False
        if ra is not None and (ra() is None or ra() is not rb() or va != vb or sa != sb):
            return False
    return True


def _plan(
    B: int,
    T: int,
    position_ids: torch.Tensor | None,
    cu_seq_lens: torch.Tensor | None,
    padding: torch.Tensor | None,
) -> list[list[tuple[int, int, Any]]]:
    """Per row, its segments ``(start, end, real)``: ``real`` None (all tokens real), an empty
    list (all padding) or the ``(n,)`` index tensor of the real tokens in the segment."""
    global _last_plan
    key = ((B, T),) + _key(position_ids, cu_seq_lens, padding)
    if _last_plan is not None and _last_plan[0][0] == (B, T) and _same(_last_plan[0][1:], key[1:]):
        return _last_plan[1]
    starts = segment_starts((B, T), position_ids=position_ids, cu_seq_lens=cu_seq_lens).cpu()
    real = None if padding is None else padding.to(device="cpu", dtype=torch.bool)
    plan: list[list[tuple[int, int, Any]]] = []
    for b in range(B):
        bounds = torch.nonzero(starts[b]).flatten().tolist() + [T]
        row = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            if real is None or bool(real[b, s:e].all()):
                row.append((s, e, None))
            else:
                idx = torch.nonzero(real[b, s:e]).flatten()
                row.append((s, e, [] if idx.numel() == 0 else idx))
        plan.append(row)
    _last_plan = (key, plan)
    return plan


def _refuse(what: str, fix: str) -> ValueError:
    return ValueError(f"{PACKED_SDPA} (varlen SDPA over packed records): {what}; {fix}")


def packed_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA on each record segment of each row (module docstring); the attention
    function of :data:`PACKED_SDPA` (``transformers``' attention-function signature).

    Args:
        module: The attention module (``num_key_value_groups``, ``sliding_window``,
            ``is_causal`` are read).
        query: ``(B, H, T, D)``.
        key: ``(B, H_kv, T, D)``; ``H`` a multiple of ``H_kv`` (grouped-query attention).
        value: ``(B, H_kv, T, D_v)``.
        attention_mask: None, or the ``(B, T)`` boolean padding mask (True: a real token).
        dropout: Must be 0.
        scaling: The softmax scale (SDPA's default ``D ** -0.5`` if None).
        is_causal: Must not be False.
        **kwargs: ``position_ids`` ``(B or 1, T)`` or ``cu_seq_lens_q`` (and equal
            ``cu_seq_lens_k``); the rest of ``transformers``' keyword arguments, refused where
            they would change the attention (module docstring).

    Returns:
        ``(output, None)``: output ``(B, T, H, D_v)``, contiguous, as ``transformers``' SDPA
        integration returns it.

    Raises:
        ValueError: For what is refused (module docstring), naming the fix.
    """
    if dropout:
        raise _refuse(f"attention dropout {dropout}", "set the config's attention_dropout to 0")
    if kwargs.get("softcap") is not None:
        raise _refuse("softcap", "use attn_implementation='eager' for a soft-capped model")
    window = kwargs.get("sliding_window")
    if window is None:
        window = getattr(module, "sliding_window", None)
    if window is not None:
        raise _refuse(
            f"a sliding window ({window})",
            "use attn_implementation='flash_attention_2', or sdpa with a block-diagonal mask",
        )
    if kwargs.get("output_attentions"):
        raise _refuse("output_attentions=True", "use attn_implementation='eager' for them")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        raise _refuse("non-causal attention", "use it with causal (decoder) models only")
    if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        raise _refuse("attention sinks or a position bias", "use attn_implementation='eager'")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise _refuse(
            f"query, key and value must be (B, H, T, D), got {tuple(query.shape)}",
            "check the model",
        )
    B, H, T, _ = query.shape
    if key.shape[2] != T or value.shape[2] != T:
        raise _refuse(
            f"{T} queries for {key.shape[2]} keys (a KV cache)",
            "generate with model.set_attn_implementation('sdpa')",
        )
    if attention_mask is not None and (
        attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, T)
    ):
        raise _refuse(
            f"an attention_mask of shape {tuple(attention_mask.shape)} (a 4D mask, or one "
            f"not over the {T} tokens)",
            "pass a 2D padding mask or none: the records come from position_ids "
            "(PackingCollator(padding_free=True), SFTConfig(padding_free=True)); with a 4D "
            "block-diagonal mask use attn_implementation='sdpa'",
        )
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is not None:
        cu_q = cu_k
    if cu_q is not None and cu_k is not None and not torch.equal(cu_q, cu_k.to(cu_q.device)):
        raise _refuse("cu_seq_lens_k differs from cu_seq_lens_q", "pass equal ones (no cache)")
    position_ids = kwargs.get("position_ids")
    if cu_q is None and position_ids is None:
        raise _refuse("no position_ids and no cu_seq_lens_q to find the records", _FIX)
    plan = _plan(B, T, position_ids, cu_q, attention_mask)

    H_kv = key.shape[1]
    extra: dict[str, Any] = {}
    if H_kv != H:
        if H % H_kv:
            raise _refuse(f"{H} query heads for {H_kv} key/value heads", "check the model")
        extra["enable_gqa"] = True
    Dv = value.shape[-1]
    # unbind and split, not slices: their backward is one stack / cat, where each slice's
    # backward would allocate and add a gradient of the whole tensor.
    q_rows, k_rows, v_rows = query.unbind(0), key.unbind(0), value.unbind(0)
    rows = []
    for b, segments in enumerate(plan):
        sizes = [e - s for s, e, _ in segments]
        parts = zip(
            segments,
            q_rows[b].split(sizes, 1),
            k_rows[b].split(sizes, 1),
            v_rows[b].split(sizes, 1),
        )
        outs = []
        for (s, e, real), q, k, v in parts:
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
            if real is None:
                outs.append(_sdpa(q, k, v, scaling, extra))
                continue
            out = query.new_zeros((1, H, e - s, Dv))
            if len(real):
                idx = real.to(query.device)
                o = _sdpa(q[:, :, idx], k[:, :, idx], v[:, :, idx], scaling, extra)
                out = out.index_copy(2, idx, o)
            outs.append(out)
        rows.append(outs[0] if len(outs) == 1 else torch.cat(outs, dim=2))
    output = rows[0] if B == 1 else torch.cat(rows, dim=0)
    return output.transpose(1, 2).contiguous(), None


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, extra: dict
) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=q.shape[2] > 1, scale=scaling, **extra
    )
