"""The norm-path resolver: how each hooked module's per-sample norm is computed
(docs/architecture.md#architecture-step, step 3).

Every decision about *how* a module's per-sample gradient norm is obtained is made here, once,
when the grad-sample module is built, and then used by every consumer: the backward hook
(which function runs), book-keeping (whether one backward pass can serve), the log line (what
the user is told) and the per-module report :attr:`NormRoute.accounted` (what the step is
accounted for). The paths:

* ``sketched``: a type registered in
  :data:`~opacus_rc.grad_sample.registry.SKETCHED_NORM_SAMPLERS` (e.g. ``nn.Linear``): the
  norm is a sketch with the module's :class:`~opacus_rc.sketching.SketchSpec`;
* ``exact``: a type registered there with ``exact=True`` (an exact norm by a project sampler);
* ``grad_sampler``: Opacus' per-sample gradients (``LayerNorm``, ``RMSNorm``, ``Conv``...), the
  norm exact;
* ``ghost``: Opacus' ghost norm (no per-sample gradient: book-keeping impossible);
* ``functorch``: exact per-sample gradients by ``torch.func`` for a leaf module without a
  sampler (:class:`~opacus_rc.grad_sample.functorch.FunctorchGradSampler`, every input passed),
  and for a module whose Opacus sampler is not faithful for its configuration
  (:func:`opacus_sampler_limit`: ``nn.Conv*`` with ``padding_mode`` other than ``"zeros"``,
  which Opacus pads with zeros; ``nn.LayerNorm(bias=False)``, on which it raises);
* ``tied``: one of the two modules of a :class:`TiedGroup` (an ``nn.Embedding`` whose weight
  is also an ``nn.Linear``'s weight: an input embedding tied to a language-model head). The
  shared weight's norm is that of the *summed* gradient, sketched jointly by
  :mod:`~opacus_rc.grad_sample.tied` (Hutchinson, ``k = sketch_dim`` columns); every other
  tying is refused (:func:`~opacus_rc.grad_sample.checks.check_tied_parameters`);
* ``refused``: a module whose per-sample norm cannot be computed faithfully; building the
  grad-sample module raises :class:`UnsupportedModuleError` naming it.

A module with trainable parameters of its own, no sampler and trainable descendants is refused:
Opacus would compute its whole subtree with functorch (its ``nn.Linear`` children would not be
sketched although they look it, and randomness inside it, such as dropout, cannot be replayed
by ``vmap``). Exact norms inside a sketched step are covered by the RC accountant
(docs/privacy/hutchpp.md#hutchpp-privacy, Lemma D), so a step mixing paths is accounted with the
module's sketch spec.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opacus.layers.dp_rnn import DPGRU, DPLSTM, DPRNN
from torch import nn

from opacus_rc._compat.opacus import fsdp_base_type
from opacus_rc.sketching import SketchSpec

__all__ = [
    "NormPath",
    "NormRoute",
    "TiedGroup",
    "UnsupportedModuleError",
    "bookkeeping_blockers",
    "find_tied_groups",
    "opacus_sampler_limit",
    "refuse_unsupported",
    "resolve_norm_routes",
]

#: Opacus' DP recurrent layers are hooked through their ``RNNLinear`` children.
_RNN_CONTAINERS = (DPRNN, DPLSTM, DPGRU)


def opacus_sampler_limit(module: nn.Module) -> str | None:
    """Why Opacus' grad sampler of ``module``'s type is not faithful for its configuration.

    Found by the oracle sweep (tests/reliability/test_round3_grad_samplers.py): ``nn.Conv1d``,
    ``nn.Conv2d`` and ``nn.Conv3d`` with ``padding_mode`` other than ``"zeros"`` (Opacus pads
    with zeros), ``nn.LayerNorm`` with a weight and no bias (Opacus reads
    ``layer.bias.requires_grad``). Such a module takes the functorch path, whose per-sample
    gradients replay the module's own forward. By exact type, as Opacus looks up its samplers.

    Args:
        module: Any module.

    Returns:
        The reason, or ``None`` if Opacus' sampler (if any) is faithful for ``module``.
    """
    t = type(module)
    mode = getattr(module, "padding_mode", "zeros")
    if t in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and mode != "zeros":
        return (
            f"Opacus' convolution sampler pads the input with zeros, not with "
            f"padding_mode={mode!r} (its per-sample gradients would be wrong)"
        )
    no_bias = getattr(module, "weight", None) is not None and getattr(module, "bias", 0) is None
    if t is nn.LayerNorm and no_bias:
        return "Opacus' LayerNorm sampler reads layer.bias.requires_grad, and bias=False"
    return None


class UnsupportedModuleError(NotImplementedError):
    """A trainable module whose per-sample norm the library cannot compute faithfully."""


class NormPath(str, enum.Enum):
    """How one module's per-sample gradient norm is computed (see the module docstring)."""

    SKETCHED = "sketched"
    EXACT = "exact"
    GRAD_SAMPLER = "grad_sampler"
    GHOST = "ghost"
    FUNCTORCH = "functorch"
    TIED = "tied"
    REFUSED = "refused"

    @property
    def per_sample_gradients(self) -> bool:
        """Whether this path materialises per-sample gradients (book-keeping keeps them)."""
        return self in (NormPath.GRAD_SAMPLER, NormPath.FUNCTORCH)


@dataclass(frozen=True)
class NormRoute:
    """The resolved norm path of one hooked module.

    Attributes:
        name: The module's qualified name in the model (``"<root>"`` for the model itself).
        module_type: ``type(module).__name__``.
        path: The :class:`NormPath`.
        has_clipped_sum: Whether a book-keeping clipped-sum function exists for this path.
        reason: Why the module is refused (``path`` is ``REFUSED``), or why a module with an
            Opacus grad sampler takes the functorch path instead (:func:`opacus_sampler_limit`),
            else ``None``.
        tied_with: The name of the other module of its :class:`TiedGroup` (``path`` is
            ``TIED``), else ``None``.
    """

    name: str
    module_type: str
    path: NormPath
    has_clipped_sum: bool
    reason: str | None = None
    tied_with: str | None = None

    @property
    def supports_bookkeeping(self) -> bool:
        """Whether this module's clipped gradient sum can be formed without a second pass."""
        return self.path.per_sample_gradients or self.has_clipped_sum

    def accounted(self, spec: SketchSpec) -> SketchSpec | None:
        """The sketch this module's norm is a sample of (``None``: an exact norm).

        A tied weight's joint sketch is a Hutchinson sketch with ``spec.sketch_dim`` columns,
        certified by the same envelope (``k = spec.accounted_dim``,
        docs/privacy/envelope.md#envelope-definition and D).
        """
        return spec if self.path in (NormPath.SKETCHED, NormPath.TIED) else None

    def describe(self, spec: SketchSpec) -> str:
        """The log text for this route, e.g. ``"sketched (hutchinson, k=32)"``."""
        if self.path is NormPath.SKETCHED:
            return f"sketched ({spec.estimator}, k={spec.sketch_dim})"
        if self.path is NormPath.TIED:
            return (
                f"tied with '{self.tied_with}': the summed gradient of the shared weight "
                f"sketched jointly (hutchinson, k={spec.sketch_dim}); other parameters exact"
            )
        return {
            NormPath.EXACT: "exact (opacus_rc sampler, no sketch)",
            NormPath.GRAD_SAMPLER: "exact per-sample gradients (Opacus grad sampler)",
            NormPath.GHOST: "exact ghost norm (Opacus)",
            NormPath.FUNCTORCH: "exact per-sample gradients (functorch fallback)"
            + (f": {self.reason}" if self.reason else ""),
            NormPath.REFUSED: f"refused: {self.reason}",
        }[self.path]


@dataclass(frozen=True, eq=False)
class TiedGroup:
    """A trainable weight shared by one ``nn.Embedding`` and one ``nn.Linear`` (a tied LM head).

    ``embedding.weight is linear.weight`` (``V x d``): the embedding maps ids to ``d``-vectors
    and the linear layer maps ``d``-vectors to ``V`` logits. Each module must run once per step
    (enforced at forward time).

    Attributes:
        weight: The shared parameter.
        embedding: The ``nn.Embedding``.
        linear: The ``nn.Linear`` (its bias, if trainable, is its own).
        embedding_name: Qualified name of the embedding.
        linear_name: Qualified name of the linear layer.
    """

    weight: nn.Parameter
    embedding: nn.Embedding
    linear: nn.Linear
    embedding_name: str
    linear_name: str

    @property
    def modules(self) -> tuple[nn.Module, nn.Module]:
        """``(embedding, linear)``."""
        return self.embedding, self.linear


def find_tied_groups(hooked: Iterable[nn.Module], *, names: Mapping[int, str]) -> list[TiedGroup]:
    """The supported tyings among ``hooked``: a weight shared by exactly one ``nn.Embedding``
    and one ``nn.Linear`` (exact types, or FSDP2's ``FSDPEmbedding`` and ``FSDPLinear`` of a
    ``fully_shard([embedding, head])``), as their ``weight``, with no other trainable parameter
    of either module shared.

    Any other sharing of a trainable parameter (two ``nn.Linear``, three owners, a tied bias,
    a subclass...) is left out, and refused by
    :func:`~opacus_rc.grad_sample.checks.check_tied_parameters` when a norm-sampled module
    takes part.

    Args:
        hooked: The hooked modules.
        names: ``id(module) -> qualified name``.

    Returns:
        The groups, in the order of the hooked modules.
    """
    owners: dict[int, list[nn.Module]] = {}
    params: dict[int, nn.Parameter] = {}
    for module in hooked:
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                users = owners.setdefault(id(p), [])
                if all(u is not module for u in users):
                    users.append(module)
                params[id(p)] = p
    groups = []
    for pid, users in owners.items():
        if len(users) != 2:
            continue
        # FSDP2's per-module classes unwrapped: fully_shard([embedding, head]) makes them
        # FSDPEmbedding and FSDPLinear, the one grouping FSDP2 accepts for a tied weight.
        emb = next((u for u in users if fsdp_base_type(u) is nn.Embedding), None)
        lin = next((u for u in users if fsdp_base_type(u) is nn.Linear), None)
        if emb is None or lin is None or not (emb.weight is params[pid] is lin.weight):
            continue
        others = [p for p in lin.parameters(recurse=False) if p.requires_grad and id(p) != pid]
        if any(len(owners.get(id(p), ())) > 1 for p in others):
            continue  # e.g. the head's bias tied elsewhere too: refused
        groups.append(
            TiedGroup(
                weight=params[pid],
                embedding=emb,
                linear=lin,
                embedding_name=names.get(id(emb)) or "<root>",
                linear_name=names.get(id(lin)) or "<root>",
            )
        )
    return groups


def _resolve_path(
    module: nn.Module,
    *,
    sketched: Mapping[type, Any],
    exact_types: Iterable[type],
    grad_samplers: Mapping[type, Any],
    norm_samplers: Mapping[type, Any],
    force_functorch: bool,
) -> NormPath:
    t = type(module)
    if t in sketched:
        return NormPath.EXACT if t in exact_types else NormPath.SKETCHED
    if t in norm_samplers:
        return NormPath.GHOST
    if t in grad_samplers and not force_functorch and opacus_sampler_limit(module) is None:
        return NormPath.GRAD_SAMPLER
    return NormPath.FUNCTORCH


def _subtree_trainable(module: nn.Module) -> list[str]:
    """Names of trainable parameters strictly below ``module`` (not its own)."""
    return [
        f"{child_name}.{pname}"
        for child_name, child in module.named_children()
        for pname, p in child.named_parameters()
        if p.requires_grad
    ]


def resolve_norm_routes(
    hooked: Iterable[nn.Module],
    *,
    names: Mapping[int, str],
    sketched: Mapping[type, Any],
    exact_types: Iterable[type],
    clipped_sums: Mapping[type, Any],
    grad_samplers: Mapping[type, Any],
    norm_samplers: Mapping[type, Any],
    force_functorch: bool,
    tied: Iterable[TiedGroup] = (),
) -> dict[int, NormRoute]:
    """Resolve the norm path of every hooked module (the one place such decisions are made).

    Args:
        hooked: The modules Opacus attaches hooks to (``iterate_submodules``).
        names: ``id(module) -> qualified name``.
        sketched: The project's sampler registry (type -> sampler).
        exact_types: Types in ``sketched`` whose sampler is exact.
        clipped_sums: The project's clipped-sum registry (type -> function).
        grad_samplers: Opacus' per-sample gradient samplers (type -> sampler).
        norm_samplers: Opacus' ghost norm samplers (type -> sampler).
        force_functorch: Opacus' ``force_functorch`` (functorch for every non-sketched type).
        tied: The supported tyings (:func:`find_tied_groups`); both modules of each are routed
            ``TIED``.

    Returns:
        ``{id(module): NormRoute}``; Opacus' recurrent containers (``DPRNN``...), hooked
        through their children, are left out.
    """
    exact = frozenset(exact_types)
    partner: dict[int, str] = {}
    for group in tied:
        partner[id(group.embedding)] = group.linear_name
        partner[id(group.linear)] = group.embedding_name
    routes: dict[int, NormRoute] = {}
    for module in hooked:
        if isinstance(module, _RNN_CONTAINERS):
            continue
        t = type(module)
        if id(module) in partner:
            routes[id(module)] = NormRoute(
                name=names.get(id(module)) or "<root>",
                module_type=t.__name__,
                path=NormPath.TIED,
                has_clipped_sum=t in clipped_sums,
                tied_with=partner[id(module)],
            )
            continue
        path = _resolve_path(
            module,
            sketched=sketched,
            exact_types=exact,
            grad_samplers=grad_samplers,
            norm_samplers=norm_samplers,
            force_functorch=force_functorch,
        )
        reason = opacus_sampler_limit(module) if path is NormPath.FUNCTORCH else None
        if path is NormPath.FUNCTORCH:
            below = _subtree_trainable(module)
            if below:
                path = NormPath.REFUSED
                own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
                reason = (
                    f"it owns trainable parameter(s) {own[:3]} directly and has trainable "
                    f"submodule parameters ({below[:3]}); its per-sample gradient would need "
                    "functorch over the whole subtree, which neither sketches its layers nor "
                    "replays randomness such as dropout. Move the direct parameter(s) into a "
                    "leaf module of their own, freeze them, or register a grad sampler for "
                    f"{type(module).__name__}"
                )
        has_sum = t in clipped_sums if path in (NormPath.SKETCHED, NormPath.EXACT) else False
        routes[id(module)] = NormRoute(
            name=names.get(id(module)) or "<root>",
            module_type=t.__name__,
            path=path,
            has_clipped_sum=has_sum,
            reason=reason,
        )
    return routes


def refuse_unsupported(routes: Mapping[int, NormRoute]) -> None:
    """Raise :class:`UnsupportedModuleError` if any route is refused.

    Raises:
        UnsupportedModuleError: Naming every refused module and why.
    """
    refused = [r for r in routes.values() if r.path is NormPath.REFUSED]
    if refused:
        lines = "; ".join(f"'{r.name}' ({r.module_type}): {r.reason}" for r in refused[:3])
        raise UnsupportedModuleError(
            f"randomized clipping cannot compute the per-sample norm of {len(refused)} "
            f"module(s): {lines}"
        )


def bookkeeping_blockers(routes: Mapping[int, NormRoute]) -> list[str]:
    """Why book-keeping (one backward pass) cannot be used: one line per route that does not
    support it (:attr:`NormRoute.supports_bookkeeping`), in route order; empty if every route
    does."""
    return [
        f"'{r.name}' ({r.module_type}): "
        + (
            "Opacus ghost norm, no per-sample gradient"
            if r.path is NormPath.GHOST
            else "sketched norm without a clipped-sum function"
        )
        for r in routes.values()
        if not r.supports_bookkeeping
    ]
