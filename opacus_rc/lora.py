r"""A guard against LoRA adapters that silently never change under DP training.

Opacus issue 820 (meta-pytorch/opacus#820, open): with peft LoRA,
loss and epsilon look normal but the trained adapters are unusable. The diagnosis in that thread
(and in opacus PR #830) is device placement: ``model.to(device)`` *after* ``get_peft_model()``,
which can leave the adapters the optimizer updates apart from the ones the forward pass uses. Any
such disconnect shows up at the first step: the LoRA update

.. math::  \Delta W_\ell = s_\ell\, B_\ell A_\ell

(``s`` = peft's ``scaling``, ``A``/``B`` the ``lora_A``/``lora_B`` factors) of an adapted layer
``l`` does not move, or moves to NaN/inf. :class:`LoRAUpdateGuard` snapshots the factors before
training and, after the first optimizer step, checks for every adapted layer that

.. math::  0 < \|\Delta W_\ell^{after} - \Delta W_\ell^{before}\|_F < \infty .

Why every layer: under DP-SGD every trainable parameter receives Gaussian noise at every step,
so a trainable adapter that did not move was not updated at all (with ``noise_multiplier > 0``;
with zero noise, an adapter whose gradient is exactly zero would also be reported). Why
``B A`` and not the factors: at peft's default initialisation ``B = 0``, so ``A`` may legitimately
have a zero gradient at step 1, while ``B A`` moves as soon as ``B`` does.

The guard reads the ``lora_A``/``lora_B`` ``ModuleDict``\ s (and ``lora_embedding_A``/``_B``
``ParameterDict``\ s) and ``scaling`` of peft's ``LoraLayer`` by duck typing, so this module does
not import peft. Layers whose factors are frozen (``requires_grad=False``) are not checked.

Example:
    >>> guard = LoRAUpdateGuard(peft_model)  # doctest: +SKIP
    >>> ... one DP training step ...         # doctest: +SKIP
    >>> report = guard.check()  # raises LoRAUpdateError if stuck  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["LoRAUpdateError", "LoRAUpdateGuard", "LoRAUpdateReport", "lora_factors"]

logger = logging.getLogger(__name__)


class LoRAUpdateError(RuntimeError):
    """The LoRA update after a training step is zero or non-finite (see
    :class:`LoRAUpdateGuard`)."""


@dataclass(frozen=True)
class _Adapter:
    """One trainable adapter of one layer: ``Delta W = scaling * B @ A`` (factors flattened)."""

    name: str
    A: Tensor  # the live parameter, (r, ...) -> flattened to (r, d_in)
    B: Tensor  # the live parameter, (d_out, r, ...) or (d_out, r)
    scaling: float


def _as_matrices(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """Flatten factor shapes to ``A: (r, d_in)``, ``B: (d_out, r)`` (Linear, Embedding, Conv)."""
    r = A.shape[0]
    return A.reshape(r, -1), B.reshape(B.shape[0], -1)


def _iter_adapters(model: nn.Module) -> Iterator[_Adapter]:
    for module_name, module in model.named_modules():
        lora_A, lora_B = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
        scaling = getattr(module, "scaling", None)
        if not isinstance(scaling, dict):
            continue
        pairs: list[tuple[str, Tensor, Tensor]] = []
        if isinstance(lora_A, nn.ModuleDict) and isinstance(lora_B, nn.ModuleDict):
            for key in lora_A:
                if key in lora_B:
                    pairs.append((key, lora_A[key].weight, lora_B[key].weight))
        emb_A = getattr(module, "lora_embedding_A", None)
        emb_B = getattr(module, "lora_embedding_B", None)
        if isinstance(emb_A, nn.ParameterDict) and isinstance(emb_B, nn.ParameterDict):
            for key in emb_A:
                if key in emb_B:
                    pairs.append((key, emb_A[key], emb_B[key]))
        for key, A, B in pairs:
            if A.requires_grad or B.requires_grad:
                yield _Adapter(
                    name=f"{module_name or '<root>'}[{key}]",
                    A=A,
                    B=B,
                    scaling=float(scaling.get(key, 1.0)),
                )


def lora_factors(model: nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """The trainable LoRA factor pairs of a peft model, by ``"<module name>[<adapter>]"``.

    Args:
        model: A peft model (or any module containing peft ``LoraLayer``\\ s), possibly wrapped
            (e.g. by Opacus' ``GradSampleModule``).

    Returns:
        ``{name: (A, B)}`` with the *live* parameters (not copies), in module order. Adapters
        whose factors are both frozen are left out.
    """
    return {a.name: (a.A, a.B) for a in _iter_adapters(model)}


@dataclass(frozen=True)
class LoRAUpdateReport:
    """Result of :meth:`LoRAUpdateGuard.check`.

    Attributes:
        update_norms: ``{adapter name: ||Delta W_after - Delta W_before||_F}`` (float64 math),
            one entry per trainable adapter.
    """

    update_norms: dict[str, float]

    @property
    def min_norm(self) -> float:
        """The smallest update norm over adapters."""
        return min(self.update_norms.values())

    @property
    def max_norm(self) -> float:
        """The largest update norm over adapters."""
        return max(self.update_norms.values())


class LoRAUpdateGuard:
    r"""Check that a training step moved every trainable LoRA adapter by a finite, non-zero amount.

    Construct it before the first step (it copies the factors, ``r * (d_in + d_out)`` numbers per
    adapter), then call :meth:`check` after the first ``optimizer.step()``, or let
    :meth:`attach` call it automatically after the first step that is not skipped.

    Args:
        model: The peft model whose adapters the forward pass uses (the object you train with,
            or the module inside a ``GradSampleModule``).

    Raises:
        ValueError: If ``model`` has no trainable peft LoRA adapter.
        LoRAUpdateError: At construction, if a factor is already non-finite.

    Example:
        >>> guard = LoRAUpdateGuard(model)                    # doctest: +SKIP
        >>> model, optimizer, criterion, loader = engine.make_private(...)  # doctest: +SKIP
        >>> guard.attach(optimizer)                           # doctest: +SKIP
    """

    def __init__(self, model: nn.Module) -> None:
        adapters = list(_iter_adapters(model))
        if not adapters:
            raise ValueError(
                "the model has no trainable peft LoRA adapter (no module with lora_A/lora_B and "
                "a scaling dict whose factors require grad); wrap it with peft.get_peft_model "
                "first"
            )
        self._adapters = adapters
        self._before = {a.name: self._snapshot(a) for a in adapters}
        bad = [name for name, (A, B) in self._before.items() if not _finite(A, B)]
        if bad:
            raise LoRAUpdateError(f"LoRA factors are already non-finite before training: {bad}")
        self.last_report: LoRAUpdateReport | None = None

    @staticmethod
    def _snapshot(adapter: _Adapter) -> tuple[Tensor, Tensor]:
        A, B = _as_matrices(adapter.A.detach(), adapter.B.detach())
        return A.to(torch.float64, copy=True), B.to(torch.float64, copy=True)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """Names of the adapters checked, ``"<module name>[<adapter>]"``."""
        return tuple(a.name for a in self._adapters)

    def parameters(self) -> list[Tensor]:
        """The live LoRA factor parameters that require grad (to compare with an optimizer's)."""
        return [p for a in self._adapters for p in (a.A, a.B) if p.requires_grad]

    def check_optimizer(self, optimizer: Any) -> None:
        """Raise if a trainable LoRA factor is not among ``optimizer``'s parameters.

        This is the direct form of the issue-820 disconnect: the optimizer would update tensors
        the forward pass does not use (or the adapters would never be updated).

        Args:
            optimizer: A ``torch.optim.Optimizer`` or an Opacus ``DPOptimizer``.

        Raises:
            LoRAUpdateError: Naming the first adapters whose factors the optimizer does not hold.
        """
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [
            a.name
            for a in self._adapters
            if any(p.requires_grad and id(p) not in held for p in (a.A, a.B))
        ]
        if missing:
            raise LoRAUpdateError(
                f"the optimizer does not hold the LoRA factors the model uses for {missing[:5]} "
                f"({len(missing)} adapter(s)). Create the optimizer from the peft model's "
                "parameters after all device placement: move the model with .to(device) *before* "
                "get_peft_model() (Opacus issue 820), then build the optimizer and call "
                "make_private."
            )

    def check(self) -> LoRAUpdateReport:
        r"""Compare the adapters with the snapshot taken at construction.

        For each adapter, :math:`\|s(B'A' - BA)\|_F` with ``B'A' - BA = (B'-B)A' + B(A'-A)``,
        computed in float64 one layer at a time.

        Returns:
            The :class:`LoRAUpdateReport` (also stored as ``last_report``).

        Raises:
            LoRAUpdateError: If any adapter's factors are non-finite, or any adapter's update is
                exactly zero (the message names them and the likely cause).
        """
        norms: dict[str, float] = {}
        non_finite: list[str] = []
        for adapter in self._adapters:
            A0, B0 = self._before[adapter.name]
            A1, B1 = (
                t.to(torch.float64) for t in _as_matrices(adapter.A.detach(), adapter.B.detach())
            )
            if not _finite(A1, B1):
                non_finite.append(adapter.name)
                continue
            delta = ((B1 - B0) @ A1 + B0 @ (A1 - A0)) * adapter.scaling
            norm = float(torch.linalg.matrix_norm(delta))
            if not math.isfinite(norm):
                non_finite.append(adapter.name)
                continue
            norms[adapter.name] = norm
        if non_finite:
            raise LoRAUpdateError(
                f"the LoRA update is non-finite (NaN or inf) for {non_finite[:5]} "
                f"({len(non_finite)} of {len(self._adapters)} adapters) after the first step: "
                "lower the learning rate, check the loss for NaN/inf, or avoid float16 overflow"
            )
        zero = [name for name, norm in norms.items() if norm == 0.0]
        if zero:
            raise LoRAUpdateError(
                f"the LoRA update is exactly zero for {zero[:5]} ({len(zero)} of "
                f"{len(self._adapters)} adapters) after the first step: the optimizer did not "
                "update the adapters the model uses. Known cause (Opacus issue 820): moving the "
                "model with .to(device) after get_peft_model(); move it before, then build the "
                "optimizer and call make_private. Also check the learning rate is > 0."
            )
        report = LoRAUpdateReport(update_norms=norms)
        self.last_report = report
        logger.info(
            "LoRA update after the first step: %d adapters, ||Delta W||_F in [%.3g, %.3g]",
            len(norms),
            report.min_norm,
            report.max_norm,
        )
        return report

    def attach(self, optimizer: Any) -> Any:
        """Run :meth:`check` once, right after the first optimizer step that is taken.

        Also runs :meth:`check_optimizer` immediately. The check is a post-step hook on the
        wrapped ``torch.optim.Optimizer`` (``optimizer.original_optimizer`` for an Opacus
        ``DPOptimizer``), so it runs after the parameters are updated and only for steps that
        are not skipped (gradient accumulation); it removes itself after running.

        Args:
            optimizer: The DP optimizer returned by ``make_private`` (or a plain optimizer).

        Returns:
            The ``torch.utils.hooks.RemovableHandle`` of the hook.

        Raises:
            LoRAUpdateError: From :meth:`check_optimizer` now, or from :meth:`check` when the
                first step is taken (raised out of ``optimizer.step()``).
        """
        self.check_optimizer(optimizer)
        inner = getattr(optimizer, "original_optimizer", optimizer)
        handle: Any = None

        def _after_first_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            handle.remove()
            self.check()

        handle = inner.register_step_post_hook(_after_first_step)
        return handle


def _finite(*tensors: Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)
