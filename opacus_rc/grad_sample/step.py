"""The state of one randomized-clipping step, with explicit transitions
(docs/architecture.md#architecture-step).

One :class:`StepState` is owned by each randomized-clipping grad-sample module. The DP loss,
the module's hooks and the optimizer talk to each other only through its public methods, and
it is the one place that enforces the step's privacy invariant:

    every parameter that holds a gradient at ``optimizer.step()`` got a per-sample norm and a
    clip factor in this step's private backward, through the path the step is accounted for.

Transitions (:class:`StepPhase`)::

    IDLE --forward--> RECORDED --backward hooks--> NORMED --issue_clip_factors--> FACTORS_ISSUED
    FACTORS_ISSUED --mark_applied (clipped sum or second pass)--> APPLIED
    APPLIED --consume (optimizer.step / zero_grad)--> IDLE
    any --fail (an error inside the private backward)--> FAILED --consume (zero_grad)--> IDLE

It also holds how the step's backward runs, decided by the forward hooks and the private
backward (:meth:`StepState.mark_checkpointed`, :meth:`StepState.plan_backward`). Three records
of a step keep their own owners, each cleared with the step's records by the grad-sample
module's ``discard_recorded()``: the forward spans of
:class:`~opacus_rc.grad_sample.checks.ParameterUseCheck` (hooks of their own), the partial joint
sketches of :class:`~opacus_rc.grad_sample.tied.TiedSketches`, and the keyword arguments of
hooked calls (:class:`~opacus_rc.grad_sample.forward_inputs.ForwardInputBinder`); Opacus keeps
its activations and use counters on the modules and parameters.

Anything out of order raises :class:`StepProtocolError` (a ``RuntimeError``) before noise is
drawn or a step is accounted, and leaves the state as it was (or, for a failed backward,
FAILED with every stored tensor dropped).

Why this module stays one concept (it is somewhat over 500 lines): :class:`StepState` is one
state machine over one set of records. The recording, the backward plan (checkpointing, the
first pass, the stash size, the step's units), the issue of the clip factors and the step
check all read and reset the same private records (phase, norms, gradients seen, stashes) in
the same transitions (a new step's first forward, ``consume``, ``fail``); moving the flags or
the factor issue to a module of their own would give the step a second owner of those records
and a second reset path, which the step object exists to avoid. The clip factors themselves
are computed elsewhere (:func:`~opacus_rc.grad_sample.clip.clip_factors`). About a fifth of
the lines are the error messages that say which misuse stopped a step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from opacus_rc._compat.torch import in_backward
from opacus_rc.grad_sample.bookkeeping import BookkeepingStash
from opacus_rc.grad_sample.clip import clip_factors

__all__ = ["StepPhase", "StepProtocolError", "StepState"]


#: ``StepState.units`` before the step's criterion was called.
_NO_CRITERION = object()


class StepProtocolError(RuntimeError):
    """A call out of the order of the randomized-clipping step protocol."""


class StepPhase(str, enum.Enum):
    """Where a :class:`StepState` is in its step (see the module docstring)."""

    IDLE = "idle"
    RECORDED = "recorded"
    NORMED = "normed"
    FACTORS_ISSUED = "factors_issued"
    APPLIED = "applied"
    FAILED = "failed"


_TWO_BACKWARDS = (
    "backward() was called twice without optimizer.step() or optimizer.zero_grad() in between: "
    "the randomized-clipping loss cannot accumulate gradients over backward calls (the first "
    "batch's clipped gradients would be dropped, Opacus issue 683). Step after every backward, "
    "and use opacus.utils.batch_memory_manager.BatchMemoryManager to split a logical batch "
    "into physical ones (with a UnitDataLoader, units=: "
    "opacus_rc.units.UnitBatchMemoryManager, which keeps units whole or, with "
    "split_units=True, cuts them and yields each batch's unit_split=)."
)
_FAILED = (
    "the last backward() of the randomized-clipping loss raised; its gradients may be "
    "unclipped, so no step is taken and nothing is accounted. Call optimizer.zero_grad() and "
    "continue with a new batch (note that skipping a batch because of one sample's data is "
    "itself outside the DP guarantee)."
)
_NO_FACTORS = (
    "optimizer.step() was called but no clip factors were computed for them (the gradients "
    "it would release): {why}. No step is taken "
    "and nothing is accounted. Use loss = criterion(model(x), y); loss.backward(); "
    "optimizer.step(), with optimizer.zero_grad() before each batch, and the criterion "
    "returned by make_private."
)


class StepState:
    """Everything one randomized-clipping step records, from the forward pass to the step.

    Args:
        name_of: Qualified name of a module or parameter (for error messages).

    Attributes:
        phase: The current :class:`StepPhase`.
        per_sample_gradient_norms: ``(B,)`` float64 norm estimates of the whole model from the
            last issued clip factors; kept until the next hooked forward pass (read-only use).
    """

    def __init__(self, *, name_of: Callable[[Any], str]) -> None:
        self._name_of = name_of
        self.phase = StepPhase.IDLE
        self._norms: dict[nn.Parameter, torch.Tensor] = {}
        self._grad_seen: dict[int, nn.Parameter] = {}
        self._stashes: dict[int, BookkeepingStash] = {}
        self._ready: list[BookkeepingStash] | None = None
        self._clipped: frozenset[int] = frozenset()
        self._first_pass_inputs: list[Any] = []
        self.per_sample_gradient_norms: torch.Tensor | None = None
        self.last_norm_samples: dict[nn.Parameter, torch.Tensor] = {}
        self._units: Any = _NO_CRITERION
        self._checkpointed = False
        self._full_first_pass = False
        self._smaller_stash = False

    # ------------------------------------------------------------------------------------------
    # Recording (forward and backward hooks)
    # ------------------------------------------------------------------------------------------

    def on_forward(self) -> None:
        """A hooked forward pass recorded activations (a new step starts if the last ended).

        Book-keeping tensors handed over to a clipped sum that never ran (Opacus' own two-pass
        loss) are stale from now on and dropped.
        """
        if in_backward():
            return  # a forward recomputed inside the backward (activation checkpointing)
        self._ready = None
        if self.phase is StepPhase.NORMED:
            # The norms of a backward that no clip factor used (a plain loss.backward()) are
            # stale once the next forward starts.
            self._clear_records()
            self.phase = StepPhase.IDLE
        if self.phase is StepPhase.IDLE:
            self.per_sample_gradient_norms = None
            self.last_norm_samples = {}
            self._units = _NO_CRITERION
            self._checkpointed = False
            self._smaller_stash = False
            self.phase = StepPhase.RECORDED

    # ------------------------------------------------------------------------------------------
    # How the step's backward runs (activation checkpointing, the book-keeping first pass)
    # ------------------------------------------------------------------------------------------

    def mark_checkpointed(self) -> None:
        """A hooked module ran inside an activation-checkpointed region in this step's forward
        (its inputs are recorded by the recomputation inside the backward)."""
        self._checkpointed = True

    @property
    def checkpointed(self) -> bool:
        """Whether this step's forward ran activation-checkpointed regions (reset by the first
        hooked forward of the next step)."""
        return self._checkpointed

    def plan_backward(self, *, full_first_pass: bool, smaller_stash: bool) -> None:
        """Record how this step's private backward runs, decided just before its first pass.

        Args:
            full_first_pass: The book-keeping first pass must reach every leaf
                (``torch.autograd.backward(inputs=None)``): a reentrant checkpoint region, or a
                parameter used outside its module's forward.
            smaller_stash: Each layer keeps the smaller of its per-sample gradients and its
                input and output gradient for the clipped sum (a checkpointed book-keeping
                step, :mod:`~opacus_rc.grad_sample.norms`).
        """
        self._full_first_pass = full_first_pass
        self._smaller_stash = smaller_stash

    @property
    def full_first_pass(self) -> bool:
        """Whether the last planned first pass reaches every leaf (see :meth:`plan_backward`)."""
        return self._full_first_pass

    @property
    def smaller_stash(self) -> bool:
        """Whether this step's layers keep the smaller stash (see :meth:`plan_backward`)."""
        return self._smaller_stash

    @property
    def units(self) -> Any:
        """The step's :class:`~opacus_rc.units.UnitLayout` (``units=`` passed to
        the criterion), or None (per-sequence clipping)."""
        return None if self._units is _NO_CRITERION else self._units

    def set_units(self, layout: Any) -> None:
        """The criterion of this step was called with ``units=`` (a layout) or without (None).

        Raises:
            ValueError: If an earlier criterion call of the same step disagreed (one loss with
                ``units=``, another without or with other units): the losses could not be
                combined per unit.
        """
        old = self._units
        if old is not _NO_CRITERION and not (
            (old is None and layout is None)
            or (old is not None and layout is not None and old.same_as(layout))
        ):
            raise ValueError(
                "the criterion was called twice in one step with different units= (or once "
                "with and once without): every loss of a step must be per unit with the same "
                "units tensor, or none of them"
            )
        self._units = layout

    def record_norms(self, norms: dict[nn.Parameter, torch.Tensor]) -> None:
        """Store per-sample norms ``{param: (B,) tensor}`` computed by a backward hook.

        Each parameter gets its norm once per step: a module whose uses are summed (Opacus'
        per-sample-gradient path) records it at its last use, a tied weight at its second
        module. A second record means the module ran more than once where no forward-time
        check could see it (once in each of two activation-checkpointed segments: every
        recomputation then looks like a single use), and the later norm would silently replace
        the norm of the summed gradient. The step fails instead.

        Raises:
            NotImplementedError: If a parameter of ``norms`` already has a norm in this step
                (the step is failed first: ``step()`` refuses until ``zero_grad()``).
        """
        again = [p for p in norms if p in self._norms]
        if again:
            names = [self._name_of(p) for p in again[:5]]
            self.fail()
            raise NotImplementedError(
                f"the per-sample norm of {names} was computed twice in one step: its module ran "
                "more than once before the backward pass, e.g. once in each of two "
                "activation-checkpointed segments (torch.utils.checkpoint), where the "
                "recomputed forwards each look like a single use, so the uses cannot be combined. "
                "Use separate modules, or put every use of a shared module in one checkpointed "
                "segment or outside checkpointing (there a sketched module used twice is "
                "refused at the forward pass, and an exactly normed one has its per-sample "
                "gradients summed over its uses)."
            )
        self._norms.update(norms)
        if self.phase is not StepPhase.FAILED:
            # A hooked backward after factors were issued invalidates them (step() refuses).
            self.phase = StepPhase.NORMED

    def record_gradient(self, param: nn.Parameter) -> None:
        """A trainable parameter received a gradient in the private (hooked) backward."""
        self._grad_seen[id(param)] = param

    def stash(self, stash: BookkeepingStash) -> None:
        """Keep a module's book-keeping tensors until the clip factors exist (merged per module)."""
        old = self._stashes.get(id(stash.module))
        if old is not None and old.grad_samples is not None and stash.grad_samples is not None:
            stash = BookkeepingStash(
                stash.module,
                tuple({**old.grad_samples, **stash.grad_samples}),
                grad_samples={**old.grad_samples, **stash.grad_samples},
            )
        self._stashes[id(stash.module)] = stash

    def add_first_pass_input(self, edge: Any) -> None:
        """Book-keeping: a graph edge (or parameter) the first backward pass must reach."""
        self._first_pass_inputs.append(edge)

    def take_first_pass_inputs(self) -> list[Any] | None:
        """The ``inputs`` of the book-keeping first pass recorded since the last call, or None."""
        edges, self._first_pass_inputs = self._first_pass_inputs, []
        return edges or None

    def stashed(self, module: nn.Module) -> BookkeepingStash | None:
        """The stash of ``module`` in this step, if any."""
        return self._stashes.get(id(module))

    @property
    def has_stashes(self) -> bool:
        """Whether book-keeping tensors of this step are held (on modules or handed over)."""
        return bool(self._stashes) or self._ready is not None

    # ------------------------------------------------------------------------------------------
    # The private backward (DP loss)
    # ------------------------------------------------------------------------------------------

    def begin_backward(self) -> None:
        """Check that a private backward may start now.

        Raises:
            StepProtocolError: If clip factors of an earlier backward were not consumed by
                ``optimizer.step()``/``zero_grad()``, or the last backward failed and
                ``zero_grad()`` has not been called since.
        """
        if self.phase is StepPhase.FAILED:
            raise StepProtocolError(
                "the last backward() of the randomized-clipping loss raised; call "
                "optimizer.zero_grad() before the next batch's forward and backward"
            )
        if self.phase in (StepPhase.FACTORS_ISSUED, StepPhase.APPLIED):
            raise StepProtocolError(_TWO_BACKWARDS)

    def norm_batch_sizes(self, params: Iterable[nn.Parameter]) -> dict[str, int]:
        """``{parameter name: batch size}`` of this step's norms, in ``params`` order."""
        return {self._name_of(p): self._norms[p].numel() for p in params if p in self._norms}

    def issue_clip_factors(
        self, *, max_grad_norm: float, params: Iterable[nn.Parameter], bookkeeping: bool
    ) -> torch.Tensor:
        """Combine this step's norms and issue the clip factors ``min(1, C / (n_hat + 1e-6))``.

        ``n_hat_i = sqrt(sum_params norm_{i,param}^2)``
        (docs/privacy/estimators.md#estimators-hutchinson, several layers), in float64. One host
        synchronisation: the finiteness decision over all samples.

        Args:
            max_grad_norm: ``C``.
            params: The module's trainable parameters, in a fixed order.
            bookkeeping: Whether the stashes must cover every normed parameter.

        Returns:
            ``(B,)`` clip factors, float32 (float64 if any norm was float64).

        Raises:
            StepProtocolError: No backward ran since the last step (no norms).
            RuntimeError: A parameter received a gradient without a norm, or (book-keeping) has
                a norm without stored tensors for its clipped sum.
            ValueError: Norms of different batch sizes (a batch-broadcast input).
            FloatingPointError: A NaN or inf norm estimate.
            Every error drops what the step recorded (nothing half-done is kept).
        """
        params = list(params)
        try:
            coef = self._issue(max_grad_norm=max_grad_norm, params=params, bookkeeping=bookkeeping)
        except BaseException:
            self.reset()  # the DP loss then marks the step FAILED (abort_step)
            raise
        return coef

    def _issue(
        self, *, max_grad_norm: float, params: list[nn.Parameter], bookkeeping: bool
    ) -> torch.Tensor:
        if self.phase is not StepPhase.NORMED or not self._norms:
            raise StepProtocolError(
                "no per-sample norms for this step: run a forward pass in training mode with "
                "gradients enabled, then the criterion's backward(). (A step's norms are "
                "consumed by get_clipping_coef(); read per_sample_gradient_norms afterwards, "
                "until the next forward.)"
            )
        unmeasured = [
            self._name_of(p) for pid, p in self._grad_seen.items() if p not in self._norms
        ]
        if unmeasured:
            raise RuntimeError(
                f"parameters {unmeasured[:5]} received a gradient but no per-sample norm was "
                "computed for them (used outside their module's forward, e.g. tied through "
                "F.linear, or their module is in eval mode); they would not be clipped"
            )
        sizes = self.norm_batch_sizes(params)
        if len(set(sizes.values())) > 1:
            batch = max(sizes.values())
            odd = {n: b for n, b in sizes.items() if b != batch}
            raise ValueError(
                f"per-sample norms disagree on the batch size: the batch has {batch} samples "
                f"but {odd}. A module whose input is broadcast across the batch (e.g. a position "
                "Embedding fed Hugging Face position_ids of shape [1, T], Opacus issue 841) only "
                "sees the gradient summed over samples, so its per-sample norms cannot be "
                "computed. Expand the input to the batch size (position_ids.expand(B, -1)) or "
                "freeze that module."
            )
        norm, coef_dtype = self._combine(params)
        bad = ~torch.isfinite(norm)
        if bool(bad.any()):  # the step's one host synchronisation in the backward
            # With units= the norms are one per unit (U of them), not per sequence.
            what = "per-sample" if self.units is None else "per-unit"
            raise FloatingPointError(
                f"{int(bad.sum())} of {norm.numel()} {what} gradient norm estimates are "
                "NaN or inf; no clip factor was produced and this step must not be taken. "
                "Check the loss and the inputs for NaN/inf (a loss divided by zero, e.g. by an "
                "expected batch size of 0, included), the parameters (NaN/inf after an earlier "
                "step), or lower the learning rate."
            )
        ready = list(self._stashes.values())
        if bookkeeping and norm.numel() > 0:
            covered = {id(p) for s in ready for p in s.params}
            lacking = [self._name_of(p) for p in self._norms if id(p) not in covered]
            if lacking:
                raise RuntimeError(
                    f"book-keeping: parameters {lacking[:5]} have a per-sample norm but no "
                    "stored tensors for their clipped gradient sum; this step cannot be clipped"
                )
        coef = clip_factors(norm, max_grad_norm=max_grad_norm)
        self.per_sample_gradient_norms = norm
        self.last_norm_samples = dict(self._norms)
        self._clipped = frozenset(id(p) for p in self._norms)
        self._ready = ready if bookkeeping else None
        self._clear_records()
        self.phase = StepPhase.FACTORS_ISSUED
        return coef.to(coef_dtype)

    def _combine(self, params: list[nn.Parameter]) -> tuple[torch.Tensor, torch.dtype]:
        """``(n_hat, clip-factor dtype)``: the norms of ``params`` combined, in float64."""
        parts = [self._norms[p] for p in params if p in self._norms]
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in parts) else torch.float32
        device = parts[0].device
        norm = torch.stack([t.reshape(-1).to(device, torch.float64) for t in parts]).norm(2, dim=0)
        return norm, dtype

    def pending_norm(self, params: Iterable[nn.Parameter]) -> torch.Tensor | None:
        """The whole-model norms this step's clip factors would use (nothing is issued), or
        None if no backward recorded norms since the last step."""
        params = [p for p in params if p in self._norms]
        if self.phase is not StepPhase.NORMED or not params:
            return None
        return self._combine(params)[0]

    @property
    def norm_samples(self) -> dict[nn.Parameter, torch.Tensor]:
        """``{parameter: (B,) norm}``: this step's so far, else those of the last clip factors."""
        return dict(self._norms) if self._norms else dict(self.last_norm_samples)

    def take_stashes(self) -> list[BookkeepingStash]:
        """Hand this step's book-keeping stashes to the clipped sum (once).

        Raises:
            StepProtocolError: If no clip factors were issued in this step, or the stashes were
                taken already.
        """
        if self.phase is not StepPhase.FACTORS_ISSUED or self._ready is None:
            raise StepProtocolError(
                "apply_clipped_sum(): no stored tensors for this step; call it once, right "
                "after the backward pass and get_clipping_coef() of the same step"
            )
        ready, self._ready = self._ready, None
        return ready

    def mark_applied(self) -> None:
        """The clipped gradients are in ``p.grad`` (clipped sum written or second pass done)."""
        if self.phase is not StepPhase.FACTORS_ISSUED:
            raise StepProtocolError(
                f"clipped gradients applied in phase {self.phase.value!r}, not after clip "
                "factors were issued"
            )
        self._ready = None
        self.phase = StepPhase.APPLIED

    def mark_empty_batch(self) -> None:
        """An empty batch without a forward pass: the clipped sum of no sample is zero.

        Moves IDLE to APPLIED with no parameter clipped, so ``step()`` noises zero gradients
        and accounts the step, as it does after the forward and backward of a ``B = 0`` batch.

        Raises:
            StepProtocolError: If the step is not idle (something was recorded, clip factors
                were issued or applied, or the last backward failed): the batch was not empty,
                or ``zero_grad()`` was not called.
        """
        if self.phase is not StepPhase.IDLE:
            raise StepProtocolError(
                f"an empty-batch step was requested in phase {self.phase.value!r}: it must "
                "replace the batch's forward and backward (call optimizer.zero_grad() first, "
                "and do not run the model on the batch)"
            )
        self._clear_records()
        self.per_sample_gradient_norms = torch.zeros(0, dtype=torch.float64)
        self._clipped = frozenset()
        self.phase = StepPhase.APPLIED

    def fail(self) -> None:
        """A private backward failed: drop everything stored; ``step()`` refuses until consumed."""
        self._clear_records()
        self._ready = None
        self._clipped = frozenset()
        self.phase = StepPhase.FAILED

    def reset(self) -> None:
        """Drop what was recorded but not yet used by clip factors (after an error in a hook,
        or a backward refused before it ran); issued factors and a failure are kept."""
        self._clear_records()
        if self.phase in (StepPhase.RECORDED, StepPhase.NORMED):
            self.phase = StepPhase.IDLE

    def _clear_records(self) -> None:
        self._norms = {}
        self._grad_seen = {}
        self._stashes = {}
        self._first_pass_inputs = []

    # ------------------------------------------------------------------------------------------
    # The optimizer
    # ------------------------------------------------------------------------------------------

    def check_step(self, params: Iterable[nn.Parameter]) -> None:
        """Enforce the step invariant before anything is noised or accounted.

        Args:
            params: The optimizer's parameters.

        Raises:
            StepProtocolError: If the last private backward failed, if no clipped gradients
                were applied since the last step (step before backward, a second step, a
                zero_grad in between, a plain ``loss.backward()`` that bypassed the criterion,
                or a hooked backward after the clip factors were issued), or if a parameter
                holds a gradient that got no clip factor in this step (made trainable or
                replaced after ``make_private``).
        """
        if self.phase is StepPhase.FAILED:
            raise StepProtocolError(_FAILED)
        # FACTORS_ISSUED: the clipped pass of a two-pass loss (Opacus' own DP loss too) runs
        # with the hooks disabled right after the factors are issued; any hooked backward since
        # would have moved the phase back to NORMED.
        if self.phase not in (StepPhase.APPLIED, StepPhase.FACTORS_ISSUED):
            why = {
                StepPhase.IDLE: "no private backward ran since the last step or zero_grad() "
                "(step() before backward(), step() twice, or zero_grad() between backward() "
                "and step())",
                StepPhase.RECORDED: "a forward pass ran but no private backward (a plain "
                "loss.backward() that bypassed the criterion returned by make_private?)",
                StepPhase.NORMED: "a hooked backward ran after the clip factors were issued, "
                "or the loss did not come from the criterion returned by make_private (e.g. a "
                "plain nn.CrossEntropyLoss()(...).backward())",
            }[self.phase]
            raise StepProtocolError(_NO_FACTORS.format(why=why))
        stray = [
            self._name_of(p) for p in params if p.grad is not None and id(p) not in self._clipped
        ]
        if stray:
            raise StepProtocolError(
                f"parameters {stray[:5]} hold a gradient but got no per-sample norm or clip "
                "factor in this step's private backward (made trainable, tied or replaced "
                "after make_private?); they would be released unclipped. Call make_private "
                "again on the plain model after changing which parameters train."
            )

    def consume(self, *, keep_pending: bool = False) -> None:
        """The step's clipped gradients were used or discarded (``optimizer.step``/``zero_grad``).

        Args:
            keep_pending: ``zero_grad()``: keep what a forward or backward recorded but no clip
                factor used yet (Opacus' two-pass loss zeroes the first pass's gradients
                between the backward and the clip factors).
        """
        if keep_pending and self.phase in (StepPhase.RECORDED, StepPhase.NORMED):
            return
        self._clear_records()
        self._ready = None
        self._clipped = frozenset()
        self.phase = StepPhase.IDLE
