"""FSDP2 through a DP trainer: the sharding the engine needs, lockstep micro-batches, checkpoints.

``TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})`` (or ``accelerate launch``
with an FSDP2 config) runs a DP trainer's private step on an FSDP2-sharded model
(:mod:`opacus_rc.grad_sample.fsdp`). What differs from accelerate's own FSDP2 preparation:

* **Sharding** (:func:`shard_for_randomized_clipping`). The Trainer makes the optimizer (which
  the DP trainer makes private, building the engine's FSDP2 hooks and optimizer) *before*
  accelerate shards the model; the engine needs the sharded model. So the trainer shards the
  model itself first, as accelerate's auto-wrap policy says (``transformer_layer_cls_to_wrap``,
  by default the model's decoder layers), innermost first, then the root, with the plugin's
  ``reshard_after_forward`` and device mesh; a tied embedding and LM head (and their
  ancestors, e.g. the decoder stack) stay in the root's group. Every trainable parameter is
  then a sharded ``DTensor`` of some group, which is what the engine needs
  (:func:`~opacus_rc.grad_sample.fsdp.check_fsdp_model`). Accelerate then finds an FSDP2 model
  and leaves it as it is (``fsdp2_prepare_model`` returns a model that is already an
  ``FSDPModule``).
* **Lockstep** (:func:`lockstep_micro_batches`). Under FSDP2 every forward all-gathers each
  layer's weight and every private backward reduce-scatters its clipped sum: every rank must run
  the same number of forwards and backwards. Each logical batch, the ranks agree on the largest
  number of micro-batches any rank's share needs (one all-reduce of the counts); a rank with
  fewer runs *filler* micro-batches (:func:`filler_micro_batch`): one collated example of the
  training set with every label ``-100``, whose per-example loss is 0 and whose gradient is
  exactly zero (cross-entropy with ``ignore_index``), so it adds nothing to the clipped sum,
  nothing to the released update, and is not counted in the logged loss. When no rank has an
  example, every rank takes the noise-only path (no forward).
* **The batch-independence check** runs its forwards on each rank's own examples, a number that
  differs between ranks; inside :func:`unsharded` every FSDP2 group is all-gathered once (every
  rank together) and kept unsharded, so the check's forwards need no collective. The check runs
  at the first logical batches only; the full model is then held on each rank (turn the check
  off with ``PrivacyArguments.check_batch_independence=False`` where it does not fit).
* **Checkpoints** (:func:`plain_optimizer`). The Trainer saves and loads the sharded model and
  optimizer with accelerate's FSDP functions (``fsdp_config["state_dict_type"]``:
  ``SHARDED_STATE_DICT`` writes ``torch.distributed.checkpoint`` folders, ``FULL_STATE_DICT``
  one file); torch's ``get/set_optimizer_state_dict`` call ``optimizer.step()`` with zero
  gradients when the optimizer holds no state yet, which on the DP optimizer would be a private
  step with no backward. They are given the DP optimizer's inner ``torch.optim.Optimizer``.
  ``save_model`` writes the full model (gathered from the shards, on rank 0), loadable into an
  unsharded model, whatever the ``state_dict_type``.

Refused (:func:`refuse_unsupported_fsdp`), each with what to change: FSDP version 1, FSDP's
activation checkpointing (``fsdp_config["activation_checkpointing"]``), mixed precision
(``bf16``: FSDP2's ``MixedPrecisionPolicy`` under per-example clipping is untested), CPU offload,
``cpu_ram_efficient_loading`` (only rank 0 would hold the weights the trainer shards),
``ignored_modules``, and ``PrivacyArguments.privacy_unit``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "accelerate_wrap_policy",
    "filler_micro_batch",
    "fsdp2_plugin",
    "lockstep_micro_batches",
    "plain_optimizer",
    "refuse_fsdp_version",
    "refuse_unsupported_fsdp",
    "shard_for_randomized_clipping",
    "unsharded",
]


def fsdp2_plugin(trainer: Any) -> Any:
    """The trainer's accelerate FSDP plugin, or None without FSDP."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    return getattr(trainer.accelerator.state, "fsdp_plugin", None)


def _version_message(version: int) -> str:
    return (
        f"FSDP version {version} through a DP trainer is not supported: randomized "
        "clipping shards with FSDP2 (torch.distributed.fsdp.fully_shard). Set "
        'fsdp_config={"version": 2} (accelerate: fsdp_version: 2)'
    )


def refuse_fsdp_version(args: Any) -> None:
    """Refuse FSDP version 1 from the ``TrainingArguments``, before accelerate builds its plugin
    (on CPU accelerate would first fail on version 1's ``sync_module_states`` with a message
    that does not say to use FSDP2).

    Args:
        args: The trainer's ``TrainingArguments``.

    Raises:
        NotImplementedError: ``fsdp`` is set and its plugin arguments ask for a version other
            than 2.
    """
    if not getattr(args, "fsdp", None):
        return
    plugin_args = getattr(args, "fsdp_plugin_args", None) or {}
    version = int(plugin_args.get("fsdp_version", 2))
    if version != 2:
        raise NotImplementedError(_version_message(version))


def refuse_unsupported_fsdp(trainer: Any) -> None:
    """Refuse what a DP trainer cannot run under FSDP (module docstring), saying what to change.

    Args:
        trainer: The DP trainer, after ``Trainer.__init__``, with FSDP enabled.

    Raises:
        NotImplementedError: FSDP version 1, no FSDP plugin in accelerate's state, FSDP
            activation checkpointing, mixed precision, CPU offload,
            ``cpu_ram_efficient_loading``, ``ignored_modules``, or
            ``PrivacyArguments.privacy_unit``.
    """
    plugin = fsdp2_plugin(trainer)
    if plugin is not None:
        version = int(getattr(plugin, "fsdp_version", 1))
    else:
        plugin_args = getattr(trainer.args, "fsdp_plugin_args", None) or {}
        version = int(plugin_args.get("fsdp_version", 1))
    if version != 2:
        raise NotImplementedError(_version_message(version))
    if plugin is None:
        raise NotImplementedError(
            "TrainingArguments.fsdp is set but accelerate's state has no FSDP plugin (XLA "
            "FSDP, or a state configured earlier without FSDP and kept with "
            "accelerator_config={'use_configured_state': True}), so accelerate would train "
            "the model unsharded: a DP trainer runs FSDP2 through accelerate's plugin only. "
            "Leave use_configured_state off (each TrainingArguments then starts a fresh state) "
            "or configure the state with FSDP2: TrainingArguments(fsdp=True, "
            'fsdp_config={"version": 2}), launched with torchrun'
        )
    what = None
    if getattr(plugin, "activation_checkpointing", False):
        what = (
            'fsdp_config["activation_checkpointing"]=True (accelerate wraps layers in '
            "CheckpointWrapper while it shards, which the trainer's own sharding does not "
            "do); set it to False and use TrainingArguments(gradient_checkpointing=True)"
        )
    elif (
        trainer.accelerator.mixed_precision != "no"
        or getattr(plugin, "mixed_precision_policy", None) is not None
    ):
        what = (
            f"mixed precision ({trainer.accelerator.mixed_precision!r}: FSDP2's "
            "MixedPrecisionPolicy casts the parameters and the reduce-scattered gradients, "
            "which the private step under FSDP2 has not been validated with); train in full "
            "precision (bf16=False), or in bf16 with DDP (no fsdp)"
        )
    elif type(getattr(plugin, "cpu_offload", None)).__name__ == "CPUOffloadPolicy" or (
        getattr(plugin, "cpu_offload", None) is True
    ):
        what = (
            'CPU offload (TrainingArguments(fsdp="... offload") or fsdp_config["cpu_offload"]: '
            "the parameters' and gradients' offload to the CPU); remove it"
        )
    elif getattr(plugin, "cpu_ram_efficient_loading", False):
        what = (
            'fsdp_config["cpu_ram_efficient_loading"]=True (only rank 0 loads the weights, '
            "which accelerate broadcasts while it shards; the trainer shards the model itself, "
            "from the weights every rank holds); set it to False"
        )
    elif getattr(plugin, "ignored_modules", None) is not None:
        what = (
            "FSDP ignored_modules (their parameters would stay unsharded plain tensors, which "
            "the private step under FSDP2 does not reduce); remove them"
        )
    elif trainer.privacy_args.privacy_unit is not None:
        what = (
            f"PrivacyArguments.privacy_unit={trainer.privacy_args.privacy_unit!r} (unit-level "
            "privacy under FSDP2 has no lockstep filler micro-batches yet); train it with "
            "DDP (no fsdp) or without privacy_unit"
        )
    if what is not None:
        raise NotImplementedError(
            f"FSDP2 through a DP trainer does not support {what} (docs/distributed.md)"
        )


def _post_order(model: nn.Module) -> list[nn.Module]:
    """The model's distinct modules, every module after its descendants (the root last)."""
    seen: set[int] = set()
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(model)
    return out


def shard_for_randomized_clipping(
    model: nn.Module,
    *,
    wrap: Callable[[nn.Module], bool] | None = None,
    reshard_after_forward: bool = True,
    mesh: Any = None,
) -> list[nn.Module]:
    """``fully_shard`` ``model`` the way randomized clipping under FSDP2 needs (in place).

    Every module ``wrap`` selects (accelerate's auto-wrap policy: the decoder layers, by
    default the model's ``_no_split_modules``) is sharded as one group, children before their
    parents, then the root; except modules that share a parameter (a tied input embedding and
    LM head) and their ancestors: the shared parameter is the root's (FSDP2 refuses a parameter
    in two groups; the engine computes the tied weight's joint sketch on the plain
    ``nn.Embedding`` / ``nn.Linear``). The engine accepts a trainable module whose parameters an
    enclosing group owns (a linear layer or RMSNorm in its decoder layer's group). A model that is
    already an ``FSDPModule`` is returned unchanged (its sharding is checked by the engine,
    :func:`~opacus_rc.grad_sample.fsdp.check_fsdp_model`).

    Args:
        model: The unsharded model, on its training device, identical on every rank.
        wrap: Which further modules get their own group (None: none).
        reshard_after_forward: ``fully_shard``'s argument, for every group but the root's.
        mesh: ``fully_shard``'s device mesh (None: all ranks, the default).

    Returns:
        The ``FSDPModule`` s, in the order they were sharded (the root last).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sharding a model with FSDP2 needs an initialised process group")
    if isinstance(model, FSDPModule):
        return [m for m in model.modules() if isinstance(m, FSDPModule)]
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kwargs["mesh"] = mesh
    order = _post_order(model)
    owners: dict[int, list[nn.Module]] = {}
    for sub in order:
        for p in sub.parameters(recurse=False):
            users = owners.setdefault(id(p), [])
            if all(u is not sub for u in users):
                users.append(sub)
    # A shared parameter (a tied embedding and LM head) stays in the root's group: its modules
    # and their ancestors are not sharded (FSDP2 refuses a parameter in two groups, and the
    # engine's joint sketch of a tied embedding / head needs their plain types).
    parents = {id(c): m for m in order for c in m.children()}
    keep: set[int] = set()
    for users in owners.values():
        if len(users) > 1:
            for u in users:
                while u is not None and u is not model:
                    keep.add(id(u))
                    u = parents.get(id(u))
    sharded: list[nn.Module] = []
    for sub in order[:-1]:
        if id(sub) in keep:
            continue
        if wrap is not None and wrap(sub):
            fully_shard(sub, **kwargs)
            sharded.append(sub)
    root_kwargs = {k: v for k, v in kwargs.items() if k != "reshard_after_forward"}
    fully_shard(model, **root_kwargs)
    sharded.append(model)
    return sharded


def accelerate_wrap_policy(plugin: Any, model: nn.Module) -> Callable[[nn.Module], bool] | None:
    """Accelerate's FSDP2 auto-wrap policy of ``plugin`` for ``model``.

    What accelerate's own FSDP2 preparation would shard: with the transformer-based policy (the
    default), the classes of ``fsdp_config["transformer_layer_cls_to_wrap"]``, else the model's
    ``_no_split_modules``; with ``min_num_params``, modules of at least that many parameters.

    Args:
        plugin: Accelerate's ``FullyShardedDataParallelPlugin``.
        model: The unsharded model.

    Returns:
        A predicate on modules, or None (no policy: only the root is sharded).

    Raises:
        ValueError: A ``transformer_layer_cls_to_wrap`` class the model does not have
            (accelerate's message).
    """
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    plugin.set_auto_wrap_policy(model)
    return fsdp2_prepare_auto_wrap_policy(plugin, model)


@contextlib.contextmanager
def unsharded(model: nn.Module, *, reshard_after_forward: bool) -> Iterator[None]:
    """Hold every FSDP2 group of ``model`` unsharded inside (a collective: every rank enters).

    Each group is all-gathered once on entry, in the model's order on every rank, and kept
    unsharded through any number of forwards (``reshard_after_forward`` off inside); on exit
    each group is resharded and its ``reshard_after_forward`` set back (the root's to False,
    FSDP2's default for a root). The forwards inside need no collective, so ranks may run
    different numbers of them (the batch-independence check).

    Args:
        model: The root ``FSDPModule``.
        reshard_after_forward: What :func:`shard_for_randomized_clipping` gave the groups.
    """
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in groups:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in groups:
            m.reshard()
            m.set_reshard_after_forward(reshard_after_forward and m is not model, recurse=False)


def lockstep_micro_batches(count: int, *, device: torch.device) -> int:
    """The largest number of micro-batches any rank's share needs (an all-reduce of counts).

    Args:
        count: This rank's number of micro-batches.
        device: The process group's device.

    Returns:
        The maximum over ranks.
    """
    t = torch.tensor([count], device=device, dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def filler_micro_batch(template: Mapping[str, Any]) -> dict[str, Any]:
    """A filler micro-batch: ``template`` (one collated example) with every label ``-100``.

    Its per-example loss is 0 and its gradient exactly zero (cross-entropy ignores ``-100``),
    so it adds nothing to the clipped sum (module docstring).

    Args:
        template: One collated micro-batch, with ``labels`` (and ``shift_labels``, if any).

    Returns:
        A copy, every tensor whose key ends in ``labels`` filled with ``-100``.

    Raises:
        ValueError: ``template`` has no ``labels``.
    """
    if "labels" not in template:
        raise ValueError("a filler micro-batch needs the collated example's 'labels'")
    return {
        k: torch.full_like(v, -100) if k.endswith("labels") and isinstance(v, torch.Tensor) else v
        for k, v in template.items()
    }


@contextlib.contextmanager
def plain_optimizer(trainer: Any) -> Iterator[None]:
    """Inside, ``trainer.optimizer`` is the DP optimizer's inner ``torch.optim.Optimizer``
    (what accelerate's FSDP checkpoint functions are given: module docstring); restored on exit.
    """
    private = getattr(trainer, "_private", None)
    if private is None:
        yield
        return
    saved = trainer.optimizer
    trainer.optimizer = private.optimizer.original_optimizer
    try:
        yield
    finally:
        trainer.optimizer = saved
