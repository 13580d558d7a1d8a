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
# # Swap the accountant: an Opacus script with `accountant="rc"`
#
# You have an Opacus training script and want `opacus_rc`'s accountant -- because you plan to
# move to randomized clipping later, or because you want the privacy loss accounted in both
# adjacency directions (remove *and* add one example) with the PRV method. The change is two
# lines:
#
# ```diff
#  import opacus
# +import opacus_rc                                    # registers the "rc" accountant
# -privacy_engine = opacus.PrivacyEngine()             # accountant="prv"
# +privacy_engine = opacus.PrivacyEngine(accountant="rc")
# ```
#
# Everything else -- ghost clipping, `make_private_with_epsilon`, the training loop,
# `get_epsilon` -- is Opacus' own code. Under `accountant="rc"` every step of a plain Opacus
# optimizer is accounted as **exact clipping** (the accountant only charges for a sketch when
# the optimizer reports one).
#
# This tutorial takes a short Opacus script -- the packaged all-MiniLM-L6-v2 (BERT) fine-tuned
# with ghost clipping to tell spam from ham in the SpamAssassin corpus -- switches its
# accountant, then compares the epsilon of the very same run under Opacus' RDP and PRV
# accountants and `opacus_rc`'s RC accountant, and shows the `opacus-rc` command line tool.
#
# Set `OPACUS_RC_SMOKE=1` to run it in a few seconds (a handful of steps on a few emails).

# %%
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import opacus
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

HERE = Path.cwd() if "__file__" not in globals() else Path(__file__).resolve().parent
if not (HERE / "rc_data.py").exists():
    HERE = HERE / "tutorials"
sys.path.insert(0, str(HERE))
import rc_data  # noqa: E402
import rc_models  # noqa: E402

warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
SMOKE = os.environ.get("OPACUS_RC_SMOKE") == "1"

MAX_LENGTH = 64 if SMOKE else 128  # MiniLM tokens per email (it has 512 positions)
TRAIN_DOCS, TEST_DOCS = (64, 32) if SMOKE else (1200, 400)
BATCH_SIZE = 16 if SMOKE else 32  # expected (Poisson) batch size
EPOCHS = 2
MAX_STEPS = 3 if SMOKE else None
EPSILON, DELTA = 3.0, 1e-5
MAX_GRAD_NORM = 1.0
TRAINABLE_LAYERS = 1  # the top transformer layer (of 6) and the head are trained
LR_HEAD, LR_LAYERS = 1e-2, 1e-4  # the fresh head learns fast, the pretrained layer slowly
torch.manual_seed(0)

# %% [markdown]
# ## The data and the model
#
# A random, stratified subset of the vendored SpamAssassin corpus (real 2002 e-mail; about 30 %
# spam), subject line and body, truncated to `MAX_LENGTH` WordPiece tokens.
#
# The model is the pretrained all-MiniLM-L6-v2 under a small 2-way head of our own:
#
# * **Mean pooling.** all-MiniLM-L6-v2 is a sentence transformer, trained to represent a text
#   by the mean of its last hidden states over the real (unmasked) tokens.
#   `BertForSequenceClassification` reads the `[CLS]` token through BERT's pooler instead,
#   which that training never used; with that stock head (and two trained layers, 256 tokens,
#   one epoch, AdamW at 1e-3) this script learned nothing and ended up predicting 'ham' for
#   every e-mail.
# * **A LayerNorm without parameters** brings the pooled embedding, whose coordinates are
#   about 0.1, to unit scale, so that the head learns at an ordinary learning rate.
# * **A linear head that starts at zero**: the layer below gets no gradient at first, so the
#   first steps spend each example's clipped gradient on the head.
#
# As in many Opacus scripts only the top of the network is trained: here the last transformer
# layer and the head. DP adds noise to every trained parameter, so with 1,200 examples fewer
# is better. Freezing the embeddings also avoids Opacus issue 841 (HF BERT's position ids are
# shared across the batch).

# %%
import random  # noqa: E402

rng = random.Random(0)
train_records = rng.sample(rc_data.load_spam(split="train"), TRAIN_DOCS)
test_records = rng.sample(rc_data.load_spam(split="test"), TEST_DOCS)
tokenizer = rc_models.load_minilm_tokenizer()


def dataset(records):
    texts = [f"Subject: {r['subject']}\n\n{r['text']}" for r in records]
    labels = [r["label"] for r in records]
    return rc_data.TokenizedDataset(texts, labels, tokenizer, max_length=MAX_LENGTH)


train_set, test_set = dataset(train_records), dataset(test_records)
train_loader = DataLoader(train_set, batch_size=BATCH_SIZE, shuffle=True)
test_loader = DataLoader(test_set, batch_size=64)
print(
    f"{len(train_set)} training e-mails ({sum(r['label'] for r in train_records)} spam), "
    f"{len(test_set)} test e-mails ({sum(r['label'] for r in test_records)} spam), "
    f"{MAX_LENGTH} tokens each"
)


class MeanPoolClassifier(nn.Module):
    """A sentence transformer's mean pooling, then a linear head."""

    def __init__(self, encoder, num_labels=2):
        super().__init__()
        self.encoder = encoder
        hidden = encoder.config.hidden_size
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False)
        self.head = nn.Linear(hidden, num_labels)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head(self.norm((hidden * mask).sum(1) / mask.sum(1)))


# the bare BertModel (from_pretrained + .train(), dropout 0), without the unused pooler
encoder = rc_models.load_minilm(task="base", add_pooling_layer=False)
rc_models.freeze_all_but(encoder, trainable_layers=TRAINABLE_LAYERS)
model = MeanPoolClassifier(encoder)
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
print(f"{trainable:,} of {sum(p.numel() for p in model.parameters()):,} parameters trainable")

# %% [markdown]
# ## The Opacus script, with the accountant swapped
#
# From here on this is an ordinary Opacus 1.6 ghost-clipping script. The only `opacus_rc`
# lines are the import and `accountant="rc"`.

# %%
import opacus_rc  # noqa: E402, F401  (registers "rc" in Opacus' accountant registry)

optimizer = torch.optim.AdamW(
    [
        {"params": model.head.parameters(), "lr": LR_HEAD},
        {"params": [p for p in model.encoder.parameters() if p.requires_grad], "lr": LR_LAYERS},
    ]
)
privacy_engine = opacus.PrivacyEngine(accountant="rc")
model, optimizer, criterion, train_loader = privacy_engine.make_private_with_epsilon(
    module=model,
    optimizer=optimizer,
    data_loader=train_loader,
    criterion=nn.CrossEntropyLoss(),
    target_epsilon=EPSILON,
    target_delta=DELTA,
    epochs=EPOCHS,
    max_grad_norm=MAX_GRAD_NORM,
    grad_sample_mode="ghost",
)
sample_rate = 1 / len(train_loader)
print(
    f"accountant: {type(privacy_engine.accountant).__name__}; "
    f"noise multiplier {optimizer.noise_multiplier:.4f} for epsilon {EPSILON} at delta {DELTA}; "
    f"sample rate {sample_rate:.4f}"
)


# %%
def train(model, optimizer, criterion, loader, max_steps=None):
    model.train()
    steps = int(EPOCHS * len(loader)) if max_steps is None else max_steps
    bar = tqdm(total=steps, desc="training", unit="step")
    done = 0
    while done < steps:
        for input_ids, attention_mask, labels in loader:
            optimizer.zero_grad()
            if len(labels) == 0:  # an empty Poisson batch: a noise-only step
                for p in optimizer.params:
                    p.grad = torch.zeros_like(p)
                optimizer.step()
            else:
                logits = model(input_ids=input_ids, attention_mask=attention_mask)
                loss = criterion(logits, labels)
                loss.backward()
                optimizer.step()
                bar.set_postfix(
                    loss=f"{loss.item():.3f}", eps=f"{privacy_engine.get_epsilon(DELTA):.2f}"
                )
            done += 1
            bar.update()
            if done == steps:
                break
    bar.close()


@torch.no_grad()
def accuracy(model, loader):
    model.eval()
    correct = sum(
        (model(input_ids=x, attention_mask=m).argmax(-1) == y).sum().item() for x, m, y in loader
    )
    model.train()
    return correct / len(loader.dataset)


t0 = time.perf_counter()
train(model, optimizer, criterion, train_loader, MAX_STEPS)
print(f"trained in {time.perf_counter() - t0:.0f} s")
test_accuracy = accuracy(model, test_loader)
majority = max(sum(r["label"] for r in test_records), sum(1 - r["label"] for r in test_records))
print(f"test accuracy {test_accuracy:.3f} (always 'ham': {majority / len(test_records):.3f})")
print(f"epsilon = {privacy_engine.get_epsilon(DELTA):.3f} at delta = {DELTA} (RC accountant)")

# %% [markdown]
# ## The same run under three accountants
#
# An accountant is a function of the history of `(noise multiplier, sample rate, steps)`. Give
# this run's history to Opacus' RDP and PRV accountants and to `opacus_rc`'s RC accountant:
#
# * **RDP** (Rényi DP, Mironov 2017) converts to `(epsilon, delta)` through a loose bound: it
#   always over-reports.
# * **PRV** (Gopi, Lee and Wutschitz 2021; Opacus' default) composes the privacy loss random
#   variables numerically: near-tight, for the *remove-one* adjacency.
# * **RC** composes privacy loss random variables as well (with `prv-accountant`), in both
#   directions, *remove* and *add*, and reports the larger; that is the guarantee of
#   add/remove DP. For exact clipping it matches PRV up to its discretisation error; its
#   purpose is randomized clipping, whose steps it also accounts.

# %%
history = [(s, q, n) for (s, q, n, *_) in privacy_engine.accountant.history]
print("history (noise multiplier, sample rate, steps):", history)
rows = []
for name, acc in [
    ("RDP (opacus)", RDPAccountant()),
    ("PRV (opacus)", PRVAccountant()),
    ("RC (opacus_rc)", opacus_rc.RCAccountant()),
]:
    acc.history = list(history)
    rows.append((name, acc.get_epsilon(delta=DELTA)))
report = opacus_rc.RCAccountant()
report.history = list(history)
rep = report.get_epsilon_report(DELTA)
print(f"\n{'accountant':16s}  epsilon at delta={DELTA:g}")
for name, eps in rows:
    print(f"{name:16s}  {eps:.3f}")
print(f"\nRC by direction: remove {rep.remove[2]:.3f}, add {rep.add[2]:.3f}")

# %% [markdown]
# The other way round: the noise multiplier each accountant asks for to reach a target epsilon
# with this run's sample rate and number of steps. A tighter accountant means less noise for
# the same guarantee.

# %%
steps = sum(n for _, _, n in history)
print(f"noise multiplier for {steps} steps at sample rate {sample_rate:.4f}, delta {DELTA:g}")
print(f"{'target epsilon':>14s}  {'RDP':>7s}  {'PRV':>7s}  {'RC':>7s}")
for target in [EPSILON] if SMOKE else [1.0, 3.0, 8.0]:
    sigmas = [
        get_noise_multiplier(
            target_epsilon=target,
            target_delta=DELTA,
            sample_rate=sample_rate,
            steps=steps,
            accountant=mechanism,
            epsilon_tolerance=0.01,
        )  # fmt: skip
        for mechanism in ("rdp", "prv", "rc")
    ]
    print(f"{target:14.1f}  " + "  ".join(f"{s:7.4f}" for s in sigmas))

# %% [markdown]
# ## What randomized clipping would cost: the `opacus-rc` command
#
# `opacus_rc` installs a command, `opacus-rc`, that prints exact-clipping and
# randomized-clipping figures side by side. With this run's noise multiplier, sample rate and
# steps, randomized clipping with `k` sketch columns would have spent:


# %%
def opacus_rc_cli(*args):
    print("$ opacus-rc " + " ".join(args))
    out = subprocess.run(
        [sys.executable, "-m", "opacus_rc.cli", *args], capture_output=True, text=True, check=True
    )
    print(out.stdout)


sigma = optimizer.noise_multiplier
opacus_rc_cli(
    "epsilon", "--noise-multiplier", f"{sigma:.4f}", "--sample-rate", f"{sample_rate:.6f}",
    "--steps", str(steps), "--delta", f"{DELTA:g}", "--sketch-dim", "16", "32", "64",
)  # fmt: skip

# %% [markdown]
# and to keep epsilon at the target it would need this much noise (the ratio is the price of
# the sketch in noise; the memory saving is the subject of the tutorial
# `randomized_clipping_long_documents`):

# %%
opacus_rc_cli(
    "noise-multiplier", "--target-epsilon", f"{EPSILON:g}", "--sample-rate",
    f"{sample_rate:.6f}", "--steps", str(steps), "--delta", f"{DELTA:g}",
    "--sketch-dim", "16", "32", "64",
)  # fmt: skip

# %% [markdown]
# ## Summary
#
# * `import opacus_rc` and `opacus.PrivacyEngine(accountant="rc")` is all an Opacus script
#   needs; ghost clipping, the loss wrapper and `get_epsilon` are untouched.
# * For exact clipping the RC accountant agrees with PRV (and is tighter than RDP), and it
#   accounts the add direction as well as the remove direction.
# * `opacus-rc epsilon` and `opacus-rc noise-multiplier` show what randomized clipping with `k`
#   columns costs in epsilon or in noise, before you train.
# * To train with randomized clipping itself, use `opacus_rc.PrivacyEngine` and
#   `clipping="randomized"` (tutorial `randomized_clipping_long_documents`).
