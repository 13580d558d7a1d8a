"""The DP trainer's loose ends (issue 30, item 5), on tiny random Llama models.

* A ``compute_loss`` of the user's, which training does not use (training calls
  ``compute_private_loss`` per micro-batch) but ``evaluate()`` does, is refused at construction
  with the method to override; beside an override of ``compute_private_loss`` it is accepted, and
  each method is called where the docs say (counted against the recorded micro-batches), and
  the override recipe of ``compute_private_loss``'s docstring (``per_sample_cross_entropy``
  through ``dp_criterion``) trains to the default's weights (same seeds, seeded sketch).
* Logs: two runs on neighbouring datasets (D and D without its first record, same seeds) log
  the same public values (``epsilon``, ``step``, ``epoch``, ``learning_rate``: nothing else is
  unlabelled), and every value that differs carries the ``non_private/`` prefix; the opt-in
  token count equals the attention mask's ones of the recorded batches;
  ``include_num_input_tokens_seen`` is refused.
* Hooks: after ``train()`` (also one that raised) the model holds no privacy hook or attribute
  (compared with the model before training), ``copy.deepcopy`` works, a plain training step
  leaves nothing behind and updates as on a model that never had hooks, and a second DP trainer
  trains the same model with its own accounting.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

from opacus_rc.integrations.transformers import (  # noqa: E402
    NON_PRIVATE_LOG_PREFIX,
    DPTrainer,
    DPTrainerMixin,
    PrivacyArguments,
    per_sample_cross_entropy,
)

DELTA = 1e-3
PUBLIC_LOG_KEYS = {"epsilon", "step", "epoch", "learning_rate"}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")
    warnings.filterwarnings("ignore", message="PrivacyArguments.sketch_seed")


def make(
    tmp_path: Path,
    *,
    cls: type | None = None,
    model: Any = None,
    data: Any = None,
    collator: Any = th.pad_collate,
    privacy: dict | None = None,
    **args: Any,
) -> Any:
    p = {"target_epsilon": 4.0, "target_delta": DELTA, "expected_batch_size": 8, "seed": 1}
    p.update(privacy or {})
    return (cls or th.recording_trainer())(
        model=th.tiny_llama() if model is None else model,
        args=th.training_args(tmp_path, **args),
        train_dataset=th.token_examples(40) if data is None else data,
        data_collator=collator,
        privacy_args=PrivacyArguments(**p),
    )


# --------------------------------------------------------------------------------------------
# compute_loss
# --------------------------------------------------------------------------------------------


class WeightedLoss(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class CustomLossTrainer(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class DPCustomLossTrainer(DPTrainerMixin, CustomLossTrainer):
    pass


@pytest.mark.parametrize(
    ("cls", "owner"),
    [(WeightedLoss, "WeightedLoss"), (DPCustomLossTrainer, "CustomLossTrainer")],
    ids=["DPTrainer-subclass", "mixin-on-own-trainer"],
)
def test_compute_loss_override_training_would_ignore_is_refused(
    tmp_path: Path, cls: type, owner: str
) -> None:
    # On main: accepted, then called 0 times in training and used by evaluate().
    with pytest.raises(ValueError, match=rf"{owner} overrides compute_loss.*compute_private_loss"):
        make(tmp_path, cls=cls)


def test_compute_loss_beside_compute_private_loss_is_the_evaluation_loss(tmp_path: Path) -> None:
    class Both(th.recording_trainer()):
        calls = {"private": 0, "loss": 0}

        def compute_private_loss(self, model, inputs):  # the docstring's recipe
            self.calls["private"] += 1
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            return per_sample_cross_entropy(self.dp_criterion, logits, labels, shift=True)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.calls["loss"] += 1
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    seeded = {"sketch_seed": 5}  # the same sketch probes in both runs
    tr = make(tmp_path, cls=Both, privacy=seeded, max_steps=3, per_device_train_batch_size=3)
    tr.train()
    micro_batches = sum(len(b.micro_batches) for b in tr.batches)
    assert micro_batches > 0 and tr.calls == {"private": micro_batches, "loss": 0}
    tr.evaluate(eval_dataset=th.token_examples(7, seed=9))  # batches of 8: one batch
    assert tr.calls == {"private": micro_batches, "loss": 1}
    # The recipe is the default per-example loss: the same seeds give the default's weights.
    default = make(tmp_path / "d", privacy=seeded, max_steps=3, per_device_train_batch_size=3)
    default.train()
    mine, theirs = th.params(tr.model), th.params(default.model)
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------------------------


def test_neighbouring_runs_log_the_same_public_values(tmp_path: Path) -> None:
    data = th.token_examples(40)
    privacy = {"log_non_private_token_counts": True}
    runs = []
    for name, records in (("D", data), ("D-1", data[1:])):  # q = 1 / ceil(N / 8) = 1/5 for both
        tr = make(tmp_path / name, data=records, privacy=privacy, max_steps=4)
        out = tr.train()
        runs.append((tr, out))
    (a, out_a), (b, out_b) = runs
    assert len(a.state.log_history) == len(b.state.log_history) == 5  # 4 steps, then the metrics
    differing = set()
    for x, y in zip(a.state.log_history, b.state.log_history, strict=True):
        assert x.keys() == y.keys()
        public = {k for k in x if not k.startswith(NON_PRIVATE_LOG_PREFIX)}
        assert public <= PUBLIC_LOG_KEYS, public - PUBLIC_LOG_KEYS
        assert {k: x[k] for k in public} == {k: y[k] for k in public}
        differing |= {k for k in x if x[k] != y[k]}
    # The unnoised values do differ between neighbours, which is why they are labelled.
    assert {"non_private/loss", "non_private/num_input_tokens_seen"} <= differing
    assert "non_private/train_loss" in out_a.metrics and "train_loss" not in out_a.metrics
    # The opt-in count is the attention mask's ones of the batches trained on.
    for tr in (a, b):
        seen = 0
        for step, batch in enumerate(tr.batches):
            seen += sum(int(m["attention_mask"].sum()) for m in batch.micro_batches)
            assert tr.state.log_history[step]["non_private/num_input_tokens_seen"] == seen
    assert a.state.log_history[-1]["epsilon"] == a.get_epsilon() == b.get_epsilon()


def test_include_num_input_tokens_seen_is_refused(tmp_path: Path) -> None:
    # On main: 160 vs 55 tokens logged beside the same epsilon for neighbouring datasets.
    for value in (True, "non_padding"):
        with pytest.raises(ValueError, match="log_non_private_token_counts=True"):
            make(tmp_path, include_num_input_tokens_seen=value)


# --------------------------------------------------------------------------------------------
# Hooks after train()
# --------------------------------------------------------------------------------------------


def _state(model: torch.nn.Module) -> dict:
    """Every attribute and hook of the model's parameters and modules (accelerate's own
    ``_is_accelerate_prepared`` marker left out)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param {name}"] = sorted(vars(p))
    for name, m in model.named_modules():
        out[f"module {name}"] = sorted(k for k in vars(m) if k != "_is_accelerate_prepared")
        hooks = (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks)
        out[f"hooks {name}"] = [len(h) for h in hooks]
    return out


def _plain_step(model: torch.nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(**th.pad_collate(th.token_examples(3, seed=5))).loss.backward()
    opt.step()
    opt.zero_grad()


def test_after_train_the_model_is_plain_again(tmp_path: Path) -> None:
    model = th.tiny_llama()
    before = _state(model)
    tr = make(tmp_path, model=model, max_steps=2)
    tr.train()
    assert _state(model) == before
    copy.deepcopy(model)
    # A plain step: nothing left behind (on main: grad_sample, _forward_counter, summed_grad
    # and the hooks' activations), deepcopy still works, and the update is the one of a model
    # that never had hooks.
    never_hooked = th.tiny_llama()
    never_hooked.load_state_dict(model.state_dict())
    _plain_step(model)
    _plain_step(never_hooked)
    assert _state(model) == before
    copy.deepcopy(model)
    for (name, p), q in zip(model.named_parameters(), never_hooked.parameters(), strict=True):
        assert torch.equal(p, q), name
    # The trainer's read-outs stay: epsilon and the last micro-batch's norms.
    assert 3.96 <= tr.get_epsilon() <= 4.0
    assert tr.dp_module.per_sample_gradient_norms.numel() > 0
    assert tr.evaluate(eval_dataset=th.token_examples(4, seed=3))["epsilon"] == tr.get_epsilon()


def test_a_second_dp_trainer_trains_the_same_model(tmp_path: Path) -> None:
    # Continual learning with a second trainer (Opacus #749); on main: "the model already has
    # Opacus grad-sample hooks attached".
    first = make(tmp_path / "a", max_steps=2)
    first.train()
    after_first = th.params(first.model)
    second = make(
        tmp_path / "b", model=first.model, data=th.token_examples(40, seed=7), max_steps=3
    )
    second.train()
    # Its own run, accounted alone (3 steps at q = 1/5), as a fresh trainer of the same settings.
    fresh = make(tmp_path / "c", data=th.token_examples(40, seed=7), max_steps=3)
    fresh.train()
    assert second.privacy_engine.accountant.history == fresh.privacy_engine.accountant.history
    assert second.get_epsilon() == fresh.get_epsilon()
    assert any(not torch.equal(after_first[n], p) for n, p in th.params(second.model).items())


def test_hooks_are_removed_when_train_raises(tmp_path: Path) -> None:
    calls = {"n": 0}

    def failing_collator(rows):
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("the collator failed")
        return th.pad_collate(rows)

    model = th.tiny_llama()
    before = _state(model)
    tr = make(tmp_path, model=model, collator=failing_collator, max_steps=4)
    with pytest.raises(RuntimeError, match="the collator failed"):
        tr.train()
    assert tr.dp_module is not None  # the model was made private before the failure
    assert _state(model) == before
    copy.deepcopy(model)
    make(tmp_path / "again", model=model, max_steps=1).train()
