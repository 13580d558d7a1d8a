"""Exact per-sample gradients of a leaf layer by ``torch.func`` (the ``functorch`` path).

For a layer without a grad sampler, the per-sample gradient of sample ``i`` is that of
``<layer(x_i), g_i>`` with respect to the layer's trainable parameters, ``x_i`` the sample's
inputs and ``g_i`` its output gradient: ``vmap(grad(...))`` over the batch, on a copy of the
layer without hooks whose parameters are swapped in by ``torch.func.functional_call``. This
is what Opacus' ``opacus/grad_sample/functorch.py`` does, with two differences that made it
fail on layers the engine accepts (issue 20, sweep of issue 21 item 2):

* **every** stored input is passed to the layer (Opacus passes only the first one:
  ``nn.Bilinear(x1, x2)`` raised ``missing 1 required positional argument: 'input2'``);
* only the trainable parameters are differentiated (frozen ones are passed as constants).

The copy is made when the grad-sample module is built, before any hook is attached (so it
carries none), and moved to the ``meta`` device: it holds no memory and only its forward code
is used. Layers with buffers are refused there, as in Opacus (running statistics would be
updated by the replay).

It also serves layer types whose Opacus grad sampler is not faithful for some configuration
(:func:`~opacus_rc.grad_sample.routing.resolve_norm_routes`: ``nn.Conv*`` with a
``padding_mode`` other than ``"zeros"``, ``nn.LayerNorm(bias=False)``): the replay runs the
layer's own forward, so the per-sample gradient is autograd's.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from opacus_rc.grad_sample.registry import register_module_check

__all__ = ["FunctorchGradSampler", "check_plain_rnn"]


@register_module_check(nn.RNN)
def check_plain_rnn(layer: nn.RNN) -> None:
    """Refuse a trainable ``nn.RNN`` (Opacus' validator refuses ``nn.LSTM`` and ``nn.GRU`` only).

    It has no grad sampler, and the functorch path sees the gradient of the first output only:
    a loss on the final hidden state ``h_n`` would reach the parameters without a per-sample
    norm (the replay also failed on its ``(B, T, H)`` output: "output with shape [1, 4] doesn't
    match the broadcast shape [4, 1, 4]").

    Raises:
        ValueError: Naming the replacement.
    """
    if any(p.requires_grad for p in layer.parameters()):
        raise ValueError(
            "nn.RNN is not supported by randomized clipping: it has no per-sample gradient "
            "sampler (its outputs are a tuple, and the functorch fallback cannot replay it). "
            "Use opacus.layers.DPRNN, a drop-in replacement whose RNNLinear cells have exact "
            "per-sample gradients (opacus.validators.ModuleValidator.fix does the swap for "
            "nn.LSTM and nn.GRU), or freeze it."
        )


class FunctorchGradSampler:
    """Per-sample gradients of one leaf layer by ``vmap(grad(...))`` (module docstring).

    Args:
        layer: The layer (its parameters are read at each call, never copied).
        batch_first: Whether the layer's inputs have the batch dimension first (else second,
            as for ``batch_first=False`` models); the stored inputs are always batch first.

    Raises:
        NotImplementedError: If the layer has buffers.
    """

    def __init__(self, layer: nn.Module, *, batch_first: bool = True) -> None:
        buffers = [name for name, _ in layer.named_buffers()]
        if buffers:
            raise NotImplementedError(
                f"{type(layer).__name__} has buffers ({buffers[:3]}) and no grad sampler: its "
                "per-sample gradient would be replayed by functorch, which would update them. "
                "Register a grad sampler for it, or freeze it"
            )
        self._stateless = copy.deepcopy(layer).to("meta")
        self._unsqueeze_dim = 0 if batch_first else 1

    def __call__(
        self, layer: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor
    ) -> dict[nn.Parameter, torch.Tensor]:
        """``{p: (B, *p.shape)}`` for every trainable parameter of ``layer`` (Opacus' grad
        sampler signature).

        Args:
            layer: The layer this sampler was built for.
            activations: Its stored inputs, batch first (all of them are passed to it).
            backprops: The gradient of its output, batch first, rescaled to per-sample losses.

        Returns:
            The per-sample gradients, in the output gradient's dtype.
        """
        names = [n for n, p in layer.named_parameters() if p.requires_grad]
        params = dict(layer.named_parameters())
        trainable = {n: params[n].detach() for n in names}
        frozen = {n: p.detach() for n, p in params.items() if n not in trainable}
        inputs = tuple(
            a.to(backprops.dtype) if a.is_floating_point() and a.dtype != backprops.dtype else a
            for a in activations
        )
        dim = self._unsqueeze_dim
        stateless = self._stateless
        # Opacus' mixed-precision rule: autocast to the input dtype if the parameters differ.
        mixed = (
            bool(inputs and trainable)
            and inputs[0].is_floating_point()
            and next(iter(trainable.values())).dtype != inputs[0].dtype
        )

        def inner(train: dict[str, torch.Tensor], acts: tuple[Any, ...], g: torch.Tensor) -> Any:
            one = tuple(a.unsqueeze(dim) for a in acts)
            autocast = (
                torch.autocast(device_type=g.device.type, dtype=acts[0].dtype)
                if mixed
                else contextlib.nullcontext()
            )
            with autocast:
                out = torch.func.functional_call(stateless, {**frozen, **train}, one)
            return (out * g.unsqueeze(dim)).sum()

        grads = torch.func.vmap(torch.func.grad(inner), in_dims=(None, 0, 0))(
            trainable, inputs, backprops
        )
        return {params[n]: grads[n] for n in names}
