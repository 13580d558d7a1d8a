#!/usr/bin/env python
"""Differentially private classification of 2,048-token documents on SmolLM2-135M (DP-SGD-RC).

The project's main job. A pretrained language model (SmolLM2-135M, Llama architecture, 8,192
positions) learns to tell imaginative prose (fiction, mystery, romance, ...) from informative
prose (news, government, learned, ...) in the Brown corpus, reading the first 2,048 tokens of
each document, with (epsilon, delta)-differential privacy for every *document*.

Training uses randomized clipping (``clipping="randomized"``): the per-document gradient norm
of every ``nn.Linear`` layer is estimated with a Gaussian sketch of ``k`` columns, at a cost of
O(B T k) memory instead of the O(B T^2) Gram matrices of Opacus' ghost clipping; each document
is clipped with the estimate and Gaussian noise is added as in DP-SGD. ``make_private_with_epsilon``
finds the noise multiplier with the RC accountant, which accounts for the randomness of the
sketch, so the reported epsilon is a real upper bound.

Only the top of the network is trained (``--trainable-layers`` decoder blocks, the final norm and
the classification head); the rest is frozen. See ``tutorials/README.md`` and the tutorial
``randomized_clipping_long_documents`` for the walk-through.

What the run measures besides accuracy (the results table and ``--output-json``):

* the share of each document's squared clipped norm that comes from sketched layers (the
  block's ``nn.Linear`` weights; the head, biases and RMSNorms are exact), and the fraction of
  documents clipped at each step (``n_hat_i > C``);
* how far the decoder block moved, ``||theta - theta_0|| / ||theta_0||``, beside what the DP
  noise alone moves it;
* an ablation run as the job runs: the head alone on the frozen pretrained model (a DP linear
  probe), same epsilon, noise multiplier and Poisson batches, over ``--ablation-seeds`` noise
  seeds.

At the default settings this is, in effect, a DP linear probe: the block moves only by its DP
noise, the exactly computed head carries nearly all of every clipped norm, and the head alone
does as well (README, "The main job"; the comment at ``LOGIT_SCALE``).

Usage::

    python tutorials/long_document_classification.py              # default run (~15 min, 2 cores)
    python tutorials/long_document_classification.py --clipping ghost
    python tutorials/long_document_classification.py --clipping none
    python tutorials/long_document_classification.py --smoke      # a few steps at length 128 (CI)
    python tutorials/long_document_classification.py --help
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may touch the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rc_data  # noqa: E402  (the vendored corpora, tutorials/data/)
import rc_models  # noqa: E402  (the packaged SmolLM2 weights)

import opacus_rc  # noqa: E402, F401  (registers the "rc" accountant in Opacus)
from opacus_rc import PrivacyEngine  # noqa: E402
from opacus_rc.grad_sample.routing import NormPath  # noqa: E402
from opacus_rc.optimizers import RandomizedClipOptimizer  # noqa: E402

# Opacus warns on every two-pass backward and about the non-cryptographic noise RNG; neither
# matters for this example (pass secure_mode=True to PrivacyEngine for a real deployment).
warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")

# Settings of the default run, chosen so that it takes at most 20 minutes on 2 CPU cores.
DEFAULTS = {
    "clipping": "randomized",
    "sketch": "hutchinson",
    "sketch_dim": 32,
    "epsilon": 8.0,
    "delta": 1e-5,
    "max_length": 2048,
    "num_layers": 2,
    "trainable_layers": 1,
    "epochs": 1.0,
    "batch_size": 8,
    "lr": 5e-5,
    "body_lr": 1e-6,
    "max_grad_norm": 100.0,
}
# The logits are LOGIT_SCALE * head(centred pooled vector), s = LOGIT_SCALE. One clip bound C
# covers every trainable parameter of a document, so the split of ||g_i|| between the head and
# the decoder block decides what is learned. In the natural parametrisation W' = s W of the
# head, the head's per-document gradient is g' = (p - y) [pooled, 1] (norm ~3.5 |p - y| here),
# and the real one is s g'; the block's, s W^T (p - y) d pooled / d theta = W'^T (...), does not
# depend on s. So s multiplies the head's share of ||g_i|| and leaves the block's alone: at
# s = 1 and 10 the block's part dominated (measured: ~20 against the head's ~2 at s = 10), the
# clipped head gradient shrank and its noise won.
# In natural units the head then trains with clip bound C / s and learning rate lr s^2 (noise
# std sigma C / s per coordinate of W'), so C must grow with s: with C = 1 and s = 100 the head
# was clipped at 0.01, every document pushed with the same force however well it was already
# classified (the majority class three times as often), the training loss rose after ~10 steps
# and test accuracy ended at 0.80-0.83. A simulation of this head on the real features, 20
# seeds, 50 steps, sigma 0.545 (mean test accuracy): C / s = 0.01 -> 0.83, 0.1 -> 0.91,
# 0.3 -> 0.93, 1 -> 0.94. Hence C = s = 100 and lr = 0.5 / s^2; body_lr = 1e-6 gives the block
# the same noise per step (body_lr sigma C / B) as body_lr = 1e-4 at C = 1, which kept it near its
# pretrained weights (1e-3 at C = 1 made the loss rise within 20 steps).
# The block cannot learn here at any rate: its 3.5 M weights get noise of norm
# sigma C / B sqrt(3.5e6) ~ 1.3e4 per step against a clipped signal of norm at most C = 100
# (in practice ~0.06 of each document's norm: its share of n_hat^2 is ~0.003), so its
# displacement is the noise's to three digits at every body_lr (the job prints both). Measured
# at 512 tokens (same batches, noise seed 0): body_lr 0 / 1e-6 / 1e-5 / 1e-4 / 1e-3 ->
# relative change 0 / 2.5e-4 / 2.5e-3 / 2.5e-2 / 0.25, test accuracy 0.85 / 0.85 / 0.85 / 0.84 /
# 0.74 (majority 0.74); the head alone 0.86-0.94 over 10 noise seeds (mean 0.90)
# (tutorials/outputs/long_documents_body_lr.md). So the default keeps body_lr = 1e-6 and says
# what it is: a DP linear probe, with the block's sketched norms computed and clipped with, but
# its updates noise.
LOGIT_SCALE = 100.0
# --smoke: the real model and data, a few steps at a short length, under ~90 s.
SMOKE = {"max_length": 128, "max_steps": 3, "batch_size": 4, "train_docs": 48, "test_docs": 8}


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="DP training of a document classifier on SmolLM2-135M (its top block, "
        "final norm and a mean-pooling head) on long documents with randomized clipping "
        "(opacus_rc). Prints a progress bar, then a results table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = DEFAULTS
    p.add_argument(
        "--clipping",
        choices=["randomized", "ghost", "none"],
        default=d["clipping"],
        help="randomized: DP-SGD-RC, sketched per-sample norms (opacus_rc); ghost: Opacus' "
        "exact ghost clipping (same RC accountant, exact-clipping mode); none: non-private",
    )
    p.add_argument("--sketch", choices=["hutchinson", "hutch++"], default=d["sketch"])
    p.add_argument(
        "--sketch-dim", type=int, default=d["sketch_dim"], help="k, columns of the sketch"
    )
    p.add_argument("--epsilon", type=float, default=d["epsilon"], help="target epsilon")
    p.add_argument("--delta", type=float, default=d["delta"], help="target delta")
    p.add_argument(
        "--max-length",
        type=int,
        default=d["max_length"],
        help="tokens read from each document (Brown documents have 2.2k-3.8k)",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=d["num_layers"],
        help="decoder blocks of SmolLM2 kept (of 30); the blocks above are dropped",
    )
    p.add_argument(
        "--trainable-layers",
        type=int,
        default=d["trainable_layers"],
        help="top decoder blocks trained (the final norm and the head always are)",
    )
    p.add_argument("--epochs", type=float, default=d["epochs"], help="epochs (may be fractional)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=d["batch_size"],
        help="expected batch size (Poisson sampling rate = batch size / training documents)",
    )
    p.add_argument("--lr", type=float, default=d["lr"], help="SGD learning rate of the head")
    p.add_argument(
        "--body-lr",
        type=float,
        default=d["body_lr"],
        help="SGD learning rate of the trainable decoder blocks and the final norm",
    )
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=d["max_grad_norm"],
        help="clip bound C of each document's gradient (the logits are scaled by LOGIT_SCALE = "
        "100, so C = 100 clips the head at 1 in its natural units; see the comment there)",
    )
    p.add_argument("--dataset", choices=["brown", "spam"], default="brown")
    p.add_argument(
        "--train-docs",
        type=int,
        default=None,
        help="use a random subset of this many training documents (default: all; spam: 400)",
    )
    p.add_argument(
        "--test-docs",
        type=int,
        default=None,
        help="evaluate on a random subset of this many test documents (default: all; spam: 100)",
    )
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument(
        "--ablation-seeds",
        type=int,
        default=10,
        help="runs of the ablation (the head alone on the frozen pretrained model, same "
        "privacy budget and batches) after the main run, one per DP-noise seed (seed, "
        "seed + 1, ...; a few seconds each); 0 skips it",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split, head and data order")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CI setting: a few steps at length 128 on a few documents (real model and data)",
    )
    p.add_argument("--output-json", type=Path, default=None, help="write the results table here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    if args.dataset == "spam":
        args.train_docs = 400 if args.train_docs is None else args.train_docs
        args.test_docs = 100 if args.test_docs is None else args.test_docs
    if not 0 <= args.trainable_layers <= args.num_layers <= 30:
        p.error("need 0 <= --trainable-layers <= --num-layers <= 30")
    return args


# ------------------------------------------------------------------------------------------------
# Data and model
# ------------------------------------------------------------------------------------------------


def load_texts(args: argparse.Namespace) -> tuple[list[str], list[int], list[str], list[int]]:
    """Train/test texts and labels (deterministic stratified split of the vendored corpus)."""
    if args.dataset == "brown":  # 1 = imaginative, 0 = informative
        train = rc_data.load_brown(split="train", seed=args.seed)
        test = rc_data.load_brown(split="test", seed=args.seed)
        text = lambda r: r["text"]  # noqa: E731
    else:  # 1 = spam, 0 = ham
        train = rc_data.load_spam(split="train", seed=args.seed)
        test = rc_data.load_spam(split="test", seed=args.seed)
        text = lambda r: f"Subject: {r['subject']}\n\n{r['text']}"  # noqa: E731
    rng = random.Random(args.seed)
    if args.train_docs is not None and args.train_docs < len(train):
        train = sorted(rng.sample(train, args.train_docs), key=lambda r: r["id"])
    if args.test_docs is not None and args.test_docs < len(test):
        test = sorted(rng.sample(test, args.test_docs), key=lambda r: r["id"])
    return (
        [text(r) for r in train],
        [r["label"] for r in train],
        [text(r) for r in test],
        [r["label"] for r in test],
    )


class DocumentClassifier(nn.Module):
    """The trainable top of SmolLM2, mean-pooled over each document's tokens, and a linear head.

    It reads the *output of the frozen blocks* (``inputs_embeds``, see :func:`frozen_features`),
    runs the top ``--trainable-layers`` decoder blocks and the final RMSNorm, averages over the
    real (unpadded) tokens and classifies. Mean pooling lets every token of the 2,048 contribute
    to the label (Hugging Face's ``LlamaForSequenceClassification`` reads only the last token, a
    much weaker signal here). The pooled vector is centred on ``center``, the mean
    representation of *public* text (see :func:`set_public_center`): pooled hidden states of any
    English text share a large common component, which clipped and noised gradients cannot learn
    around in a few steps.
    """

    def __init__(self, top: nn.Module, num_labels: int) -> None:
        super().__init__()
        self.top = top  # transformers' LlamaModel cut to the trainable blocks (and the frozen
        # embeddings, unused)
        self.head = nn.Linear(top.config.hidden_size, num_labels)
        # Zero-initialised head: the first steps' per-document gradients are the head's
        # alone (the blocks' are W^T (p - y) d pooled / d theta = 0), so the clip budget C goes
        # to what learns fastest.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.register_buffer("center", torch.zeros(top.config.hidden_size))
        self.logit_scale = LOGIT_SCALE

    def pool(self, features: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(B, T, hidden)`` frozen-block output and ``(B, T)`` mask -> ``(B, hidden)``."""
        hidden = self.top(inputs_embeds=features, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1): 0 on padding
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)

    def forward(self, features: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pooled = self.pool(features, attention_mask) - self.center
        return self.logit_scale * self.head(pooled)  # (B, labels)


def load_body(args: argparse.Namespace) -> nn.Module:
    """SmolLM2-135M's embeddings, first ``--num-layers`` decoder blocks and final norm, frozen
    (transformers' ``LlamaModel``, no head)."""
    body = rc_models.load_smollm2(task="classification", seed=args.seed).model
    body.layers = nn.ModuleList(list(body.layers)[: args.num_layers])
    body.config.num_hidden_layers = args.num_layers
    return body.requires_grad_(False)


@contextlib.contextmanager
def frozen_bottom(body: nn.Module, n_frozen: int) -> Iterator[nn.Module]:
    """``body`` cut to its embeddings and first ``n_frozen`` blocks, in eval mode, with the
    final norm replaced by the identity: its ``last_hidden_state`` is the input of block
    ``n_frozen``. Restored on exit."""
    layers, norm, training = body.layers, body.norm, body.training
    body.layers, body.norm = nn.ModuleList(list(layers)[:n_frozen]), nn.Identity()
    body.eval()
    try:
        yield body
    finally:
        body.layers, body.norm = layers, norm
        body.train(training)


@torch.no_grad()
def frozen_features(
    bottom: nn.Module, data: rc_data.TokenizedDataset, *, desc: str, disable: bool
) -> torch.Tensor:
    """The frozen blocks' output for every document, ``(N, T, hidden)`` float32, computed once.

    Nothing below the first trainable block is trained, so its input is a fixed function of
    each document (with public weights): computing it once instead of at every step is exact
    (``tests/tutorials/test_main_job.py`` checks it) and does not change the privacy analysis,
    since each document still enters only its own row.
    """
    out = []
    for i in tqdm(range(0, len(data), 4), desc=desc, unit="batch", disable=disable):
        ids, mask = data.input_ids[i : i + 4], data.attention_mask[i : i + 4]
        out.append(bottom(input_ids=ids, attention_mask=mask).last_hidden_state.float())
    return torch.cat(out) if out else torch.zeros(0, data.max_length, bottom.config.hidden_size)


def public_reference(tokenizer, args: argparse.Namespace) -> rc_data.TokenizedDataset:
    """The first ``--max-length`` tokens of a few State of the Union addresses (public domain,
    vendored in ``tutorials/data/``, not part of the training data)."""
    speeches = rc_data.load_sotu()
    n = 2 if args.smoke else 8
    picks = [speeches[round(i * (len(speeches) - 1) / (n - 1))]["text"] for i in range(n)]
    return rc_data.TokenizedDataset(picks, None, tokenizer, max_length=args.max_length)


def build_classifier(
    body: nn.Module, args: argparse.Namespace, public: tuple[torch.Tensor, torch.Tensor]
) -> tuple[DocumentClassifier, dict[str, int]]:
    """The classifier on the top ``--trainable-layers`` blocks of ``body`` (trainable with the
    final norm and the head), its features centred on the public reference ``(features,
    mask)``, which costs no privacy."""
    n_frozen = args.num_layers - args.trainable_layers
    total = sum(p.numel() for p in body.parameters())
    body.layers = nn.ModuleList(list(body.layers)[n_frozen:])
    body.config.num_hidden_layers = len(body.layers)
    body.layers.requires_grad_(True)
    body.norm.requires_grad_(True)
    torch.manual_seed(args.seed)
    model = DocumentClassifier(body, num_labels=2).train()
    with torch.no_grad():
        model.eval()
        model.center.copy_(model.pool(*public).mean(dim=0))
        model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return model, {"trainable": trainable, "total": total + model.head.weight.numel() + 2}


class PooledHead(nn.Module):
    """The ablation: :class:`DocumentClassifier`'s head alone, on pooled features of the frozen
    pretrained top (a linear probe). ``(B, hidden)`` pooled vectors -> ``(B, labels)`` logits,
    with the same centring, logit scale and zero initialisation as the full classifier."""

    def __init__(self, center: torch.Tensor, num_labels: int) -> None:
        super().__init__()
        self.head = nn.Linear(center.numel(), num_labels)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.register_buffer("center", center.detach().clone())
        self.logit_scale = LOGIT_SCALE

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.logit_scale * self.head(pooled - self.center)


@torch.no_grad()
def pooled_features(
    model: DocumentClassifier, features: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``model.pool`` of every document at the model's current (pretrained) weights,
    ``(N, hidden)``: the input of the head-only ablation, computed once."""
    training = model.training
    model.eval()
    out = [model.pool(features[i : i + 4], mask[i : i + 4]) for i in range(0, len(features), 4)]
    model.train(training)
    return torch.cat(out) if out else torch.zeros(0, model.center.numel())


def sketched_parameter_names(model: nn.Module) -> frozenset[str]:
    """Names of the trainable parameters whose per-document norm is a *sketch*.

    A parameter counts as sketched when its module's route (``model.norm_routes``, the
    library's record of how each module's norm is computed) is ``SKETCHED`` or ``TIED``, it
    is the module's ``weight`` and the module reads a sequence: the ``nn.Linear`` layers of the
    trained decoder blocks, whose inputs are ``(B, T, d)``. Everything else is exact: the
    biases (the sum of the output gradient over tokens), the RMSNorm weights (Opacus' per-sample
    gradients) and the head, which reads the pooled ``(B, hidden)`` vector, for which the
    library's ``nn.Linear`` sampler computes ``||g_i|| ||a_i||`` exactly
    (:func:`opacus_rc.grad_sample.compute_linear_sketched_norm_sample`: "weight norms of rank-2
    inputs ... are exact"). ``tests/tutorials/test_main_job.py`` checks the split empirically
    (two sketch seeds change exactly these norms).

    Args:
        model: The model returned by ``make_private`` (``clipping="randomized"``).

    Returns:
        The qualified parameter names, as keys of ``model.norm_samples``.
    """
    return frozenset(
        f"{route.name}.weight"
        for route in model.norm_routes.values()
        if route.path in (NormPath.SKETCHED, NormPath.TIED) and route.name.startswith("top.")
    )


def norm_split(
    norm_samples: dict[str, torch.Tensor], sketched: frozenset[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document's norm estimate and the share of its square that sketched layers give.

    With per-parameter norms ``n_{i,q}`` (``model.norm_samples``), the norm the step clipped
    with is ``n_hat_i = sqrt(sum_q n_{i,q}^2)`` (docs/privacy/estimators.md, several layers),
    and the clipped gradient is ``min(1, C / n_hat_i)`` times the whole gradient, so the share
    of the *clipped* squared norm from the sketched parameters is that of the unclipped one:
    ``s_i = sum_{q sketched} n_{i,q}^2 / n_hat_i^2`` (0 where ``n_hat_i = 0``).

    Args:
        norm_samples: ``{parameter name: (B,) norm}``.
        sketched: The names counted as sketched (:func:`sketched_parameter_names`).

    Returns:
        ``(n_hat, s)``, both ``(B,)`` float64.
    """
    squares = {name: t.detach().double().cpu() ** 2 for name, t in norm_samples.items()}
    total = torch.stack(list(squares.values())).sum(dim=0)
    part = sum((sq for name, sq in squares.items() if name in sketched), torch.zeros_like(total))
    share = torch.where(total > 0, part / total.clamp(min=1e-300), torch.zeros_like(total))
    return total.sqrt(), share


class NormRecorder:
    """Per-step record of the norms each step clipped with (read after ``optimizer.step()``).

    For every non-empty step: the ``(B,)`` per-document norm estimates ``n_hat_i`` and, under
    randomized clipping, each document's sketched share of ``n_hat_i^2``
    (:func:`norm_split`). A document is clipped when ``n_hat_i > C``. These are the
    non-privatized norms, recorded for the results table only (as Opacus' own
    ``per_sample_gradient_norms``); nothing here feeds back into training.
    """

    def __init__(self, model: nn.Module, *, clipping: str, max_grad_norm: float) -> None:
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.randomized = clipping == "randomized"
        self.private = clipping != "none"
        self.sketched = sketched_parameter_names(model) if self.randomized else frozenset()
        self.norms: list[list[float]] = []
        self.shares: list[list[float]] = []

    def record(self) -> None:
        if not self.private:
            return
        if self.randomized:
            norms, shares = norm_split(self.model.norm_samples, self.sketched)
            self.shares.append(shares.tolist())
        else:  # Opacus' ghost clipping keeps the last step's norms
            norms = self.model.per_sample_gradient_norms.detach().double().cpu()
        self.norms.append(norms.tolist())

    def summary(self) -> dict[str, Any]:
        """Means and ranges over documents (shares) and over steps (clipped fractions)."""
        if not self.norms:
            return {"norms_per_step": None, "clipped_fraction": None, "sketched_share": None}
        c = self.max_grad_norm
        fractions = [sum(n > c for n in step) / len(step) for step in self.norms]
        shares = [s for step in self.shares for s in step]
        all_norms = [n for step in self.norms for n in step]
        out: dict[str, Any] = {
            "norms_per_step": self.norms,
            "norm_mean": sum(all_norms) / len(all_norms),
            "clipped_fraction_per_step": fractions,
            "clipped_fraction": {
                "mean": sum(fractions) / len(fractions),
                "min": min(fractions),
                "max": max(fractions),
            },
            "sketched_share": None,
        }
        if shares:
            out["sketched_share_per_step"] = self.shares
            out["sketched_share"] = {
                "mean": sum(shares) / len(shares),
                "min": min(shares),
                "max": max(shares),
                "sketched_parameters": len(self.sketched),
            }
        return out


def weight_change(before: dict[str, torch.Tensor], module: nn.Module) -> float:
    """``||theta - theta_0|| / ||theta_0||`` over the parameters in ``before`` (name ->
    initial value, names of ``module.named_parameters()``)."""
    after = dict(module.named_parameters())
    delta = sum(float(((after[n].detach() - p) ** 2).sum()) for n, p in before.items())
    base = sum(float((p**2).sum()) for p in before.values())
    return math.sqrt(delta / base)


# ------------------------------------------------------------------------------------------------
# Training and evaluation
# ------------------------------------------------------------------------------------------------


def make_private(args, model, optimizer, train_loader):
    """Wrap model, optimizer, loss and loader for DP training; ``engine`` is None if non-private."""
    criterion = nn.CrossEntropyLoss()
    if args.clipping == "none":
        return None, model, optimizer, criterion, train_loader
    engine = PrivacyEngine(accountant="rc")
    if args.clipping == "randomized":
        options = {"clipping": "randomized", "sketch": args.sketch, "sketch_dim": args.sketch_dim}
    else:  # Opacus' ghost clipping
        options = {"clipping": "flat", "grad_sample_mode": "ghost"}
    model, optimizer, criterion, train_loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        criterion=criterion,
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        max_grad_norm=args.max_grad_norm,
        poisson_sampling=True,
        **options,
    )
    return engine, model, optimizer, criterion, train_loader


def batch_generator(args: argparse.Namespace) -> torch.Generator:
    """The generator of the Poisson batches (Opacus' ``DPDataLoader`` takes the loader's): its
    own, so that the main run and the ablation draw the same batches whatever the noise
    draws from torch's global generator."""
    return torch.Generator().manual_seed(args.seed)


def noise_only_step(optimizer) -> None:
    """An empty Poisson batch: no document, but the step is still noised and accounted.

    The model cannot run on zero documents (its attention reshapes by the batch size).
    Randomized clipping's optimizer has a step for exactly this
    (``RandomizedClipOptimizer.noise_only_step``: its step protocol refuses gradients that no
    clipped backward produced); Opacus' optimizers noise the zero gradients set here."""
    if isinstance(optimizer, RandomizedClipOptimizer):
        optimizer.noise_only_step()
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()


def train(
    args,
    engine,
    model,
    optimizer,
    criterion,
    train_loader,
    *,
    desc: str = "training",
    after_step: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Train for ``--epochs`` (at most ``--max-steps``); records each step's norms.
    ``after_step`` is called after every step, empty ones included."""
    n_steps = math.ceil(args.epochs * len(train_loader))
    if args.max_steps is not None:
        n_steps = min(n_steps, args.max_steps)
    model.train()
    losses: list[float] = []
    recorder = NormRecorder(model, clipping=args.clipping, max_grad_norm=args.max_grad_norm)
    bar = tqdm(total=n_steps, desc=desc, unit="step", disable=args.no_progress)
    step = 0
    while step < n_steps:
        for *inputs, labels in train_loader:
            optimizer.zero_grad()
            if labels.shape[0] == 0:  # Poisson sampling drew no document
                noise_only_step(optimizer)
            else:
                logits = model(*inputs)
                loss = criterion(logits, labels)
                loss.backward()  # DP: the per-document norms, then the clipped gradients
                optimizer.step()
                recorder.record()  # the norms this step clipped with (logging only)
                losses.append(loss.item())
            if after_step is not None:
                after_step()
            step += 1
            postfix = {"loss": f"{sum(losses[-10:]) / max(1, len(losses[-10:])):.3f}"}
            if engine is not None:
                postfix["eps"] = f"{engine.get_epsilon(args.delta):.2f}"
            bar.set_postfix(postfix)
            bar.update()
            if step >= n_steps:
                break
    bar.close()
    return {"steps": step, "losses": losses, **recorder.summary()}


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> float:
    """Test accuracy: forward passes only, no gradient and no privacy cost (test data)."""
    model.eval()
    correct = total = 0
    for *inputs, labels in loader:
        logits = model(*inputs)
        correct += (logits.argmax(-1) == labels).sum().item()
        total += labels.numel()
    model.train()
    return correct / total


def peak_memory_gib() -> float:
    """Peak resident memory of this process (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_ablation(
    args: argparse.Namespace,
    classifier: DocumentClassifier,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    noise_seed: int,
    block_shapes: list[torch.Size],
) -> dict[str, Any]:
    """Train and evaluate the head alone (:class:`PooledHead`) on the pooled features of the
    frozen pretrained top, under the same privacy settings as the main run.

    The Poisson batches are the main run's (:func:`batch_generator`). ``make_private_with_epsilon``
    is called with the same target epsilon, delta, epochs, sampling rate, clip bound and
    clipping method, so the noise multiplier is the same. The DP noise is drawn from torch's
    global generator seeded with ``noise_seed``; after each step the noise the main run draws
    for the decoder block (Opacus draws one ``torch.normal`` per parameter, the head's first)
    is drawn and discarded, so that at the main run's seed the head receives the main run's
    noise, value for value: the run is then the main run with the block frozen, and the
    difference between the two is what training the block did. Other seeds give the spread
    that the noise alone causes.

    Args:
        args: The job's options.
        classifier: The main run's (unwrapped) classifier, for its centre.
        inputs: ``(train pooled, train labels, test pooled, test labels)``.
        noise_seed: Seed of torch's global generator (the DP noise).
        block_shapes: Shapes of the main run's decoder-block parameters, in its optimizer's
            order (after the head's).

    Returns:
        Test accuracy, epsilon, noise multiplier, losses, clipped fractions and times.
    """
    start = time.perf_counter()
    train_pooled, train_labels, test_pooled, test_labels = inputs
    torch.manual_seed(noise_seed)  # the DP noise
    head = PooledHead(classifier.center, num_labels=2).train()
    loader = DataLoader(
        TensorDataset(train_pooled, train_labels),
        batch_size=args.batch_size,
        shuffle=True,
        generator=batch_generator(args),  # the main run's Poisson batches
    )
    optimizer = torch.optim.SGD(head.parameters(), lr=args.lr)
    engine, head, optimizer, criterion, loader = make_private(args, head, optimizer, loader)

    def skip_block_noise() -> None:  # the main run's draws for the block, discarded
        if engine is not None and optimizer.noise_multiplier > 0:
            for shape in block_shapes:
                torch.normal(0.0, 1.0, size=shape)

    quiet = argparse.Namespace(**{**vars(args), "no_progress": True})
    history = train(
        quiet,
        engine,
        head,
        optimizer,
        criterion,
        loader,
        desc="ablation",
        after_step=skip_block_noise,
    )
    test_loader = DataLoader(TensorDataset(test_pooled, test_labels), batch_size=64)
    losses = history["losses"]
    return {
        "test_accuracy": evaluate(head, test_loader),
        "epsilon": engine.get_epsilon(args.delta) if engine is not None else None,
        "noise_multiplier": optimizer.noise_multiplier if engine is not None else 0.0,
        "steps": history["steps"],
        "trainable_params": sum(p.numel() for p in head.parameters() if p.requires_grad),
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "clipped_fraction": history["clipped_fraction"],
        "norms_per_step": history["norms_per_step"],
        "time_s": time.perf_counter() - start,
    }


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    load_at_start = os.getloadavg()[0]
    torch.manual_seed(args.seed)  # DP noise (Poisson batches: batch_generator)

    # 1. Data: the first --max-length tokens of every document, right-padded if shorter.
    tokenizer = rc_models.load_smollm2_tokenizer()
    train_texts, train_labels, test_texts, test_labels = load_texts(args)
    train_set = rc_data.TokenizedDataset(
        train_texts, train_labels, tokenizer, max_length=args.max_length
    )
    test_set = rc_data.TokenizedDataset(
        test_texts, test_labels, tokenizer, max_length=args.max_length
    )

    # 2. Model: pretrained SmolLM2-135M. The frozen blocks run once per document (exact, see
    # frozen_features); only the top is trained, on features centred on public text.
    body = load_body(args)
    t_features = time.perf_counter()
    quiet = args.no_progress
    reference = public_reference(tokenizer, args)
    with frozen_bottom(body, args.num_layers - args.trainable_layers) as bottom:
        train_features = frozen_features(
            bottom, train_set, desc="frozen blocks, train", disable=quiet
        )
        test_features = frozen_features(bottom, test_set, desc="frozen blocks, test", disable=quiet)
        public = (
            frozen_features(bottom, reference, desc="", disable=True),
            reference.attention_mask,
        )
    model, counts = build_classifier(body, args, public)
    # The ablation's input: the pretrained top's pooled output of every document, computed
    # before anything is trained (the head alone is then a linear probe of the frozen model).
    ablation_inputs = None
    if args.ablation_seeds > 0:
        ablation_inputs = (
            pooled_features(model, train_features, train_set.attention_mask),
            train_set.labels,
            pooled_features(model, test_features, test_set.attention_mask),
            test_set.labels,
        )
    features_time = time.perf_counter() - t_features
    train_loader = DataLoader(
        TensorDataset(train_features, train_set.attention_mask, train_set.labels),
        batch_size=args.batch_size,
        shuffle=True,
        generator=batch_generator(args),
    )
    test_loader = DataLoader(
        TensorDataset(test_features, test_set.attention_mask, test_set.labels), batch_size=4
    )
    # The head learns fast; the pretrained block gets a small step so that DP noise cannot
    # wash out what it knows: each step adds noise of std sigma * C / B to each of its 3.5 M
    # weights (see the comment at LOGIT_SCALE for the values). It is still trained under
    # DP-SGD-RC: its sequence-level nn.Linear norms are sketched and clipped at every step.
    top_params = [p for p in model.top.parameters() if p.requires_grad]
    block_start = {
        n: p.detach().clone() for n, p in model.top.named_parameters() if p.requires_grad
    }
    plain = model
    optimizer = torch.optim.SGD(
        [
            {"params": list(model.head.parameters()), "lr": args.lr},
            {"params": top_params, "lr": args.body_lr},
        ]
    )

    # 3. Privacy: noise multiplier for (epsilon, delta) after --epochs, Poisson sampling.
    engine, model, optimizer, criterion, train_loader = make_private(
        args, model, optimizer, train_loader
    )
    sigma = optimizer.noise_multiplier if engine is not None else 0.0
    print(
        f"{len(train_set)} training / {len(test_set)} test documents of {args.max_length} tokens; "
        f"{counts['trainable']:,} of {counts['total']:,} parameters trainable; "
        f"clipping={args.clipping}, noise multiplier {sigma:.4f}",
        flush=True,
    )

    # 4. Train, then evaluate on the held-out documents.
    t_train = time.perf_counter()
    history = train(args, engine, model, optimizer, criterion, train_loader)
    t_eval = time.perf_counter()
    accuracy = evaluate(model, test_loader)
    t_ablation = time.perf_counter()
    # How far the decoder block moved, against what the DP noise alone moves it: each step adds
    # N(0, (sigma C / B)^2) to every coordinate's gradient (B the expected batch), so after n
    # steps at learning rate body_lr the noise displacement has norm body_lr sigma C / B
    # sqrt(n P) for P block parameters (in expectation, up to O(1/sqrt(nP))).
    n_block = sum(p.numel() for p in block_start.values())
    block = {
        "relative_change": weight_change(block_start, plain.top) if block_start else 0.0,
        "noise_relative_change": (
            args.body_lr
            * sigma
            * args.max_grad_norm
            / args.batch_size
            * math.sqrt(history["steps"] * n_block)
            / math.sqrt(sum(float((p**2).sum()) for p in block_start.values()))
            if block_start
            else 0.0
        ),
        "params": n_block,
    }
    del block_start

    # 5. Ablation, as the job runs: the head alone on the frozen pretrained model (its pooled
    # features computed above), with the same epsilon, sampling rate, steps, clip bound, head
    # learning rate and data order. What training the decoder block adds is the difference.
    ablation = None
    if ablation_inputs is not None:
        seeds = [args.seed + j for j in range(args.ablation_seeds)]
        shapes = [p.shape for p in top_params]  # the optimizer's order, after the head
        runs = [
            run_ablation(args, plain, ablation_inputs, noise_seed=s, block_shapes=shapes)
            for s in seeds
        ]
        accuracies = [run["test_accuracy"] for run in runs]
        ablation = {
            **runs[0],  # the main run's noise seed: the main run with the block frozen
            "noise_seeds": seeds,
            "test_accuracy_over_seeds": {
                "values": accuracies,
                "mean": sum(accuracies) / len(accuracies),
                "min": min(accuracies),
                "max": max(accuracies),
            },
            "time_s": sum(run["time_s"] for run in runs),
        }
    del ablation_inputs
    end = time.perf_counter()

    losses = history["losses"]
    results = {
        "dataset": args.dataset,
        "clipping": args.clipping,
        "sketch": args.sketch if args.clipping == "randomized" else None,
        "sketch_dim": args.sketch_dim if args.clipping == "randomized" else None,
        "test_accuracy": accuracy,
        "majority_baseline": max(test_labels.count(0), test_labels.count(1)) / len(test_labels),
        "epsilon": engine.get_epsilon(args.delta) if engine is not None else None,
        "target_epsilon": args.epsilon if engine is not None else None,
        "delta": args.delta if engine is not None else None,
        "noise_multiplier": sigma,
        "steps": history["steps"],
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "body_lr": args.body_lr,
        "max_length": args.max_length,
        "num_layers": args.num_layers,
        "trainable_layers": args.trainable_layers,
        "trainable_params": counts["trainable"],
        "train_docs": len(train_set),
        "test_docs": len(test_set),
        "max_grad_norm": args.max_grad_norm,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "sketched_share": history["sketched_share"],
        "clipped_fraction": history["clipped_fraction"],
        "block_weight_change": block,
        "ablation_head_only": ablation,
        "features_time_s": features_time,
        "train_time_s": t_eval - t_train,
        "eval_time_s": t_ablation - t_eval,
        "ablation_time_s": end - t_ablation,
        "wall_time_s": end - start,
        "cpu_time_s": time.process_time(),  # all threads of this process
        "peak_memory_gib": peak_memory_gib(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": [load_at_start, os.getloadavg()[0]],  # at start and end
        "seed": args.seed,
        "smoke": args.smoke,
        # Per step: the (non-privatized) norm estimates each document was clipped with and,
        # under randomized clipping, each document's sketched share of its squared norm.
        "norms_per_step": history["norms_per_step"],
        "sketched_share_per_step": history.get("sketched_share_per_step"),
    }
    print_table(results)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(results, indent=2) + "\n")
    return results


def share_row(share: dict[str, float] | None, clipping: str) -> str:
    """The table's sketched-share row (mean and range over every document of every step)."""
    if share is None:
        return "n/a (exact norms)" if clipping != "randomized" else "n/a (no step)"
    return (
        f"{share['mean']:.3f} mean, {share['min']:.3f}-{share['max']:.3f} over documents "
        f"({share['sketched_parameters']} sketched weight matrices; the rest exact)"
    )


def clipped_row(clipped: dict[str, float] | None, c: float) -> str:
    """The table's clipped-fraction row (mean and range over steps)."""
    if clipped is None:
        return "n/a (non-private)"
    return (
        f"{clipped['mean']:.3f} mean, {clipped['min']:.2f}-{clipped['max']:.2f} over steps "
        f"(n_hat_i > C = {c:g})"
    )


def block_row(block: dict[str, float]) -> str:
    """The table's row on how far the trained decoder block moved."""
    if not block["params"]:
        return "n/a (no block trained)"
    return (
        f"{block['relative_change']:.2e} of its weights' norm, ||theta - theta_0|| / ||theta_0|| "
        f"(DP noise alone: {block['noise_relative_change']:.2e})"
    )


def ablation_row(a: dict[str, Any] | None) -> str:
    """The table's ablation row: the head alone on the frozen pretrained model."""
    if a is None:
        return "not run (--ablation-seeds 0)"
    eps = "non-private" if a["epsilon"] is None else f"epsilon {a['epsilon']:.3f}"
    clipped = a["clipped_fraction"]
    tail = "" if clipped is None else f", {clipped['mean']:.3f} clipped / step"
    over = a["test_accuracy_over_seeds"]
    return (
        f"test accuracy {a['test_accuracy']:.3f}, {over['mean']:.3f} mean and "
        f"{over['min']:.3f}-{over['max']:.3f} over {len(over['values'])} noise seeds; "
        f"final loss {a['final_loss']:.4f} (block frozen; {eps}, noise "
        f"{a['noise_multiplier']:.4f}{tail}; {a['time_s']:.0f} s in all)"
    )


def print_table(r: dict[str, Any]) -> None:
    def fmt(x: Any, spec: str = "") -> str:
        return "n/a (non-private)" if x is None else format(x, spec)

    method = {
        "randomized": f"randomized clipping ({r['sketch']}, k={r['sketch_dim']})",
        "ghost": "ghost clipping (exact norms)",
        "none": "non-private",
    }[r["clipping"]]
    rows = [
        ("method", method),
        ("test accuracy", f"{r['test_accuracy']:.3f}  ({r['test_docs']} documents)"),
        ("majority-class baseline", f"{r['majority_baseline']:.3f}"),
        ("epsilon (RC accountant)", fmt(r["epsilon"], ".3f")),
        ("delta", fmt(r["delta"], "g")),
        ("noise multiplier", f"{r['noise_multiplier']:.4f}"),
        ("steps", f"{r['steps']}  (expected batch {r['batch_size']}, {r['epochs']:g} epochs)"),
        ("final training loss", fmt(r["final_loss"], ".4f")),
        ("sketched share of norm^2", share_row(r["sketched_share"], r["clipping"])),
        ("documents clipped / step", clipped_row(r["clipped_fraction"], r["max_grad_norm"])),
        ("decoder block moved", block_row(r["block_weight_change"])),
        ("ablation: head only", ablation_row(r["ablation_head_only"])),
        (
            "wall time",
            f"{r['wall_time_s']:.0f} s  (frozen blocks {r['features_time_s']:.0f} s, "
            f"training {r['train_time_s']:.0f} s; "
            f"CPU time {r['cpu_time_s']:.0f} s on {r['torch_threads']} threads)",
        ),
        ("peak memory (RSS)", f"{r['peak_memory_gib']:.2f} GiB"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    print(f"| {'':<{width}} | result |")
    print(f"|{'-' * (width + 2)}|--------|")
    for key, value in rows:
        print(f"| {key:<{width}} | {value} |")


if __name__ == "__main__":
    main()
