"""Contract tests of :mod:`opacus_rc._compat.transformers` on the installed transformers.

An override the ``Trainer`` no longer calls is skipped silently (the DP trainer would, e.g.,
clip the summed gradient again, or save checkpoints without the privacy state), so these tests
check that each private name exists, takes the arguments the adapter passes, and is called by
the ``Trainer``'s own code.
"""

from __future__ import annotations

import inspect

import pytest

transformers = pytest.importorskip("transformers")

from opacus_rc._compat import transformers as compat  # noqa: E402

_TRAINER_SOURCE = inspect.getsource(inspect.getmodule(transformers.Trainer))

#: private name -> the parameters (after self) the adapter passes.
_SIGNATURES = {
    "_clip_grad_norm": ["model"],
    "_get_grad_norm": ["model", "grad_norm"],
    "_get_num_items_in_batch": ["batch_samples", "device"],
    "_track_num_input_tokens": ["inputs"],
    "_save_checkpoint": ["model", "trial"],
    "_load_optimizer_and_scheduler": ["checkpoint"],
    "_get_train_sampler": ["train_dataset"],
    "_remove_unused_columns": ["dataset", "description"],
    "_get_collator_with_removed_columns": ["data_collator", "description"],
    "_prepare_inputs": ["inputs"],
    "_get_output_dir": ["trial"],
    "_save": ["output_dir", "state_dict"],
}


@pytest.mark.parametrize("name", sorted(_SIGNATURES))
def test_trainer_private_methods(name: str) -> None:
    method = getattr(transformers.Trainer, name)
    params = list(inspect.signature(method).parameters)[1:]
    assert params == _SIGNATURES[name], f"Trainer.{name}{params}"


@pytest.mark.parametrize("name", sorted(compat.TRAINER_SEAMS))
def test_trainer_calls_each_seam(name: str) -> None:
    assert f"self.{name}(" in _TRAINER_SOURCE, f"the Trainer no longer calls self.{name}(...)"


def test_trainer_sets_private_attributes() -> None:
    init = inspect.getsource(transformers.Trainer.__init__)
    assert "self._train_batch_size =" in init
    assert "self._loss_shifts_labels =" in init


def test_seams_forward_in_order() -> None:
    """Each private hook reaches its seam, and the seam's default the next class's hook."""
    calls: list[str] = []

    class Base:
        pass

    for name in compat.TRAINER_SEAMS:
        setattr(Base, name, lambda self, *a, _n=name, **k: calls.append(f"base{_n}"))

    class Mixed(compat.TrainerSeams, Base):
        pass

    for seam in compat.TRAINER_SEAMS.values():

        def override(self, *a, _seam=seam, **k):
            calls.append(_seam)
            return getattr(super(Mixed, self), _seam)(*a, **k)

        setattr(Mixed, seam, override)
    obj = Mixed()
    args = {n: [None] * len(p) for n, p in _SIGNATURES.items()}
    for name, seam in compat.TRAINER_SEAMS.items():
        calls.clear()
        getattr(obj, name)(*args[name])
        assert calls == [seam, f"base{name}"]


def test_trainer_helpers() -> None:
    class Fake:
        _train_batch_size = 7
        _loss_shifts_labels = True

        def _remove_unused_columns(self, dataset, description=None):
            return ("removed", dataset, description)

        def _get_collator_with_removed_columns(self, data_collator, description=None):
            return ("collator", data_collator, description)

        def _prepare_inputs(self, inputs):
            return ("prepared", inputs)

        def _get_output_dir(self, trial):
            return f"out-{trial}"

    f = Fake()
    assert compat.train_batch_size(f) == 7
    assert compat.loss_shifts_labels(f) is True and compat.loss_shifts_labels(object()) is False
    assert compat.remove_unused_columns(f, "d", description="Training") == (
        "removed",
        "d",
        "Training",
    )
    assert compat.collator_with_removed_columns(f, "c", description="Training") == (
        "collator",
        "c",
        "Training",
    )
    assert compat.prepare_inputs(f, 1) == ("prepared", 1)
    assert compat.output_dir(f, 3) == "out-3"

    class Own(transformers.Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return None

    assert compat.overrides_train_sampler(Own) is True
    assert compat.overrides_train_sampler(transformers.Trainer) is False


def test_trainer_save_writes_the_given_state_dict() -> None:
    """``save_model_state`` passes the state dict to ``Trainer._save`` by keyword."""

    class Fake:
        def _save(self, output_dir=None, state_dict=None):
            self.saved = (output_dir, state_dict)

    f = Fake()
    compat.save_model_state(f, "out", {"w": 1})
    assert f.saved == ("out", {"w": 1})


def test_accelerate_fsdp2_on_cpu() -> None:
    """What :func:`~opacus_rc._compat.transformers.enable_fsdp2_on_cpu` and
    :func:`~opacus_rc._compat.transformers.accelerator_state_initialised` rely on (the
    2-process runs of tests/integrations/test_dp_trainer_fsdp.py use them for real):

    * accelerate's state enables FSDP for accelerator devices only (its list of distributed
      types that take the FSDP plugin has no ``MULTI_CPU``), and then writes the FSDP type
      into the process state too;
    * the states share their attributes through ``_shared_state``, a dict (empty until the
      first ``Accelerator``);
    * accelerate's FSDP2 preparation returns a model that is already an ``FSDPModule`` as it
      is, and the Trainer builds its plugin from ``TrainingArguments.fsdp_plugin_args``.
    """
    import accelerate.state as state_module
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import fsdp_utils

    source = inspect.getsource(state_module)
    fsdp_branch = source[: source.index("self.distributed_type = DistributedType.FSDP")]
    gpu_list = fsdp_branch[fsdp_branch.rindex("elif self.distributed_type in [") :]
    assert "MULTI_GPU" in gpu_list and "MULTI_CPU" not in gpu_list
    assert 'PartialState._shared_state["distributed_type"] = self.distributed_type' in source
    assert isinstance(AcceleratorState._shared_state, dict)
    assert isinstance(PartialState._shared_state, dict)
    prepare = inspect.getsource(fsdp_utils.fsdp2_prepare_model)
    assert "if is_type_fsdp:\n        return model" in prepare
    assert "FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)" in _TRAINER_SOURCE
    args = transformers.TrainingArguments(
        output_dir="unused", fsdp=True, fsdp_config={"fsdp_version": 2}, report_to=[]
    )
    assert args.fsdp_plugin_args["fsdp_version"] == 2
