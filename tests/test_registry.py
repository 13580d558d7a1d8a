"""The one registry helper (opacus_rc.registry) where users extend, and the plain tables that
replaced the fixed registries."""

from __future__ import annotations

import pytest
from torch import nn

from opacus_rc.accountants.analysis.envelopes import ENVELOPE_LAWS
from opacus_rc.accountants.analysis.threat_models import (
    THREAT_MODEL_CLASSES,
    THREAT_MODELS,
    HiddenLossModel,
    RevealedLossModel,
)
from opacus_rc.grad_sample import (
    CLIPPED_SUM_FUNCTIONS,
    FORWARD_INPUT_ADAPTERS,
    MODULE_CHECKS,
    SKETCHED_NORM_SAMPLERS,
    register_module_check,
)
from opacus_rc.grad_sample.routing import opacus_sampler_limit
from opacus_rc.registry import Registry, TypeRegistry, qualified_name


def _fn() -> None:
    return None


def test_type_registry_is_exact_type_and_misses_return_none() -> None:
    table: TypeRegistry = TypeRegistry("layer check", base=nn.Module, base_name="nn.Module")

    class Sub(nn.Linear):
        pass

    table.register_types(nn.Linear, nn.Conv1d)(_fn)
    assert table[nn.Linear] is _fn and table.get(nn.Conv1d) is _fn
    # Exact type, not the MRO: a subclass may change forward, so it is not matched.
    assert table.get(Sub) is None and Sub not in table
    assert table.get(nn.ReLU, "fallback") == "fallback"
    assert list(table) == [nn.Linear, nn.Conv1d]


def test_type_registry_refuses_and_registers_nothing_on_a_clash() -> None:
    table: TypeRegistry = TypeRegistry("layer check", base=nn.Module, base_name="nn.Module")
    table.register(nn.Linear, _fn)
    with pytest.raises(TypeError, match=r"layer check is registered for nn.Module subclasses"):
        table.register_types(nn.Conv1d, int)
    with pytest.raises(TypeError, match="at least one module type"):
        table.register_types()
    with pytest.raises(TypeError, match="layer check must be callable, got int"):
        table.register_types(nn.Conv1d)(3)  # type: ignore[type-var]
    other = lambda m: None  # noqa: E731
    with pytest.raises(
        ValueError,
        match=r"duplicate registration for layer check torch\.nn\.modules\.linear\.Linear "
        r"\(already registered\); pass force=True",
    ):
        table.register_types(nn.Conv1d, nn.Linear)(other)
    assert nn.Conv1d not in table and table[nn.Linear] is _fn  # all or none
    table.register_types(nn.Conv1d, nn.Linear, force=True)(other)
    assert table[nn.Linear] is other and table[nn.Conv1d] is other


def test_name_registry_messages_are_unchanged() -> None:
    laws: Registry = Registry("law", option="law")
    laws.register("flat", _fn)
    with pytest.raises(ValueError, match=r"^unknown law 'steep'; allowed: 'flat'$"):
        laws.get("steep")
    with pytest.raises(ValueError, match=r"^duplicate registration for law 'flat' \(already"):
        laws.register("flat", _fn)
    with pytest.raises(TypeError, match="law name must be a non-empty str"):
        laws.register("", _fn)


def test_only_the_extension_points_are_registries() -> None:
    """Layers (four per-type tables) and envelopes are registries; fixed tables are plain."""
    for table in (
        SKETCHED_NORM_SAMPLERS,
        CLIPPED_SUM_FUNCTIONS,
        MODULE_CHECKS,
        FORWARD_INPUT_ADAPTERS,
    ):
        assert isinstance(table, TypeRegistry), table
    assert isinstance(ENVELOPE_LAWS, Registry)
    assert type(THREAT_MODEL_CLASSES) is dict
    assert {"hidden": HiddenLossModel, "revealed": RevealedLossModel} == THREAT_MODEL_CLASSES
    assert THREAT_MODELS == ("hidden", "revealed")
    # nn.Linear, and the transformers RMSNorm classes imported so far (issue 34: their closed
    # form, opacus_rc.grad_sample.norm_layers, registers itself once their module is loaded).
    from opacus_rc.grad_sample.norm_layers import TRANSFORMERS_RMS_NORMS
    from opacus_rc.grad_sample.norms import STASH_GRAD_SAMPLERS

    others = set(STASH_GRAD_SAMPLERS) - {nn.Linear}
    assert nn.Linear in STASH_GRAD_SAMPLERS
    assert {(t.__module__, t.__name__) for t in others} <= set(TRANSFORMERS_RMS_NORMS)


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (nn.Conv1d(2, 2, 3), None),
        (nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "padding_mode='reflect'"),
        (nn.Conv3d(2, 2, 3, padding=1, padding_mode="circular"), "padding_mode='circular'"),
        (nn.LayerNorm(4), None),
        (nn.LayerNorm(4, bias=False), "bias=False"),
        (nn.LayerNorm(4, elementwise_affine=False), None),
        (nn.Linear(2, 2), None),
    ],
)
def test_opacus_sampler_limits_are_a_plain_function(module: nn.Module, reason: str | None) -> None:
    got = opacus_sampler_limit(module)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


def test_a_subclass_takes_no_limit_of_its_base() -> None:
    """Exact type, as Opacus looks up its samplers: a subclass has no Opacus sampler either."""

    class MyConv(nn.Conv1d):
        pass

    assert opacus_sampler_limit(MyConv(2, 2, 3, padding=1, padding_mode="reflect")) is None


def test_register_module_check_through_the_helper() -> None:
    class Mine(nn.Linear):
        pass

    try:
        register_module_check(Mine)(_fn)
        assert MODULE_CHECKS.get(Mine) is _fn
        with pytest.raises(ValueError, match=rf"duplicate registration.*{qualified_name(Mine)}"):
            register_module_check(Mine)(_fn)
    finally:
        MODULE_CHECKS.pop(Mine, None)
