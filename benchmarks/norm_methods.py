"""Per-sample gradient norm methods for one ``nn.Linear`` over sequences, as benchmarked.

Every method has the signature ``method(layer, A, G, *, k, generator) -> dict[param, (B,)]``
with ``A`` of shape ``(B, T, d)`` and ``G`` of shape ``(B, T, p)``, and returns per-sample
gradient **norms** per parameter, as the samplers of Opacus and opacus_rc do.

* ``ghost``: Opacus' ghost norm ``compute_linear_norm_sample`` (two ``B x T x T`` Grams; the
  bias branch recomputes ``G G^T``).
* ``fgc``: Opacus' per-sample gradients ``compute_linear_grad_sample`` then their norms: what
  Opacus' ghost mode does for layers without a norm sampler, ``2 B T p d`` FLOPs.
* ``mixed``: the per-layer rule of private-transformers and fastDP: ghost if ``2 T^2 <= p d``,
  else materialize (``fgc``).
* ``hutchinson`` and ``hutch++``: opacus_rc's sketched sampler
  ``compute_linear_sketched_norm_sample`` with that estimator and ``k`` columns (Hutch++ head
  ``s = k``). The bias norm is exact in all methods.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from opacus.grad_sample.linear import compute_linear_grad_sample, compute_linear_norm_sample
from torch import nn

from opacus_rc.grad_sample.linear import compute_linear_sketched_norm_sample
from opacus_rc.sketching import get_estimator

Norms = dict[nn.Parameter, torch.Tensor]
EXACT_METHODS = ("ghost", "fgc", "mixed")
SKETCH_METHODS = ("hutchinson", "hutch++")
METHODS = EXACT_METHODS + SKETCH_METHODS


def ghost(layer: nn.Linear, A: torch.Tensor, G: torch.Tensor, **_: object) -> Norms:
    return compute_linear_norm_sample(layer, [A], G)


def fgc(layer: nn.Linear, A: torch.Tensor, G: torch.Tensor, **_: object) -> Norms:
    grads = compute_linear_grad_sample(layer, [A], G)
    # As GradSampleModuleFastGradientClipping does for layers without a norm sampler.
    return {p: g.reshape(len(g), -1).norm(2, dim=-1) for p, g in grads.items()}


def mixed_choice(T: int, p: int, d: int) -> str:
    """The exact method the fastDP / private-transformers rule uses for this layer."""
    return "ghost" if p * d >= 2 * T * T else "fgc"


def mixed(layer: nn.Linear, A: torch.Tensor, G: torch.Tensor, **_: object) -> Norms:
    choice = mixed_choice(A.shape[1], layer.out_features, layer.in_features)
    return (ghost if choice == "ghost" else fgc)(layer, A, G)


def sketched(name: str) -> Callable[..., Norms]:
    """opacus_rc's sampler with estimator ``name``; Hutch++ uses ``head_dim = k``."""
    estimator = get_estimator(name)

    def method(
        layer: nn.Linear,
        A: torch.Tensor,
        G: torch.Tensor,
        *,
        k: int,
        generator: torch.Generator | None = None,
        **_: object,
    ) -> Norms:
        return compute_linear_sketched_norm_sample(
            layer, [A], G, estimator=estimator, sketch_dim=k, generator=generator
        )

    method.__name__ = name
    return method


def get_method(name: str) -> Callable[..., Norms]:
    table: dict[str, Callable[..., Norms]] = {"ghost": ghost, "fgc": fgc, "mixed": mixed}
    if name in table:
        return table[name]
    if name in SKETCH_METHODS:
        return sketched(name)
    raise ValueError(f"unknown norm method {name!r}; allowed: {', '.join(METHODS)}")


# ----------------------------------------------------------------------------------------------
# Closed forms (docs/privacy/estimators.md#estimators-setup for the sketches; for the Gram-matrix
# path, the ghost norm of nn.Linear: Li, Tramer, Liang and Hashimoto, ICLR 2022, as in Opacus);
# FLOPs as FlopCounterMode counts them (2 per multiply-add, matrix products only)
# ----------------------------------------------------------------------------------------------


def closed_form_flops(
    method: str, *, B: int, T: int, d: int, p: int, k: int | None, bias: bool
) -> int:
    """FLOPs of the matrix products of a method, as ``FlopCounterMode`` counts them.

    * ghost: ``2BT^2 d`` (``A A^T``) + ``2BT^2 p`` (``G G^T``) + ``2BT^2`` (their inner
      product) + ``2BT^2 p`` for the bias (``G G^T`` again).
    * fgc: ``2BTpd`` (the bias gradient is a sum over ``T``, not a product).
    * hutchinson: ``2BTk(p + d)``: ``U = G Omega`` then ``V^T = U^T A``; the exact bias norm is
      a reduction (``B T p`` additions, not counted).
    * hutch++ (``s = k`` head columns): ``2BT(3s + k)(p + d) + 4Bkds``; the ``d x s`` QR is not
      counted.
    """
    if method == "mixed":
        method = mixed_choice(T, p, d)
    if method == "ghost":
        return 2 * B * T * T * (d + p) + 2 * B * T * T + (2 * B * T * T * p if bias else 0)
    if method == "fgc":
        return 2 * B * T * p * d
    if method == "hutchinson":
        return 2 * B * T * k * (p + d)
    if method == "hutch++":
        s = k
        return 2 * B * T * (3 * s + k) * (p + d) + 4 * B * k * d * s
    raise ValueError(f"unknown norm method {method!r}")


def estimated_extra_bytes(
    method: str, *, B: int, T: int, d: int, p: int, k: int | None, bias: bool, itemsize: int = 4
) -> int:
    """Rough upper estimate of the extra memory of a method (to decide what fits, ahead)."""
    if method == "mixed":
        method = mixed_choice(T, p, d)
    if method == "ghost":
        return itemsize * B * T * T * (3 + (1 if bias else 0))
    if method == "fgc":
        return itemsize * B * (p * d + p) * 2
    s = k if method == "hutch++" else 0
    return itemsize * B * ((k + 2 * s) * (T + p + d) + 4 * (T + d + p))


# ----------------------------------------------------------------------------------------------
# Unit-level norms: the norm of the gradient summed over a unit's windows (issue 23)
# ----------------------------------------------------------------------------------------------

UNIT_METHODS = ("rc_unit", "ghost_unit", "per_sample_unit")


def concatenate_unit(X: torch.Tensor) -> torch.Tensor:
    """A unit's ``m`` windows ``(m, T, n)`` as one sequence ``(1, m T, n)``.

    For an ``nn.Linear``, the unit's summed weight gradient ``sum_j A_j^T G_j`` is the
    per-sample gradient of the windows concatenated along the token axis.
    """
    return X.reshape(1, X.shape[0] * X.shape[1], X.shape[-1])


def per_sample_unit(layer: nn.Linear, A: torch.Tensor, G: torch.Tensor, **_: object) -> Norms:
    """Opacus' per-sample gradients of the unit's ``m`` windows ``(m, p, d)``, summed over the
    windows, then the norm of the sum: ``{param: (1,)}``."""
    grads = compute_linear_grad_sample(layer, [A], G)
    return {p: g.sum(0).reshape(1, -1).norm(2, dim=-1) for p, g in grads.items()}


def get_unit_method(name: str) -> Callable[..., Norms]:
    """Per-unit norm of ``name`` on a unit's windows ``A (m, T, d)``, ``G (m, T, p)``.

    * ``rc_unit``: opacus_rc's Hutchinson sampler on the concatenated unit, one probe matrix
      for the unit: ``2 m T k (p + d)`` FLOPs.
    * ``ghost_unit``: Opacus' ghost norm on the concatenated unit, ``(m T) x (m T)`` Grams.
    * ``per_sample_unit``: :func:`per_sample_unit`, ``2 m T p d`` FLOPs and ``m p d`` floats.

    Raises:
        ValueError: If ``name`` is not one of :data:`UNIT_METHODS`.
    """
    if name == "per_sample_unit":
        return per_sample_unit
    inner = {"rc_unit": "hutchinson", "ghost_unit": "ghost"}.get(name)
    if inner is None:
        raise ValueError(f"unknown unit norm method {name!r}; allowed: {', '.join(UNIT_METHODS)}")
    method = get_method(inner)

    def on_unit(layer: nn.Linear, A: torch.Tensor, G: torch.Tensor, **kwargs: object) -> Norms:
        return method(layer, concatenate_unit(A), concatenate_unit(G), **kwargs)

    on_unit.__name__ = name
    return on_unit


def unit_closed_form_flops(method: str, *, m: int, T: int, d: int, p: int, k: int) -> int:
    """FLOPs of a unit method (no bias) as ``FlopCounterMode`` counts them: ``rc_unit`` and
    ``ghost_unit`` are :func:`closed_form_flops` at ``B = 1`` over ``m T`` tokens,
    ``per_sample_unit`` is ``fgc`` at ``B = m`` (the sum over windows is not a product)."""
    if method == "per_sample_unit":
        return closed_form_flops("fgc", B=m, T=T, d=d, p=p, k=None, bias=False)
    inner = {"rc_unit": "hutchinson", "ghost_unit": "ghost"}[method]
    return closed_form_flops(inner, B=1, T=m * T, d=d, p=p, k=k, bias=False)
