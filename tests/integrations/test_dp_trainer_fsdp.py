"""``DPTrainer`` under FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2})``),
2-process ``torchrun`` launch on CPU (gloo).

One launch of ``fsdp_trainer_worker.py`` trains the runs of its ``RUNS`` on each rank (a tiny
Llama, sharded by the trainer as accelerate's auto-wrap policy says: its decoder layer, then
the root, which keeps the tied embedding / LM head); each is compared with the same run in
one process (same seed, no FSDP), whose update the single-process tests check against a
float64 per-example oracle
(``test_dp_trainer.py::test_update_is_the_clipped_sum_and_no_example_exceeds_c``). With the
same seed the ranks' shares partition the single process' Poisson batches, so:

* ``clip`` (sigma = 0, clipping active, exact per-example norms: the untied embeddings) and
  ``full`` (sigma = 0, a tied Llama with every weight trainable, RMSNorm included, sketched
  norms, C above every norm), and ``full`` with the Trainer's ``gradient_checkpointing=True``
  (``ckpt``), and LoRA adapters (peft) on the tied Llama (``lora``, the adapters in the decoder
  layer's group beside the frozen base weights): the FSDP2 weights equal the single-process
  weights; the ranks ran the same number of micro-batches at every step (fillers where a
  share needed fewer);
* ``budget`` (noise searched for epsilon 4 over 4 steps, Adam, a rank's share empty at some
  step): the weights equal the single process' too (every rank draws the global noise from the
  same generator and keeps its shard: the noise is the single process' noise), and epsilon and
  the accountant's history equal the single process';
* a run (the tied Llama, every weight trainable, Adam) checkpointed at step 2 with sharded
  state (``SHARDED_STATE_DICT``) and resumed (``resume_exact=True``) ends at the
  uninterrupted run's epsilon, history, Adam state and weights;
* ``save_model`` writes the full model: a plain ``LlamaForCausalLM.from_pretrained`` of it holds
  the trained weights.

Refused FSDP configurations are checked in one process (their messages), as is DeepSpeed's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp_trainer_worker as fw  # noqa: E402

from opacus_rc import PrivacyEngine  # noqa: E402
from opacus_rc.integrations.fsdp import (  # noqa: E402
    filler_micro_batch,
    refuse_fsdp_version,
    refuse_unsupported_fsdp,
)
from opacus_rc.integrations.refusals import refuse_unsupported_parallelism  # noqa: E402


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of both ranks of one ``torchrun --nproc-per-node 2`` launch."""
    out = tmp_path_factory.mktemp("fsdp")
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    env.pop("FSDP_WORKER_RUNS", None)
    worker = Path(__file__).with_name("fsdp_trainer_worker.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(worker), str(out)],
        capture_output=True, text=True, timeout=500, env=env, cwd=out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The same runs in this one process (no FSDP)."""
    out = tmp_path_factory.mktemp("single")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: fw.train(name, out / name)[1] for name in fw.RUNS}


def _check_shares(ranks: list[dict], one: dict) -> None:
    """The ranks' shares partition the single process' logical batches."""
    per_rank = [[n for n, _ in r["shares"]] for r in ranks]
    assert [a + b for a, b in zip(*per_rank)] == [n for n, _ in one["shares"]]


def _check_params(ranks: list[dict], one: dict, *, start: dict, atol: float) -> None:
    assert ranks[0]["params"].keys() == one["params"].keys()
    for name, p in one["params"].items():
        assert not torch.equal(p, start[name]), name  # the run moved every trainable weight
        for r in ranks:
            torch.testing.assert_close(r["params"][name], p, rtol=1e-5, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["clip", "full", "ckpt", "lora"])
def test_fsdp2_sigma_zero_update_equals_single_process(
    launch: list, single: dict, run: str
) -> None:
    ranks, one = [r[run] for r in launch], single[run]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for r in ranks:
        assert r["optimizer"] == "FSDPRandomizedClipOptimizer"
        layer = "base_model.model.model.layers.0" if run == "lora" else "model.layers.0"
        assert r["sharding"] == {"root": True, "groups": [layer], "dtensors": True}
    assert one["optimizer"] == "RandomizedClipOptimizer"
    _check_shares(ranks, one)
    # The ranks' shares needed different numbers of micro-batches at some step (fillers ran).
    assert any(a[1] != b[1] for a, b in zip(ranks[0]["shares"], ranks[1]["shares"]))
    if run == "clip":  # clipping active: every example of the last micro-batch is clipped
        assert one["last_norms"].numel() >= 1
        assert float(one["last_norms"].min()) > fw.RUNS["clip"]["privacy"]["max_grad_norm"]
    start = fw.full_params(fw.model_for(run))
    _check_params(ranks, one, start=start, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_dp_sft_trainer_update_equals_single_process(launch: list, tmp_path: Path) -> None:
    """``DPSFTTrainer`` (TRL) under FSDP2, the ``full`` run's settings (tied Llama, every weight
    trainable, sigma = 0, clip factors 1): the weights equal the same run in one process."""
    pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = fw.train_sft(tmp_path)
    assert one["optimizer"] == "RandomizedClipOptimizer"
    start = fw.full_params(fw.model_for("full"))
    for r in launch:
        assert r["sft"]["optimizer"] == "FSDPRandomizedClipOptimizer"
        assert r["sft"]["epsilon_history"] == one["epsilon_history"]
    _check_params([r["sft"] for r in launch], one, start=start, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_noise_and_epsilon_equal_single_process(launch: list, single: dict) -> None:
    ranks, one = [r["budget"] for r in launch], single["budget"]
    _check_shares(ranks, one)
    assert any(n == 0 for r in ranks for n, _ in r["shares"])  # a share of fillers only
    _check_params(ranks, one, start=fw.full_params(fw.model_for("budget")), atol=1e-5)
    [(sigma, q, steps, spec)] = one["history"]
    assert steps == 4 and q == 1 / 14  # q = 1 / ceil(40 / 3)
    fresh = PrivacyEngine(accountant="rc").accountant
    fresh.history = [(sigma, q, steps, spec)]
    reference = fresh.get_epsilon(fw.DELTA)
    assert 4.0 - 0.01 <= reference <= 4.0
    for r in ranks:
        assert r["history"] == one["history"] and r["noise_multiplier"] == sigma
        assert r["epsilon"] == one["epsilon"] == pytest.approx(reference, rel=1e-12)


@pytest.mark.slow
def test_fsdp2_sharded_resume_equals_uninterrupted(launch: list) -> None:
    """Saved at step 2 with ``SHARDED_STATE_DICT`` (model and optimizer as
    ``torch.distributed.checkpoint`` folders, the privacy state beside them), resumed on both
    ranks with ``resume_exact=True``: epsilon, history, Adam's step counts and the weights equal
    the uninterrupted run's."""
    for r in launch:
        a, b, files = r["resume"]["uninterrupted"], r["resume"]["resumed"], r["resume"]["files"]
        assert any(f.startswith("pytorch_model_fsdp_0/") for f in files), files
        assert any(f.startswith("optimizer_0/") for f in files), files
        assert "privacy_state.pt" in files
        assert b["epsilon"] == a["epsilon"] and b["history"] == a["history"]
        assert (
            b["adam_steps"] == a["adam_steps"] and a["adam_steps"] and set(a["adam_steps"]) == {4.0}
        )
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_fsdp2_save_model_loads_into_a_plain_model(launch: list) -> None:
    """``save_model`` after a sharded run (``SHARDED_STATE_DICT``, with which the Trainer's own
    ``save_model`` writes nothing) writes the full model: ``from_pretrained`` into a plain
    ``LlamaForCausalLM`` gives the trained weights, every one of them."""
    saved = launch[0]["saved"]["params"]
    trained = launch[0]["full_after_save"]
    assert trained.keys() <= saved.keys()
    for name, p in trained.items():
        assert torch.equal(saved[name], p), name
    assert saved.keys() == trained.keys()  # every weight trainable; the tied one once


# ----------------------------------------------------------------------------------------------
# Refusals (one process: the checks read the trainer's configuration only)
# ----------------------------------------------------------------------------------------------


def _trainer(**plugin: Any) -> SimpleNamespace:
    """A stand-in for a DP trainer with accelerate's FSDP plugin ``plugin``."""
    defaults = {"fsdp_version": 2, "activation_checkpointing": False, "cpu_offload": False,
                "cpu_ram_efficient_loading": False, "ignored_modules": None,
                "mixed_precision_policy": None}  # fmt: skip
    state = SimpleNamespace(fsdp_plugin=SimpleNamespace(**{**defaults, **plugin}))
    return SimpleNamespace(
        args=SimpleNamespace(fsdp_plugin_args={"fsdp_version": plugin.get("fsdp_version", 2)}),
        is_fsdp_enabled=True,
        accelerator=SimpleNamespace(state=state, mixed_precision="no"),
        privacy_args=SimpleNamespace(privacy_unit=None),
    )


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        ({"fsdp_version": 1}, 'fsdp_config={"version": 2}'),
        ({"activation_checkpointing": True}, 'fsdp_config["activation_checkpointing"]=True'),
        ({"cpu_offload": True}, 'fsdp="... offload") or fsdp_config["cpu_offload"]'),
        ({"cpu_ram_efficient_loading": True}, "set it to False"),
        ({"ignored_modules": ["lm_head"]}, "ignored_modules"),
        ({"mixed_precision_policy": object()}, "train in full precision (bf16=False)"),
    ],
)
def test_fsdp_refusals_say_what_to_change(plugin: dict, expected: str) -> None:
    with pytest.raises(NotImplementedError, match="FSDP") as err:
        refuse_unsupported_fsdp(_trainer(**plugin))
    assert expected in str(err.value)


def test_fsdp_refuses_privacy_unit_and_a_missing_plugin() -> None:
    trainer = _trainer()
    trainer.privacy_args.privacy_unit = "doc"
    with pytest.raises(NotImplementedError, match="privacy_unit='doc'.*DDP"):
        refuse_unsupported_fsdp(trainer)
    trainer = _trainer()
    trainer.accelerator.state.fsdp_plugin = None
    with pytest.raises(NotImplementedError, match="no FSDP plugin.*use_configured_state"):
        refuse_unsupported_fsdp(trainer)
    trainer.args.fsdp_plugin_args = {"fsdp_version": 1}  # no plugin: the arguments' version
    with pytest.raises(NotImplementedError, match="FSDP version 1"):
        refuse_unsupported_fsdp(trainer)
    refuse_unsupported_fsdp(_trainer())  # FSDP2 with the defaults: accepted


def test_fsdp_version_1_is_refused_before_accelerate_builds_its_plugin(tmp_path: Path) -> None:
    """FSDP version 1 gets the trainer's message (use version 2) at construction, before
    accelerate's plugin fails on CPU with its own unrelated error (sync_module_states); FSDP2
    (the default of ``fsdp=True``) and no FSDP pass."""
    import trainer_helpers as th

    from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v1 = th.training_args(tmp_path, fsdp=True, fsdp_config={"version": 1})
        refuse_fsdp_version(th.training_args(tmp_path, fsdp=True))
        refuse_fsdp_version(th.training_args(tmp_path))
        with pytest.raises(NotImplementedError, match="FSDP version 1") as err:
            refuse_fsdp_version(v1)
        assert 'fsdp_config={"version": 2}' in str(err.value)
        pa = PrivacyArguments(target_epsilon=4.0, expected_batch_size=8, target_delta=1e-5)
        with pytest.raises(NotImplementedError, match="FSDP version 1"):
            DPTrainer(
                model=th.tiny_llama(),
                args=v1,
                train_dataset=th.token_examples(16),
                privacy_args=pa,
            )


def test_deepspeed_is_refused_saying_why_and_what_to_use() -> None:
    trainer = SimpleNamespace(args=SimpleNamespace(n_gpu=1), is_deepspeed_enabled=True)
    with pytest.raises(NotImplementedError) as err:
        refuse_unsupported_parallelism(trainer)
    message = str(err.value)
    assert "DeepSpeed through the Trainer is not supported" in message
    assert "before per-example clipping could see them" in message
    assert "fsdp=True, fsdp_config={'version': 2}" in message


def test_filler_micro_batch_has_zero_gradient() -> None:
    """A filler (every label -100) has per-example loss 0 and a zero gradient: it adds
    nothing to a clipped sum."""
    import trainer_helpers as th

    from opacus_rc.integrations.per_sample_loss import per_token_targets

    batch = th.pad_collate(th.token_examples(1))
    filler = filler_micro_batch(batch)
    assert torch.equal(filler["input_ids"], batch["input_ids"])
    assert (filler["labels"] == -100).all() and (batch["labels"] != -100).any()
    model = th.tiny_llama(tie=False)
    logits = model(input_ids=filler["input_ids"], attention_mask=filler["attention_mask"]).logits
    logits, targets = per_token_targets(logits, filler["labels"], shift=True)
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    per_token.sum().backward()
    assert float(per_token.sum()) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    with pytest.raises(ValueError, match="labels"):
        filler_micro_batch({"input_ids": batch["input_ids"]})


@pytest.mark.slow
def test_torchrun_tutorial_trainer_fsdp(tmp_path: Path) -> None:
    """tutorials/distributed_training.py --parallel trainer-fsdp under torchrun (2 CPU
    processes, gloo): the tied tiny Llama, every weight trainable, trains through DPTrainer
    under FSDP2 (the engine's FSDP2 optimizer), accounts its steps on the searched noise (epsilon
    at most the target, within 0.01), and the full model it saves loads into a plain, tied
    ``LlamaForCausalLM``. The view-tensor warning is silenced for the root only."""
    import re

    import transformers

    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(root / "tutorials" / "distributed_training.py"), "--parallel", "trainer-fsdp",
         "--steps-per-epoch", "2", "--seq-len", "12"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.search(
        r"FSDPRandomizedClipOptimizer: 2 steps accounted, epsilon ([0-9.]+)", proc.stdout
    )
    assert found, proc.stdout[-2000:]
    assert 8.0 - 0.01 <= float(found.group(1)) <= 8.0
    assert "returned a view tensor" not in proc.stderr, proc.stderr[-4000:]
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "distributed_training_trainer_fsdp"
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.num_hidden_layers == 2
