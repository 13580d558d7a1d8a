"""Checkpoints of a private run, and their weights for the plain model.

``PrivacyEngine.save_checkpoint`` and ``load_checkpoint`` are Opacus' (opacus 1.6): they save
and restore the model's ``state_dict``, the optimizer's and the accountant's (its history, the
sketch specs of randomized clipping included), so a resumed run reports the epsilon of an
uninterrupted one (README, "Checkpoints"). The model's ``state_dict`` is the wrapped module's,
so every key carries the wrapper's ``_module.`` prefix and does not load into the plain model:
:func:`unwrap_state_dict` removes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from opacus_rc._compat.opacus import WRAPPED_MODULE_ATTR

__all__ = ["GRAD_SAMPLE_MODULE_PREFIX", "unwrap_state_dict"]

#: The prefix a grad-sample module (Opacus' or opacus_rc's) puts before its model's keys
#: (``"_module."``: the child name under which Opacus registers the wrapped model).
GRAD_SAMPLE_MODULE_PREFIX = WRAPPED_MODULE_ATTR + "."


def unwrap_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """The plain model's ``state_dict`` from a wrapped module's (or a checkpoint's).

    Removes the ``_module.`` prefix that the grad-sample module returned by ``make_private``
    adds to every key (once per wrapping, so a module made private twice loses both), with
    PyTorch's ``consume_prefix_in_state_dict_if_present`` (which also fixes the metadata of
    each submodule). Use it to load a private run's weights into the plain model::

        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(unwrap_state_dict(checkpoint["module_state_dict"]))

    A state dict without the prefix (the plain model's, or ``wrap_model=False``'s) is returned
    unchanged (as a copy). The tensors are shared, not copied.

    Args:
        state_dict: A ``state_dict`` (a mapping of key to tensor), e.g.
            ``checkpoint["module_state_dict"]`` of ``PrivacyEngine.save_checkpoint``.

    Returns:
        A new ``OrderedDict`` with the prefix removed (its ``_metadata`` too).

    Raises:
        ValueError: If only some keys carry the prefix (not one wrapped module's state dict).
    """
    # Any: torch keeps a state dict's ``_metadata`` as an attribute of the OrderedDict.
    out: Any = OrderedDict(state_dict)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        out._metadata = OrderedDict(metadata)
    while out:
        prefixed = [k.startswith(GRAD_SAMPLE_MODULE_PREFIX) for k in out]
        if not any(prefixed):
            break
        if not all(prefixed):
            stray = [k for k, p in zip(out, prefixed) if not p][:3]
            raise ValueError(
                f"only some keys carry the {GRAD_SAMPLE_MODULE_PREFIX!r} prefix (not {stray}): "
                "this is not the state_dict of one wrapped module"
            )
        consume_prefix_in_state_dict_if_present(out, GRAD_SAMPLE_MODULE_PREFIX)
    return out
