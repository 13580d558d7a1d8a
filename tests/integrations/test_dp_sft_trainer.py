"""``opacus_rc.integrations.trl.DPSFTTrainer`` (TRL's ``SFTTrainer``) on a tiny random Llama.

A word-level tokenizer built in the test (64 tokens) and random word sequences keep each run
to about a second. Checked: the target epsilon within 1% and in the logs; each example's loss
is the mean of its labelled next-token losses (prompt tokens masked with
``completion_only_loss``, against the model's logits recomputed outside the trainer); LoRA
through ``peft_config`` trains only the adapters, with TRL's default bf16 autocast and
checkpointing; evaluation and generation work; ``packing=True`` and ``padding_free=True`` pack
each Poisson batch's sampled records (not the dataset) and equal the padded run (same records,
same update at sigma = 0, same epsilon); the DFT loss is refused with its reason; without TRL
the import fails with what to install.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

from opacus_rc.integrations.trl import DPSFTTrainer, PrivacyArguments  # noqa: E402

DELTA = 1e-3


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")


def tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(th.VOCAB - 3)]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def sentences(n: int, *, seed: int = 0, lo: int = 3, hi: int = 10) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(
            " ".join(f"w{int(i)}" for i in torch.randint(0, th.VOCAB - 3, (k,), generator=g))
        )
    return out


def text_dataset(n: int = 40, seed: int = 0) -> Any:
    return datasets.Dataset.from_dict({"text": sentences(n, seed=seed)})


def sft_config(tmp_path: Path, **overrides: Any) -> Any:
    kw = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 3,
        "max_steps": 4,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "max_grad_norm": 0.0,
        "use_cpu": True,
        "disable_tqdm": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "dataloader_pin_memory": False,
        "max_length": 16,
    }
    kw.update(overrides)
    return trl.SFTConfig(**kw)


class Recording(DPSFTTrainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[tuple[dict, torch.Tensor]] = []

    def compute_private_loss(self, model, inputs):
        loss = super().compute_private_loss(model, inputs)
        self.losses.append((inputs, loss.loss_per_sample.detach().clone()))
        return loss


def make(tmp_path: Path, *, data: Any = None, privacy: dict | None = None, model: Any = None,
         cls: type = Recording, peft_config: Any = None, **config: Any) -> Any:  # fmt: skip
    p = {"target_epsilon": 4.0, "target_delta": DELTA, "expected_batch_size": 8, "seed": 2}
    p.update(privacy or {})
    return cls(
        model=th.tiny_llama() if model is None else model,
        args=sft_config(tmp_path, **config),
        train_dataset=text_dataset() if data is None else data,
        processing_class=tokenizer(),
        peft_config=peft_config,
        privacy_args=PrivacyArguments(**p),
    )


def test_sft_reaches_target_epsilon_and_logs_it(tmp_path: Path) -> None:
    tr = make(tmp_path, max_steps=5)
    out = tr.train()
    eps = tr.get_epsilon()
    assert 4.0 * 0.99 <= eps <= 4.0
    assert len(tr.privacy_engine.accountant) == 5 == tr.state.global_step
    assert out.metrics["epsilon"] == eps
    assert [h["epsilon"] for h in tr.state.log_history if "non_private/loss" in h][-1] == eps


def test_per_example_loss_is_the_mean_over_completion_tokens(tmp_path: Path) -> None:
    prompts, completions = sentences(40, seed=3, lo=2, hi=5), sentences(40, seed=4, lo=1, hi=4)
    data = datasets.Dataset.from_dict({"prompt": prompts, "completion": completions})
    model = th.tiny_llama()
    start = th.snapshot(model)
    tr = make(tmp_path, data=data, model=model, max_steps=1, completion_only_loss=True)
    tr.train()
    assert tr.losses
    for inputs, losses in tr.losses:
        labels = inputs["labels"]
        assert (labels == -100).any(dim=1).all()  # prompts (and padding) are masked
        logits = start(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
        ).logits
        for i in range(labels.shape[0]):
            target = labels[i, 1:]
            keep = target != -100
            nll = torch.nn.functional.cross_entropy(logits[i, :-1][keep], target[keep])
            torch.testing.assert_close(losses[i], nll, rtol=1e-5, atol=1e-6)


def test_lora_bf16_checkpointing_evaluate_generate(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    tr = make(
        tmp_path,
        peft_config=config,
        max_steps=3,
        bf16=True,  # TRL's defaults: autocast without a loss scaler, and checkpointing
        gradient_checkpointing=True,
        learning_rate=0.05,
    )
    frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    adapters = th.params(tr.model)
    tr.train()
    assert 3.96 <= tr.get_epsilon() <= 4.0
    after = dict(tr.model.named_parameters())
    assert all(torch.equal(after[n].detach(), v) for n, v in frozen.items())
    assert any(not torch.equal(after[n].detach(), v) for n, v in adapters.items())
    metrics = tr.evaluate(eval_dataset=text_dataset(6, seed=9))
    assert math.isfinite(metrics["eval_loss"]) and metrics["epsilon"] == tr.get_epsilon()
    ids = tokenizer()("w1 w2 w3", return_tensors="pt")["input_ids"]
    out = tr.model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"loss_type": "dft"}, "loss_type='nll'"),
        ({"packing": True, "max_length": None}, "packing=True needs max_length"),
    ],
    ids=["dft", "packing_without_max_length"],
)
def test_refused_sft_options(tmp_path: Path, config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **config)


@pytest.mark.parametrize("mode", ["packing", "padding_free"])
def test_packing_with_a_custom_collator_is_refused(tmp_path: Path, mode: str) -> None:
    with pytest.raises(ValueError, match=f"{mode}=True with a custom data_collator"):
        DPSFTTrainer(
            model=th.tiny_llama(),
            args=sft_config(tmp_path, **{mode: True}),
            train_dataset=text_dataset(),
            processing_class=tokenizer(),
            data_collator=th.pad_collate,
            privacy_args=PrivacyArguments(target_epsilon=4.0, target_delta=DELTA,
                                          expected_batch_size=8),
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# packing=True and padding_free=True: the trainer packs each Poisson batch after sampling
# --------------------------------------------------------------------------------------------

SIGMA0 = {"noise_multiplier": 0.0, "target_epsilon": None, "max_grad_norm": 1e3}
SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "weight_decay": 0.0}


def _sft_run(tmp_path: Path, name: str, privacy: dict, **config: Any) -> Any:
    tr = make(tmp_path / name, privacy=privacy, cls=Recording, **config)
    tr.train()
    return tr


@pytest.mark.parametrize(
    "config",
    [{"packing": True}, {"padding_free": True}, {"packing": True, "padding_free": True}],
    ids=["packing", "padding_free", "both"],
)
def test_packing_equals_the_padded_sft_run(tmp_path: Path, config: dict) -> None:
    """TRL's packing=True would pack the dataset before sampling (trl.pack_dataset); the DP
    trainer prepares one record per row and packs each logical batch's sampled records. Same
    seeds: the same records, and at sigma = 0 with C above every norm the same update."""
    kw = {"max_steps": 2, "per_device_train_batch_size": 3, "max_length": 24, **SGD}
    padded = _sft_run(tmp_path, "padded", SIGMA0, **kw)
    packed = _sft_run(tmp_path, "packed", SIGMA0, **config, **kw)
    assert len(packed.train_dataset) == len(padded.train_dataset) == 40  # not packed up front
    assert packed.dp_packing_mode == ("padding_free" if config.get("padding_free") else "packing")
    micro = [inputs for inputs, _ in packed.losses]
    assert all("record_ids" in m and "position_ids" in m for m in micro)
    assert all(("attention_mask" in m) != bool(config.get("padding_free")) for m in micro)
    assert any(  # rows holding several records
        (m["record_ids"][:, 0] != m["record_ids"].max(dim=1).values).any() for m in micro
    )
    n_padded = sum(loss.numel() for _, loss in padded.losses)
    n_packed = sum(loss.numel() for _, loss in packed.losses)
    assert n_packed == n_padded  # per-record losses: the same records
    # Each record's loss inside its pack equals its padded loss (the same records; a logical
    # batch's records are packed longest first, so compared as sorted values).
    torch.testing.assert_close(
        torch.cat([loss for _, loss in packed.losses]).sort().values,
        torch.cat([loss for _, loss in padded.losses]).sort().values,
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip
    a, b = th.params(padded.model), th.params(packed.model)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("config", [{"packing": True}, {"padding_free": True}],
                         ids=["packing", "padding_free"])  # fmt: skip
def test_varlen_packing_equals_the_padded_sdpa_sft_run(tmp_path: Path, config: dict) -> None:
    """The varlen SDPA over records (``opacus_rc.packed_attention``): the
    trainer's packed rows carry no 4D mask (the records come from the position ids, also with
    ``packing=True``) and give the padded SDPA run's update (same seeds, sigma = 0)."""
    from opacus_rc.packed_attention import register_packed_sdpa

    model = th.tiny_llama()
    model.set_attn_implementation(register_packed_sdpa())
    kw = {"max_steps": 2, "per_device_train_batch_size": 3, "max_length": 24, **SGD}
    padded = _sft_run(tmp_path, "padded", SIGMA0, **kw)
    packed = make(tmp_path / "varlen", privacy=SIGMA0, cls=Recording, model=model, **config, **kw)
    packed.train()
    micro = [inputs for inputs, _ in packed.losses]
    assert all("record_ids" in m and "attention_mask" not in m for m in micro)
    assert any((m["record_ids"][:, 0] != m["record_ids"].max(dim=1).values).any() for m in micro)
    torch.testing.assert_close(
        torch.cat([loss for _, loss in packed.losses]).sort().values,
        torch.cat([loss for _, loss in padded.losses]).sort().values,
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip
    a, b = th.params(padded.model), th.params(packed.model)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6)


def test_packed_sft_epsilon_is_the_padded_epsilon(tmp_path: Path) -> None:
    padded = _sft_run(tmp_path, "padded", {}, max_steps=3)
    packed = _sft_run(tmp_path, "packed", {}, max_steps=3, packing=True)
    assert packed.get_epsilon() == padded.get_epsilon() and 3.96 <= packed.get_epsilon() <= 4.0
    metrics = packed.evaluate(eval_dataset=text_dataset(6, seed=9))  # padded evaluation
    assert math.isfinite(metrics["eval_loss"])


def test_refusals_of_the_trainer_apply(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected_batch_size"):
        make(tmp_path, gradient_accumulation_steps=4)


class OwnSFTLoss(DPSFTTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_own_compute_loss_is_refused_trl_s_is_not(tmp_path: Path) -> None:
    """TRL's ``SFTTrainer.compute_loss`` (used by ``evaluate()``) is the loss the DP trainer
    computes per example: the plain ``DPSFTTrainer`` is accepted and trains. A subclass's own
    ``compute_loss``, which training would not call, is refused (on main: accepted, ignored in
    training, used by ``evaluate()``)."""
    tr = make(tmp_path / "a", cls=DPSFTTrainer, max_steps=1)
    tr.train()
    assert len(tr.privacy_engine.accountant) == 1
    with pytest.raises(ValueError, match="OwnSFTLoss overrides compute_loss.*compute_private_loss"):
        make(tmp_path / "b", cls=OwnSFTLoss)


def test_import_without_trl_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "trl", None)  # makes ``import trl`` raise ImportError
    monkeypatch.delitem(sys.modules, "opacus_rc.integrations.trl")
    with pytest.raises(ImportError, match="pip install 'trl>=1.0'.*DPTrainer"):
        importlib.import_module("opacus_rc.integrations.trl")


@pytest.mark.parametrize(
    "config",
    [{}, {"packing": True}, {"padding_free": True}],
    ids=["padded", "packing", "padding_free"],
)
def test_trl_default_bf16_trains_at_the_first_try(tmp_path: Path, config: dict) -> None:
    """TRL's default ``bf16`` (``None``: True unless fp16): accelerate runs the model's forward
    in a bfloat16 autocast it enters inside the forward; the first-batch checks (the padded
    one and the packed-logits one) compute in float32 and pass. Before, packing and
    padding-free were refused at the first batch (``record 0 ... max |difference| 0.000977,
    rounding tolerance 0.000345``)."""
    tr = make(tmp_path, cls=DPSFTTrainer, max_steps=2, bf16=None, **config)
    assert tr.args.bf16 is True
    tr.train()
    assert tr._batch_independence_checked
    assert len(tr.privacy_engine.accountant) == 2
