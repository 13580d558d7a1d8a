"""What a hooked module's forward call leaves for its backward hook, and why a forward failed
(docs/architecture.md#architecture-step, step 1).

Opacus' forward hook sees a module's positional inputs only. :class:`ForwardInputBinder` keeps
the keyword arguments of each hooked call (a forward pre-hook) and binds them to their
positions in the module's ``forward`` signature, so that ``fc(input=x)`` stores ``[x]`` as
``fc(x)`` does; a type with a forward-input adapter
(:data:`~opacus_rc.grad_sample.registry.FORWARD_INPUT_ADAPTERS`, e.g. ``nn.EmbeddingBag``)
rearranges them itself. :func:`explain_forward_error` turns the two forward failures a user can
fix (an empty Poisson batch the model cannot take, an in-place change of a hooked module's
output) into errors that say what to do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from opacus_rc.grad_sample.registry import ForwardInputAdapter

__all__ = [
    "ForwardInputBinder",
    "check_single_output",
    "contiguous_index_inputs",
    "explain_forward_error",
]


class ForwardInputBinder:
    """The tensors stored for each hooked module's backward hook, from one call of it.

    Args:
        name_of: Qualified name of a module (for error messages).
        adapters: Forward-input adapters by exact module type.
        batch_first: The model's layout (passed to the adapters).
    """

    def __init__(
        self,
        *,
        name_of: Callable[[Any], str],
        adapters: Mapping[type[nn.Module], ForwardInputAdapter],
        batch_first: bool,
    ) -> None:
        self._name_of = name_of
        self._adapters = adapters
        self._batch_first = batch_first
        #: ``id(module) -> kwargs`` of a hooked module's call in progress (forward pre-hook).
        self._call_kwargs: dict[int, dict[str, Any]] = {}
        self._signatures: dict[type[nn.Module], inspect.Signature] = {}

    def record_call_kwargs(self, module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook (``with_kwargs=True``): keep the keyword arguments of this call for
        the forward hook (Opacus' forward hook only sees the positional ones)."""
        if kwargs:
            self._call_kwargs[id(module)] = kwargs
        else:
            self._call_kwargs.pop(id(module), None)

    def take_call_kwargs(self, module: nn.Module) -> dict[str, Any] | None:
        """The keyword arguments of ``module``'s call in progress (once), or None."""
        return self._call_kwargs.pop(id(module), None)

    def clear(self) -> None:
        """Forget the keyword arguments of calls whose forward hook never ran."""
        self._call_kwargs.clear()

    def bind(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None
    ) -> list[torch.Tensor]:
        """The tensors stored for ``module``'s backward hook from one call ``module(*args,
        **kwargs)``.

        Keyword arguments are bound to their positions in ``forward``'s signature
        (``fc(input=x)`` stores ``[x]``); a type with a forward-input adapter
        (:data:`~opacus_rc.grad_sample.registry.FORWARD_INPUT_ADAPTERS`, e.g.
        ``nn.EmbeddingBag``) gets the bound inputs, ``None`` included; for any other type the
        trailing ``None`` inputs are dropped and every other input must be a tensor.

        Raises:
            TypeError: Naming the module: keyword-only arguments (their values would not reach
                the per-sample gradient), arguments that do not match ``forward``'s signature,
                or a non-tensor input of a type without an adapter.
        """
        name = f"'{self._name_of(module)}' ({type(module).__name__})"
        inputs: list[Any] = list(args)
        if kwargs:
            try:
                signature = self._signatures.get(type(module))
                if signature is None:  # type(module).forward: ``self`` first
                    signature = self._signatures[type(module)] = inspect.signature(
                        type(module).forward
                    )
                bound = signature.bind(module, *args, **kwargs).arguments
            except (TypeError, ValueError) as err:
                raise TypeError(
                    f"module {name} was called with keyword argument(s) {sorted(kwargs)} that "
                    f"do not match its forward signature ({err})"
                ) from err
            kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            positional = [q for q in signature.parameters.values() if q.kind in kinds][1:]
            keyword_only = sorted(set(kwargs) - {q.name for q in positional})
            if keyword_only:
                raise TypeError(
                    f"module {name} was called with keyword-only argument(s) {keyword_only}: "
                    "its per-sample gradient is computed from its positional inputs, which "
                    "would not carry them. Pass them positionally, or keep them out of the "
                    "module's forward (e.g. as attributes)"
                )
            last = max((i for i, q in enumerate(positional) if q.name in bound), default=-1)
            inputs = [bound.get(q.name, q.default) for q in positional[: last + 1]]
            for q in signature.parameters.values():
                if q.kind is inspect.Parameter.VAR_POSITIONAL and q.name in bound:
                    inputs.extend(bound[q.name])
        adapter = self._adapters.get(type(module))
        if adapter is not None:
            return adapter(module, inputs, batch_first=self._batch_first)
        while inputs and inputs[-1] is None:
            inputs.pop()
        for i, t in enumerate(inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"module {name} was called with a {type(t).__name__} as input {i}: its "
                    "per-sample gradient is computed from tensor inputs only. Pass only "
                    "tensors to a layer with trainable parameters (keep options as attributes)"
                )
        return inputs


def check_single_output(module: nn.Module, output: Any, *, name: str) -> None:
    """A module on the functorch path must return one tensor: its backward hook sees the
    gradient of the first output only, and the replay multiplies the output by it.

    Args:
        module: The hooked module.
        output: What its forward returned.
        name: Its qualified name.

    Raises:
        TypeError: Naming the module and what it returned.
    """
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"module '{name}' ({type(module).__name__}) has no grad "
            f"sampler and returned a {type(output).__name__}, not a tensor: its per-sample "
            "gradient (functorch) can only be computed for a layer with one tensor output. "
            "Return one tensor, split the layer, or register a grad sampler for it"
        )


def _strided_index(t: Any) -> bool:
    """A non-contiguous integer tensor (e.g. expanded token or position ids)."""
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_contiguous()


def contiguous_index_inputs(stored: list[Any]) -> list[Any] | None:
    """``stored`` with its non-contiguous integer tensors made contiguous, or None if it has
    none. Index inputs expanded over the batch (``position_ids.expand(B, -1)``, the fix for
    Opacus issue 841) are non-contiguous; Opacus' Embedding norm sampler calls ``.view()`` on
    them."""
    if not any(_strided_index(t) for t in stored):
        return None
    return [t.contiguous() if _strided_index(t) else t for t in stored]


def _is_empty_batch_call(args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: int) -> bool:
    """Whether a forward's tensor arguments (nested in lists, tuples and mappings) hold an
    empty batch: some tensor with a dimension ``batch_dim`` of size 0."""
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.dim() > batch_dim and value.shape[batch_dim] == 0:
                return True
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif hasattr(value, "values") and callable(value.values):
            stack.extend(value.values())
    return False


def explain_forward_error(
    err: BaseException,
    *,
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch_first: bool,
) -> RuntimeError | None:
    """The error to raise (from ``err``) for a model's forward that raised, or None to re-raise
    ``err`` itself.

    Args:
        err: What the forward raised.
        model: The wrapped model (its modules are searched for ``inplace=True``).
        args: The forward's positional arguments.
        kwargs: Its keyword arguments.
        batch_first: The model's layout.

    Returns:
        For an empty batch (a tensor argument with a batch dimension of 0) that the model could
        not take: an error naming ``optimizer.noise_only_step()`` and ``rand_on_empty=True``.
        For PyTorch's "BackwardHookFunction is a view and is being modified inplace": an error
        naming the modules with ``inplace=True``. Otherwise None.
    """
    batch_dim = 0 if batch_first else 1
    if isinstance(err, Exception) and _is_empty_batch_call(args, kwargs, batch_dim):
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(sub, FSDPModule) for sub in model.modules()):
            # Under FSDP2 every rank runs the forward and backward (their collectives line
            # up), so noise_only_step() is refused there: only the random batch remains.
            return RuntimeError(
                f"the model's forward raised on an empty batch ({type(err).__name__}: "
                f"{err}). Poisson sampling draws an empty batch (B = 0) with probability "
                "(1 - q)^N at every step, and this model cannot take B = 0. Under FSDP2 "
                "every rank must still run the forward and backward of the step (their "
                "collectives line up), so pass rand_on_empty=True to make_private (a batch "
                "of one random input that depends on no record)"
            )
        return RuntimeError(
            f"the model's forward raised on an empty batch ({type(err).__name__}: "
            f"{err}). Poisson sampling draws an empty batch (B = 0) with probability "
            "(1 - q)^N at every step, and this model cannot take B = 0. The step "
            "must still be taken, noised and accounted: for an empty batch call "
            "optimizer.noise_only_step() instead of the forward, backward and "
            "step() (e.g. `if len(labels) == 0: optimizer.noise_only_step(); "
            "continue`), or pass rand_on_empty=True to make_private (a batch of one "
            "random input that depends on no record)"
        )
    if not isinstance(err, RuntimeError) or (
        "BackwardHookFunction is a view and is being modified inplace" not in str(err)
    ):
        return None
    inplace = [
        name or "<root>"
        for name, sub in model.named_modules()
        if getattr(sub, "inplace", False) is True
    ]
    return RuntimeError(
        "an in-place operation modified the output (or input) of a module whose "
        "per-sample norm is measured: its backward hook must see that tensor unchanged. "
        + (f"Modules with inplace=True: {inplace[:5]}: set inplace=False. " if inplace else "")
        + "Replace in-place updates such as h += x by h = h + x. (Opacus' "
        "ModuleValidator.fix does not change inplace=True.)"
    )
