"""Model hygiene and parameter-use checks of randomized clipping (tests/reliability/CATALOGUE.md).

* :func:`check_training_mode`: Opacus' hooks skip eval-mode modules, whose gradients would then
  have no per-sample norm.
* :func:`check_peft_dora`: PEFT's DoRA layers run their LoRA factors twice per forward.
* :func:`check_parametrizations`: a parametrized weight (``weight_norm``, ``spectral_norm``) is
  computed outside the forward of the module that uses it.
* :func:`check_tied_parameters`: a trainable parameter shared between a norm-sampled module and
  another one cannot be measured per module (except an embedding tied to an LM head, whose
  joint norm :mod:`~opacus_rc.grad_sample.tied` sketches).
* :class:`TrainableSetGuard`: the set of trainable parameters, and which module owns each, is
  recorded when the hooks are attached and compared at every private backward: a parameter
  unfrozen, tied or replaced after ``make_private`` raises instead of training unclipped.
* :class:`ParameterUseCheck`: a trainable parameter used outside the forward of the module that
  owns it (``F.linear(h, model.fc.weight)``) raises before the backward pass.
* :func:`strip_grad_sample_hooks`: remove every hook and attribute after a failure.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from opacus.grad_sample.gsm_base import OPACUS_PARAM_MONKEYPATCH_ATTRS
from opacus.utils.module_utils import trainable_modules
from torch import nn
from torch.nn.utils import parametrize

from opacus_rc._compat.torch import autograd_sequence_nr
from opacus_rc.grad_sample.checkpointing import REENTRANT_NODE
from opacus_rc.grad_sample.routing import UnsupportedModuleError

__all__ = [
    "ParameterUseCheck",
    "TrainableSetGuard",
    "check_parametrizations",
    "check_peft_dora",
    "check_tied_parameters",
    "check_training_mode",
    "strip_grad_sample_hooks",
]

#: Attributes Opacus adds to submodules.
_MODULE_ATTRS = ("activations", "max_batch_len", "ft_compute_sample_grad")


def strip_grad_sample_hooks(module: nn.Module) -> None:
    """Remove every Opacus/opacus_rc hook and attribute from ``module``.

    For failure paths, where no hooks object may exist to call ``cleanup()`` on. Opacus keeps
    the hook handles in ``module.autograd_grad_sample_hooks`` and adds the attributes in
    ``OPACUS_PARAM_MONKEYPATCH_ATTRS`` to parameters and ``activations``/``max_batch_len``/
    ``ft_compute_sample_grad`` to submodules.
    """
    handles = getattr(module, "autograd_grad_sample_hooks", None)
    if handles is not None:
        while handles:
            handles.pop().remove()
        delattr(module, "autograd_grad_sample_hooks")
    for p in module.parameters():
        for attr in OPACUS_PARAM_MONKEYPATCH_ATTRS:
            if hasattr(p, attr):
                delattr(p, attr)
    for sub in module.modules():
        for attr in _MODULE_ATTRS:
            if attr in sub.__dict__:
                delattr(sub, attr)


def check_training_mode(module: nn.Module) -> None:
    """Raise if ``module`` or any submodule with trainable parameters is in eval mode.

    Raises:
        ValueError: Naming the offending modules and telling the caller to call ``train()``.
    """
    if not module.training:
        raise ValueError(
            "the model is in eval mode; randomized clipping needs per-sample norms that are "
            "only recorded in training mode: call model.train() before make_private / before "
            "wrapping the model"
        )
    in_eval = [name or "<root>" for name, sub in trainable_modules(module) if not sub.training]
    if in_eval:
        raise ValueError(
            f"submodules with trainable parameters are in eval mode: {in_eval[:5]}; call "
            "model.train() (or freeze their parameters) before make_private"
        )


def check_peft_dora(module: nn.Module) -> None:
    """Raise if a PEFT LoRA layer with DoRA (``use_dora=True``) has trainable parameters.

    PEFT's DoRA layer (``peft.tuners.lora.dora.DoraLinearLayer`` and its embedding and conv
    variants) forms its weight norm ``||W + s B A||`` by running ``lora_A`` and ``lora_B`` a
    second time, on an identity matrix, and receives those modules as arguments of its own
    forward. Each factor then runs twice per forward, so no per-sample norm of the adapter can
    be taken from one forward (the first forward used to fail with "ran more than once"). The
    layers are found by duck typing (PEFT's ``use_dora`` dict), so peft is not imported.

    Raises:
        UnsupportedModuleError: Naming the first DoRA layers and what to do, before any hook.
    """
    dora = [
        name or "<root>"
        for name, sub in module.named_modules()
        if isinstance(getattr(sub, "use_dora", None), dict)
        and any(sub.use_dora.values())
        and any(p.requires_grad for p in sub.parameters())
    ]
    if dora:
        raise UnsupportedModuleError(
            f"PEFT DoRA layers (use_dora=True) are not supported by randomized clipping: "
            f"{dora[:3]}. DoRA computes its weight norm by running lora_A and lora_B a second "
            "time (on an identity matrix) in every forward, so their per-sample norms cannot "
            "be measured from one forward. Use plain LoRA (LoraConfig(use_dora=False)), or "
            "freeze these layers' adapters."
        )


def check_parametrizations(module: nn.Module) -> None:
    """Raise if a submodule has a parametrized tensor with trainable originals.

    ``torch.nn.utils.parametrize`` (``parametrizations.weight_norm``, ``spectral_norm``,
    ``orthogonal``) replaces ``layer.weight`` by a property that calls
    ``layer.parametrizations.weight`` (a ``ParametrizationList`` owning ``original0``...) on
    every access, with no batch input: its per-sample gradient cannot be taken from that call
    (the first backward used to fail with a bare ``IndexError``, or the layer was refused for
    its direct parameters or buffers, without naming the parametrization).

    Raises:
        UnsupportedModuleError: Naming the parametrized modules and tensors and what to do.
    """
    found = [
        f"{name or '<root>'}.{tensor}"
        for name, sub in module.named_modules()
        if parametrize.is_parametrized(sub)
        for tensor, plist in sub.parametrizations.items()
        if any(p.requires_grad for p in plist.parameters())
    ]
    if found:
        raise UnsupportedModuleError(
            f"parametrized tensors (torch.nn.utils.parametrize, e.g. weight_norm, "
            f"spectral_norm) are not supported by randomized clipping: {found[:3]}. Their "
            "value is computed from the parametrization's own parameters outside the forward "
            "of the layer that uses it, with no per-sample input, so no per-sample norm covers "
            "those parameters. Remove the parametrization before make_private "
            "(torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')), or freeze "
            "its parameters."
        )


def _owners(m: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """``id(trainable parameter) -> [(module name, module) owning it directly]``."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, sub in m.named_modules(remove_duplicate=False):
        for p in sub.parameters(recurse=False):
            if p.requires_grad:
                users = owners.setdefault(id(p), [])
                if all(s is not sub for _, s in users):
                    users.append((name or "<root>", sub))
    return owners


def check_tied_parameters(
    m: nn.Module, *, norm_sampled: Any, supported: Collection[int] = frozenset()
) -> None:
    """Raise if a trainable parameter is shared by a norm-sampled module and another one,
    unless it is a supported tying.

    The one supported tying is a weight shared by one ``nn.Embedding`` and one ``nn.Linear``
    (an input embedding tied to a language-model head), each run once per step: its norm is
    that of the summed gradient, sketched jointly (:mod:`~opacus_rc.grad_sample.tied`). Its
    parameters are found by :func:`~opacus_rc.grad_sample.routing.find_tied_groups` and passed
    here as ``supported``.

    Args:
        m: The model.
        norm_sampled: Predicate on a module: whether its norm comes from a per-module norm
            sampler (sketched, exact, ghost or tied), which cannot combine tied weights.
        supported: ``id`` of the shared parameters of the supported tyings.

    Raises:
        NotImplementedError: Naming the modules that share the parameter.
    """
    for pid, users in _owners(m).items():
        if pid in supported and len(users) == 2:  # two owners in the whole model, as found
            continue
        if len(users) > 1 and any(norm_sampled(sub) for _, sub in users):
            names = ", ".join(f"'{n}' ({type(s).__name__})" for n, s in users)
            raise NotImplementedError(
                f"a trainable parameter is tied between modules {names}; randomized and "
                "ghost clipping compute per-module norms and cannot combine tied weights, "
                "except for the weight of one nn.Embedding shared with the weight of one "
                "nn.Linear (an input embedding tied to an LM head, exact types, no other "
                "parameter of either shared). Untie the weights or freeze the shared parameter."
            )


class TrainableSetGuard:
    """Which parameters train, and which module owns each, as recorded when hooks were attached.

    Args:
        m: The model, right after its hooks were attached.
        name_of: Qualified name of a parameter.
    """

    def __init__(self, m: nn.Module, *, name_of: Any) -> None:
        self._model = m
        self._name_of = name_of
        self._owned: dict[int, list[int]] | None = None
        self.check()  # records the trainable set

    @property
    def parameter_ids(self) -> frozenset[int]:
        """``id`` of every parameter that was trainable when the hooks were attached."""
        return frozenset(self._owned or ())

    def check(self) -> None:
        """Raise if the trainable set or its ownership changed since the hooks were attached.

        O(number of parameters), host-side only. A parameter frozen since is fine (it gets no
        gradient).

        Raises:
            RuntimeError: Naming the parameters made trainable, replaced or tied after the
                hooks were attached: no per-sample norm would be computed for them.
        """
        # id(trainable parameter) -> [id(module owning it directly)], in module order (as
        # _owners, in plain loops: it runs at every step).
        now: dict[int, list[int]] = {}
        for _, sub in self._model.named_modules(remove_duplicate=False):
            for p in sub.parameters(recurse=False):
                if p.requires_grad:
                    users = now.setdefault(id(p), [])
                    if id(sub) not in users:
                        users.append(id(sub))
        if self._owned is None:
            self._owned = now
            return
        changed = []
        for pid, owners in now.items():
            if self._owned.get(pid) != owners:
                changed.append(pid)
        if changed:
            names = {id(p): n for n, p in self._model.named_parameters(remove_duplicate=False)}
            listed = sorted({names.get(pid, "<unnamed>") for pid in changed})
            raise RuntimeError(
                f"trainable parameter(s) {listed[:5]} were made trainable, replaced or tied "
                "after the model was made private: no per-sample norm is computed for them, so "
                "they would train unclipped (two backward passes) or not at all "
                "(book-keeping). Decide which parameters train before make_private: call "
                "cleanup() (or start from the plain model) and make_private again."
            )


class ParameterUseCheck:
    """Detects trainable parameters used outside the forward of the module that owns them.

    Forward pre- and post-hooks on every module owning a trainable parameter record the
    autograd sequence numbers its forward calls span; :meth:`check` walks the loss's graph once
    and checks that every node consuming a trainable parameter lies inside a span of an owner.

    Args:
        m: The model.
        name_of: Qualified name of a parameter.
        active: A callable telling whether the hooks are enabled.
    """

    def __init__(self, m: nn.Module, *, name_of: Any, active: Any) -> None:
        self._name_of = name_of
        self._active = active
        self._owners: dict[int, list[int]] = {}
        self._spans: dict[int, list[tuple[int, int]]] = {}
        self._open: dict[int, list[int]] = {}
        self._leaf = torch.zeros((), requires_grad=True)
        self._leaf_aliases: Any = None
        self.owning_modules: list[nn.Module] = []
        for sub in m.modules():
            own = [p for p in sub.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            for p in own:
                self._owners.setdefault(id(p), []).append(id(sub))
            self.owning_modules.append(sub)

    def resolve_leaves_with(self, aliases: Any) -> None:
        """Map the graph's leaves to the registered parameters before checking them.

        Args:
            aliases: A callable returning ``{id(leaf): parameter}`` at :meth:`check` time, for
                leaves that are other objects than the registered parameters they stand for
                (FSDP2's unsharded parameters,
                :func:`opacus_rc._compat.torch.fsdp_unsharded_parameters`).
        """
        self._leaf_aliases = aliases

    def register(self, handles: list[Any]) -> None:
        """Attach the span hooks to the owning modules; their handles go into ``handles``."""
        for sub in self.owning_modules:
            handles.append(sub.register_forward_pre_hook(self._open_span))
            handles.append(sub.register_forward_hook(self._close_span))

    def _sequence_number(self) -> int:
        """The autograd sequence number of a node created now (forward nodes are numbered in
        creation order, per thread)."""
        return autograd_sequence_nr(self._leaf.view(()).grad_fn)

    def _open_span(self, module: nn.Module, _args: Any) -> None:
        if self._active() and torch.is_grad_enabled():
            self._open.setdefault(id(module), []).append(self._sequence_number())

    def _close_span(self, module: nn.Module, _args: Any, _output: Any) -> None:
        opened = self._open.get(id(module))
        if opened and self._active() and torch.is_grad_enabled():
            span = (opened.pop(), self._sequence_number())
            self._spans.setdefault(id(module), []).append(span)

    @property
    def has_spans(self) -> bool:
        """Whether forward spans are recorded and not yet consumed by :meth:`check`."""
        return bool(self._spans) or any(self._open.values())

    def clear(self) -> None:
        """Forget the recorded spans."""
        self._spans, self._open = {}, {}

    def check(self, loss: torch.Tensor) -> bool:
        """Raise if a trainable parameter reaches ``loss`` other than through its module's forward.

        The recorded spans are consumed. Under ``torch.autocast`` the node consuming a weight is
        its cast, which autocast caches for the whole region at the weight's first use; a region
        spanning several forward passes, or an earlier use outside the module in the same
        region, therefore raises too.

        Parameters used inside a reentrant activation-checkpoint region are not visible in the
        graph before the backward (the region is one node), so they are not checked.

        Args:
            loss: The loss about to be backpropagated (any shape).

        Returns:
            Whether the graph contains a reentrant checkpoint region (book-keeping's first pass
            must then reach every leaf; see :mod:`~opacus_rc.grad_sample.checkpointing`).

        Raises:
            RuntimeError: If a trainable parameter is used outside its module's forward; the
                error names the parameters.
        """
        spans = self._spans
        self._spans, self._open = {}, {}
        root = loss.grad_fn
        if root is None:
            return False
        reentrant = root.name() == REENTRANT_NODE
        aliases = self._leaf_aliases() if self._leaf_aliases is not None else {}
        outside: dict[int, str] = {}
        seen: dict[int, Any] = {id(root): root}  # values keep the nodes (and their ids) alive
        stack = [root]
        while stack:
            node = stack.pop()
            seq: int | None = None
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)  # AccumulateGrad: a leaf tensor
                if var is not None:
                    var = aliases.get(id(var), var)
                    owners = self._owners.get(id(var))
                    if owners is None:
                        continue
                    seq = autograd_sequence_nr(node) if seq is None else seq
                    inside = False
                    for o in owners:
                        for lo, hi in spans.get(o, ()):
                            inside = inside or lo < seq < hi
                    if not inside:
                        outside[id(var)] = self._name_of(var)
                elif id(nxt) not in seen:
                    seen[id(nxt)] = nxt
                    stack.append(nxt)
                    reentrant = reentrant or nxt.name() == REENTRANT_NODE
        if outside:
            raise RuntimeError(
                f"trainable parameter(s) {sorted(outside.values())} are used outside the "
                "forward of the module that owns them (e.g. F.linear(h, model.fc.weight) "
                "instead of model.fc(h), or model.fc.forward(h), which runs the forward "
                "without the module's hooks). Randomized clipping measures each per-sample "
                "norm from the owning module's own forward, so that use would get a gradient "
                "no norm accounts for. Call the module itself (model.fc(h)), give the other use "
                "its own module, or freeze the parameter. (Under torch.autocast a weight is cast "
                "once per autocast region, at its first use: enter autocast once per forward "
                "pass, and not around an earlier use of the weight outside its module.)"
            )
        return reentrant
