"""A unit cut across the physical batches of one logical batch (virtual steps within a unit).

``UnitBatchMemoryManager(split_units=True)`` cuts units at the physical batch size and every
batch tells the criterion where (``unit_split=``, a
:class:`~opacus_rc.units.UnitSplit`). The part of the *open* unit (begun, not
finished) in each physical batch is computed from the book-keeping stash and added to an
:class:`OpenUnit` buffer of unclipped summed gradients instead of the clipped sum; when its last
sequence is in, its norm is taken from the buffer with the batch path's estimator and a fresh
probe (:func:`unit_norm_kinds`), and ``c_u x buffer`` joins the clipped sum
(:func:`write_split_clipped_sums`). The optimizer refuses to end a logical step with a unit open
(:func:`check_no_open_unit`). docs/privacy/units.md#units-split states why this is the batch
mechanism.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from opacus_rc.errors import StepProtocolError
from opacus_rc.sketching import autocast_off, hutchinson_sqnorm
from opacus_rc.units.layout import UnitLayout

__all__ = [
    "OpenUnit",
    "check_no_open_unit",
    "drop_open_unit",
    "open_unit_of",
    "unit_norm_kinds",
    "write_split_clipped_sums",
]

#: How the norm of a parameter is taken from a unit's summed gradient (:func:`unit_norm_kinds`).
_KIND_SKETCHED, _KIND_TIED, _KIND_EXACT = "sketched", "tied", "exact"


class OpenUnit:
    """The unit whose sequences are not all in yet: its unclipped summed gradient so far.

    One per step owner (``module.private_step.open_unit``, :func:`open_unit_of`); at most one
    unit is open at a time,
    since the physical batches cut a logical batch of contiguous units.

    Attributes:
        buffer: ``{parameter: summed gradient}`` of the unit's sequences so far (float32 or
            float64; one model-sized set of tensors), or None when no unit is open.
        batches: The number of physical batches that added to it.
    """

    def __init__(self) -> None:
        self.buffer: dict[nn.Parameter, torch.Tensor] | None = None
        self.batches = 0

    @property
    def is_open(self) -> bool:
        """Whether a unit is open."""
        return self.buffer is not None

    def add(self, part: Mapping[nn.Parameter, torch.Tensor]) -> None:
        """Add one physical batch's part of the unit's gradient (consumes ``part``)."""
        if self.buffer is None:
            self.buffer = {}
        for p, g in part.items():
            g = g.to(torch.promote_types(p.dtype, torch.float32))
            old = self.buffer.get(p)
            self.buffer[p] = g if old is None else old.add_(g.to(old))
        self.batches += 1

    def take(self) -> dict[nn.Parameter, torch.Tensor]:
        """The buffer (the unit is closed)."""
        buffer, self.buffer, self.batches = self.buffer or {}, None, 0
        return buffer

    def drop(self) -> None:
        """Forget the open unit (its gradient reaches nothing)."""
        self.buffer, self.batches = None, 0


def open_unit_of(step: Any) -> OpenUnit:
    """The :class:`OpenUnit` of a :class:`~opacus_rc.grad_sample.private_step.PrivateStep`
    (created on first use)."""
    if step.open_unit is None:
        step.open_unit = OpenUnit()
    return step.open_unit


def drop_open_unit(step: Any) -> None:
    """Forget the open unit of a step (a failed backward, cleanup); no-op if none."""
    if step.open_unit is not None:
        step.open_unit.drop()


def check_no_open_unit(open_unit: OpenUnit | None, *, step_ends: bool) -> None:
    """Refuse to end a logical step while a unit cut across its physical batches is open.

    Called by the optimizer's ``step()`` before anything is accumulated, noised or accounted,
    with the ``open_unit`` of the step's :class:`~opacus_rc.grad_sample.private_step.ClipResult`.

    Args:
        open_unit: The unit left open by the last physical batch, or None.
        step_ends: Whether this ``step()`` ends the logical batch (not a skipped virtual step).

    Raises:
        StepProtocolError: If ``step_ends`` and a unit is open (its last sequences never
            came, so it has no clip factor); the open unit is dropped (its gradient reaches
            nothing) and nothing is noised or accounted.
    """
    if not step_ends or open_unit is None or not open_unit.is_open:
        return
    batches = open_unit.batches
    open_unit.drop()
    raise StepProtocolError(
        f"optimizer.step() ends the logical batch, but a unit cut across its physical batches "
        f"is still open (its part of {batches} physical batch(es) is in, its last sequences "
        "are not): it has no clip factor, so nothing is noised or accounted and its partial "
        "gradient is dropped. The last physical batch of a logical batch must end with a "
        "whole unit (unit_split.continues=False): iterate UnitBatchMemoryManager("
        "split_units=True) to the end of each logical batch, stepping after each physical one"
    )


def unit_norm_kinds(model: nn.Module, routes: Mapping[int, Any]) -> dict[int, str]:
    """``{id(parameter): kind}``: how each trainable parameter's norm is taken from a unit's
    summed gradient when the unit was cut across physical batches.

    ``"sketched"``: the weight of an ``nn.Linear`` on the sketched path (the module's
    estimator, a fresh probe); ``"tied"``: a weight shared by an embedding and an LM head (the
    joint ``d``-side Hutchinson sketch, ``k = sketch_dim``); ``"exact"``: every other
    parameter (the exact norm), as in the batch. A parameter of another sketched type gets no
    kind (:func:`_check_split` refuses it).
    """
    kinds: dict[int, str] = {}
    for m in model.modules():
        route = routes.get(id(m))
        if route is None:
            continue
        for p in m.parameters(recurse=False):
            if not p.requires_grad:
                continue
            # NormPath is a str enum (opacus_rc.grad_sample.routing), compared by value here:
            # units/ imports nothing of grad_sample, which calls into it.
            if route.path == "tied" and p is getattr(m, "weight", None):
                kinds[id(p)] = _KIND_TIED
            elif route.path == "sketched":
                if type(m) is nn.Linear and p is m.weight:
                    kinds[id(p)] = _KIND_SKETCHED
                elif type(m) is nn.Linear:
                    kinds[id(p)] = _KIND_EXACT
            else:
                kinds.setdefault(id(p), _KIND_EXACT)
    return kinds


def _check_split(step: Any, layout: UnitLayout | None) -> None:
    """Refuse a physical batch that does not continue the open unit as its cut says.

    Raises:
        ValueError: An open unit the batch does not continue (no ``unit_split``, or
            ``continued=False``), ``continued=True`` without an open unit, or a cut empty batch.
        NotImplementedError: A cut unit without book-keeping, or with a trainable sketched
            module whose norm cannot be taken from a summed gradient.
    """
    open_unit = step.open_unit
    is_open = open_unit is not None and open_unit.is_open
    split = None if layout is None else layout.split
    continued = split is not None and split.continued
    if is_open and not continued:
        raise ValueError(
            "a unit of the previous physical batch continues into this one (its unit_split "
            "had continues=True), but this batch's criterion call does not continue it "
            "(unit_split= missing or continued=False): its clip factor needs all of its "
            "sequences. Pass every physical batch's unit_split as UnitBatchMemoryManager("
            "split_units=True) yields it"
        )
    if continued and not is_open:
        raise ValueError(
            "unit_split.continued is True but no unit is open: the previous physical batch of "
            "this logical batch did not end with a unit that continues (unit_split.continues), "
            "or its backward failed (the open unit is then dropped). Pass every physical "
            "batch's unit_split in order, as UnitBatchMemoryManager(split_units=True) yields "
            "them, and start a new logical batch after a failure"
        )
    if split is None or layout is None:
        return
    if layout.batch_size == 0:
        raise ValueError("unit_split says a unit is cut, but the batch is empty")
    if not step.bookkeeping:
        raise NotImplementedError(
            "a unit cut across physical batches (unit_split=) needs book-keeping (one backward "
            "pass: the unit's part is kept from the stored tensors until its last sequence is "
            "in); this module runs two backward passes (bookkeeping=False, or a module without "
            "a clipped-sum function). Use bookkeeping=True, or UnitBatchMemoryManager("
            "split_units=False) with a max_physical_batch_size that holds the largest unit"
        )
    kinds = unit_norm_kinds(step.model, step.routes)
    params = [p for _, p in step.model.named_parameters() if p.requires_grad]
    odd = [p for p in params if id(p) not in kinds]
    if odd:
        names = [step.name_of(p) for p in odd[:5]]
        raise NotImplementedError(
            f"a unit cut across physical batches needs each parameter's norm from the unit's "
            f"summed gradient; {names} are on a sketched path of a type other than nn.Linear, "
            "whose sketch cannot be taken from a summed gradient. Use whole units "
            "(UnitBatchMemoryManager(split_units=False))"
        )


def _factors_of(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, G)`` of shapes ``(1, T, d)`` and ``(1, T, p)`` with ``G^T A = M`` (``p x d``),
    one of them an identity of size ``min(p, d)``: how a materialised gradient is fed to an
    estimator of ``||G^T A||_F^2``."""
    p, d = M.shape
    if p <= d:
        return M[None], torch.eye(p, dtype=M.dtype, device=M.device)[None]
    return torch.eye(d, dtype=M.dtype, device=M.device)[None], M.t()[None]


def _summed_gradient_norm(
    buffer: Mapping[nn.Parameter, torch.Tensor],
    *,
    kinds: Mapping[int, str],
    estimator: Callable[..., torch.Tensor],
    sketch_dim: int,
    generator_for: Callable[[torch.device], torch.Generator],
) -> torch.Tensor:
    """The ``()`` float64 norm of a closed unit's summed gradient, each parameter's part as
    the batch path takes it (:func:`unit_norm_kinds`): a sketched ``nn.Linear`` weight by the
    module's estimator with one fresh probe (``estimator(A, G)`` on factors with
    ``G^T A = M``, which is a function of ``M`` and the probe only, so its law given ``M`` is
    that of the batch path), a tied weight by the ``d``-side Hutchinson sketch, every other
    parameter exactly; ``sqrt`` of the sum of the squares."""
    squares = []
    for p, g in buffer.items():
        kind = kinds.get(id(p), _KIND_EXACT)
        with autocast_off(g.device):
            if kind == _KIND_EXACT or g.dim() != 2 or g.numel() == 0:
                sq = torch.linalg.vector_norm(g.reshape(-1), dtype=torch.float64).square()
            else:
                A, G = _factors_of(g.double())
                gen = generator_for(g.device)
                if kind == _KIND_TIED:
                    sq = hutchinson_sqnorm(A, G, sketch_dim=sketch_dim, generator=gen, side="input")
                else:
                    sq = estimator(A, G, sketch_dim=sketch_dim, generator=gen)
                sq = sq.reshape(()).clamp(min=0)
        squares.append(sq.to(torch.float64))
    if not squares:
        return torch.zeros((), dtype=torch.float64)
    device = squares[0].device
    return torch.stack([t.to(device) for t in squares]).sum().sqrt()


def write_split_clipped_sums(
    step: Any,
    stashes: list[Any],
    coef: torch.Tensor,
    layout: UnitLayout,
    *,
    max_grad_norm: float,
    compute_clipped_sums: Callable[..., dict[nn.Parameter, torch.Tensor]],
    clip_factors: Callable[..., torch.Tensor],
    apply_clip_factors: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The clipped sum of a physical batch that cuts a unit (book-keeping; module docstring).

    The part of each unit of :attr:`UnitLayout.buffered` (one clipped-sum computation with
    factor 1 for it, 0 elsewhere) is added to the :class:`OpenUnit` buffer instead of the
    clipped sum. If unit 0 closes the open unit here, its norm is taken from the buffer
    (:func:`_summed_gradient_norm`), its factor ``min(1, C / (n_hat + 1e-6))``
    (:func:`~opacus_rc.grad_sample.clip.clip_factors`) applied and
    ``factor x buffer`` added to ``p.grad``; then the unit that continues (``U - 1``) opens
    the buffer again; the other units get their clipped sum with their own factors.

    Args:
        step: The :class:`~opacus_rc.grad_sample.private_step.PrivateStep` (owns the open
            unit, the clipped-sum functions, the estimator, ``sketch_dim`` and the sketch
            generators).
        stashes: The step's book-keeping stashes (consumed).
        coef: ``(U,)`` clip factors of the batch (those of the buffered units are not used);
            updated in place to the factors used (the closed unit's from its whole norm, NaN
            for a unit still open), which the step's ``ClipResult`` reports.
        layout: The batch's layout, with a split.
        max_grad_norm: ``C``.
        compute_clipped_sums: The step's clipped sums
            (:func:`~opacus_rc.grad_sample.bookkeeping.compute_clipped_sums`).
        clip_factors: The one clip-factor formula
            (:func:`~opacus_rc.grad_sample.clip.clip_factors`).
        apply_clip_factors: The one application of a clip factor
            (:func:`~opacus_rc.grad_sample.clip.apply_clip_factors`). The three are handed
            over by the step (:mod:`opacus_rc.grad_sample`, which calls this function):
            :mod:`opacus_rc.units` imports nothing of it.

    Returns:
        ``(U,)`` float64 norms to report: the closed unit's from its summed gradient, NaN for
        a unit still open, the batch's own for the others.

    Raises:
        FloatingPointError: If the closed unit's norm is NaN or inf.
    """
    open_unit = open_unit_of(step)
    U = layout.num_units
    norms = step.per_sample_gradient_norms.clone()
    kinds = unit_norm_kinds(step.model, step.routes)
    name_of = step.name_of
    clipped_sums = step.clipped_sums

    def part(weights: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        return compute_clipped_sums(stashes, weights, clipped_sums=clipped_sums, name_of=name_of)

    def add_to_grads(sums: Mapping[nn.Parameter, torch.Tensor]) -> None:
        with torch.no_grad():
            for p, g in sums.items():
                g = g.to(device=p.device, dtype=p.dtype)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)

    def one_hot(u: int) -> torch.Tensor:
        w = torch.zeros_like(coef)
        w[u] = 1
        return w

    buffered = layout.buffered
    split = layout.split
    assert split is not None
    closed_factor: float | None = None
    if split.continued:
        open_unit.add(part(one_hot(0)))
        if not (split.continues and U == 1):  # unit 0 is complete: clip it once
            buffer = open_unit.take()
            norm = _summed_gradient_norm(
                buffer,
                kinds=kinds,
                estimator=step.estimator,
                sketch_dim=step.config.sketch_dim,
                generator_for=step.generator_for,
            )
            if not bool(torch.isfinite(norm)):
                raise FloatingPointError(
                    "the norm estimate of a unit cut across physical batches is NaN or inf; "
                    "no clip factor was produced and this step must not be taken"
                )
            # the batch path's clip factor (one function), of the closed unit's whole norm
            factors = clip_factors(norm.reshape(1), max_grad_norm=max_grad_norm)
            factor = float(factors[0])
            # applied by the one function (in place: the buffer is not used afterwards)
            add_to_grads(
                {
                    p: apply_clip_factors(
                        factors, g.unsqueeze(0), dtype=g.dtype, reduce=True, consume=True
                    )
                    for p, g in buffer.items()
                }
            )
            norms[0] = norm.to(norms.device)
            closed_factor = factor
    if split.continues and not (split.continued and U == 1):
        open_unit.add(part(one_hot(U - 1)))
    if split.continues:
        norms[U - 1] = math.nan
    if len(buffered) < U:
        closed = coef.clone()
        closed[buffered] = 0
        add_to_grads(part(closed))
    with torch.no_grad():  # the factors used, for the step's ClipResult
        if split.continues:
            coef[U - 1] = math.nan
        if closed_factor is not None:
            coef[0] = closed_factor
    return norms
