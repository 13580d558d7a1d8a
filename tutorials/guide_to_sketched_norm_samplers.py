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
# # Guide to sketched norm samplers
#
# Opacus clips every sample's gradient to norm `C`, so it needs the per-sample gradient norm of
# every trainable layer. Its *grad samplers* compute per-sample gradients; its ghost-clipping
# *norm samplers* compute the norms directly, for an `nn.Linear` over a sequence of length `T`
# through two `T x T` Gram matrices per sample. `opacus_rc`'s **sketched norm samplers**
# estimate the same norm with a Gaussian sketch of `k` columns, at `O(B T k)` memory instead of
# `O(B T^2)`; the RC accountant pays for the estimate's randomness in epsilon.
#
# This guide, in the spirit of Opacus' `guide_to_grad_sampler`, shows
#
# 1. what a sketched norm sampler computes;
# 2. how the estimate behaves on real gradients (SmolLM2-135M on Brown-corpus documents):
#    its error against `k`, for Hutchinson and Hutch++;
# 3. how to write and register a sketched norm sampler for a layer type `opacus_rc` does not
#    know, here Hugging Face's `Conv1D` (the linear layer of GPT-2), and how to check it.
#
# Set `OPACUS_RC_SMOKE=1` to run it in a few seconds (short sequences, few repetitions).

# %%
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # a script writes the file only; a notebook shows the figure
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

HERE = Path.cwd() if "__file__" not in globals() else Path(__file__).resolve().parent
if not (HERE / "rc_data.py").exists():
    HERE = HERE / "tutorials"
sys.path.insert(0, str(HERE))
import rc_data  # noqa: E402
import rc_models  # noqa: E402

import opacus_rc  # noqa: E402
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping, register_sketched_norm_sampler  # noqa: E402
from opacus_rc.sketching import hutchinson_sqnorm, hutchpp_sqnorm  # noqa: E402

warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="Secure RNG turned off")
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm in a notebook
SMOKE = os.environ.get("OPACUS_RC_SMOKE") == "1"
# Figures go to tutorials/outputs/ (committed); smoke runs write to a temporary folder instead.
OUTPUTS = Path(
    os.environ.get("OPACUS_RC_OUTPUTS") or (tempfile.mkdtemp() if SMOKE else HERE / "outputs")
)
OUTPUTS.mkdir(exist_ok=True)
T = 32 if SMOKE else 512  # tokens per document
REPEATS = 4 if SMOKE else 100  # independent sketches per value of k
KS = [1, 4, 16, 32] if SMOKE else [1, 2, 4, 8, 16, 32, 64, 128]  # sketch columns
torch.manual_seed(0)
print(f"opacus_rc {opacus_rc.__version__}, torch {torch.__version__}, T = {T}")

# %% [markdown]
# ## 1. What a sketched norm sampler computes
#
# For sample `i`, an `nn.Linear` with weight `W` (`p x d`) sees activations `A_i` (`T x d`) and
# receives output gradients `G_i` (`T x p`); the weight's per-sample gradient is
# `M_i = G_i^T A_i` (`p x d`). Its squared norm is a trace, `||M_i||_F^2 = tr(M_i M_i^T)`, and
# Hutchinson's estimator replaces the trace by a Gaussian sketch `Omega_i` (`p x k`, entries
# `N(0, 1/k)`, fresh for every sample, layer and step):
#
# $$\hat n_i = \|A_i^\top (G_i \Omega_i)\|_F^2, \qquad \mathbb E[\hat n_i] = \|M_i\|_F^2 .$$
#
# Two batched matrix products, `2 B T k (p + d)` FLOPs, and no `T x T` or `p x d` matrix. The
# ratio `W = n_hat / n` is a weighted sum of `chi2_k / k` variables, with weights the
# normalised squared singular values `w_j` of `M_i`; its variance is `(2/k) sum_j w_j^2`,
# between `2/(k rank M_i)` and `2/k`. A **rank-one** gradient is the worst case.
#
# **Hutch++** spends `s` extra columns on an exact "head" (the top singular directions of
# `M_i`) and sketches only the rest: it is exact when `rank M_i <= s`.
#
# The estimator functions work on any `(A, G)` factors:

# %%
B, d, p = 3, 20, 10
A = torch.randn(B, T, d)
G = torch.randn(B, T, p)
exact = torch.linalg.matrix_norm(G.transpose(1, 2) @ A) ** 2  # ||G_i^T A_i||_F^2, (B,)
gen = torch.Generator().manual_seed(0)
print("exact       ", exact)
print("Hutchinson  ", hutchinson_sqnorm(A, G, sketch_dim=32, generator=gen))
print("Hutch++ s=k ", hutchpp_sqnorm(A, G, sketch_dim=32, generator=gen))
many = torch.stack([hutchinson_sqnorm(A, G, sketch_dim=32, generator=gen) for _ in range(2000)])
print("mean of 2000", many.mean(0), "(unbiased)")

# %% [markdown]
# ## 2. The estimate on real gradients
#
# We take SmolLM2-135M as a sequence classifier (the model of the main job), feed it four Brown
# documents, and record the activations and output gradients of two `nn.Linear` layers with
# forward and backward hooks:
#
# * `layers.29.mlp.down_proj`, in the last block. The classifier reads only the last token, so
#   the gradient reaching the last block's MLP is nonzero at one position: `M_i` has **rank
#   one**, the estimator's worst case;
# * `layers.20.mlp.down_proj`, nine blocks lower: attention has spread the gradient over all `T`
#   positions, so `M_i` has several significant singular values (its effective rank
#   `1 / sum_j w_j^2` is printed below).

# %%
tokenizer = rc_models.load_smollm2_tokenizer()
model = rc_models.load_smollm2(task="classification", num_labels=2)
rc_models.freeze_all_but(model, trainable_layers=10)  # backward through blocks 20-29 only
docs = rc_data.load_brown(split="train")[::100][:4]
batch = tokenizer([r["text"] for r in docs], max_length=T, truncation=True, return_tensors="pt")
labels = torch.tensor([r["label"] for r in docs])

captured = {}


def capture(name):
    def forward_hook(module, inputs, output):
        captured[name + ".A"] = inputs[0].detach()

    def backward_hook(module, grad_input, grad_output):
        # The batch loss is a mean: scale by B to get the gradient of each sample's own loss.
        captured[name + ".G"] = grad_output[0].detach() * len(docs)

    return forward_hook, backward_hook


layers = {"last block (rank one)": 29, "block 20 (spread over T)": 20}
handles = []
for name, index in layers.items():
    fwd, bwd = capture(name)
    down = model.model.layers[index].mlp.down_proj
    handles += [down.register_forward_hook(fwd), down.register_full_backward_hook(bwd)]
t0 = time.perf_counter()
loss = F.cross_entropy(model(**batch).logits, labels)
loss.backward()
for h in handles:
    h.remove()
print(f"forward + backward of {len(docs)} x {T} tokens: {time.perf_counter() - t0:.1f} s")

factors = {}
for name in layers:
    A, G = captured[name + ".A"], captured[name + ".G"]
    M = G.transpose(1, 2) @ A  # (B, p, d): fine for one layer here, never done in training
    sv2 = torch.linalg.svdvals(M) ** 2
    w = sv2 / sv2.sum(dim=1, keepdim=True)
    factors[name] = (A, G, (sv2.sum(dim=1)), (w**2).sum(dim=1))
    print(
        f"{name:26s} A {tuple(A.shape)}, G {tuple(G.shape)}; "
        "effective rank 1/sum(w^2) per sample: "
        f"{[round(x, 1) for x in (1 / (w**2).sum(1)).tolist()]}"
    )

# %% [markdown]
# Now draw `REPEATS` independent sketches for each `k` and measure the relative error of the
# **norm** estimate, `sqrt(n_hat / n) - 1` (the norm is what clipping divides by). To first
# order its standard deviation is half that of `W`, `sqrt(sum_j w_j^2 / (2k))`: the dashed
# lines.

# %%
ks = KS
estimators = {
    "Hutchinson": lambda A, G, k, g: hutchinson_sqnorm(A, G, sketch_dim=k, generator=g),
    "Hutch++ (s = k)": lambda A, G, k, g: hutchpp_sqnorm(A, G, sketch_dim=k, generator=g),
}
gen = torch.Generator().manual_seed(1)
errors, ratios_k32 = {}, {}
t0 = time.perf_counter()
for layer, (A, G, n, _) in factors.items():
    for est_name, est in estimators.items():
        rms = []
        for k in ks:
            ratio = torch.stack([est(A, G, k, gen) / n for _ in range(REPEATS)])  # (R, B)
            rms.append(((ratio.clamp(min=0).sqrt() - 1) ** 2).mean().sqrt().item())
            if k == 32:
                ratios_k32[(layer, est_name)] = ratio.flatten()
        errors[(layer, est_name)] = rms
print(f"{len(ks) * REPEATS * 4} sketches in {time.perf_counter() - t0:.1f} s")
print(f"{'k':>5s} " + " ".join(f"{f'{ln[:10]}/{en[:9]}':>22s}" for ln, en in errors))
for i, k in enumerate(ks):
    print(f"{k:5d} " + " ".join(f"{v[i]:22.4f}" for v in errors.values()))

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
colors = {"last block (rank one)": "tab:red", "block 20 (spread over T)": "tab:blue"}
for (layer, est_name), rms in errors.items():
    style = "-o" if est_name == "Hutchinson" else ":s"
    ax1.plot(
        ks, [max(r, 1e-7) for r in rms], style, color=colors[layer], label=f"{layer}, {est_name}"
    )
for layer, (_, _, _, sum_w2) in factors.items():
    theory = [(sum_w2.mean().item() / (2 * k)) ** 0.5 for k in ks]
    ax1.plot(ks, theory, "--", color=colors[layer], alpha=0.5)
ax1.set(
    xscale="log", yscale="log", xlabel="sketch columns k", ylabel="RMS relative error of the norm"
)
ax1.set_title("Error of the norm estimate vs k (dashed: theory)")
ax1.legend(fontsize=7)
ratio = ratios_k32[("last block (rank one)", "Hutchinson")].numpy()
ax2.hist(ratio, bins=40, density=True, alpha=0.6, color="tab:red", label="rank one, k = 32")
grid = torch.linspace(0.2, 2.2, 200).numpy()
ax2.plot(grid, 32 * stats.chi2.pdf(32 * grid, df=32), "k-", label=r"$\chi^2_{32}/32$ (theory)")
ax2.axvline(1.0, color="gray", lw=0.8)
ax2.set(xlabel=r"$\hat n / n$", ylabel="density", title="Law of the estimate, rank-one gradient")
ax2.legend(fontsize=8)
fig.tight_layout()
fig.savefig(OUTPUTS / "sketch_error_vs_k.png", dpi=110)
plt.show()

# %% [markdown]
# What the plot says:
#
# * The error falls like `1/sqrt(k)`, on the theory line. At `k = 32` (the default) a norm is off
#   by about 12 % RMS in the rank-one worst case and by much less when the gradient is spread
#   over the sequence.
# * The law of `n_hat / n` for a rank-one gradient is exactly `chi2_k / k`. That worst case is
#   what the RC accountant assumes for every sample (its *envelope*), so the privacy guarantee
#   holds whatever the true spectrum is.
# * Hutch++ is exact on rank-one gradients (its curve is float32 round-off) and much better
#   whenever a few directions dominate, at about three times the cost of the same `k`; its
#   privacy is certified with `k` = its tail columns.

# %% [markdown]
# ## 3. Registering a sketched norm sampler for a custom layer
#
# `GradSampleModuleRandomizedClipping` looks a trainable module's type up in
# `opacus_rc.grad_sample.SKETCHED_NORM_SAMPLERS`; a type that is not there falls back to
# Opacus' exact path (its norm samplers, its grad samplers, or functorch for unknown types).
# Exact is always correct, but for a large linear layer over long sequences it is the
# expensive path that randomized clipping exists to avoid.
#
# Hugging Face's `Conv1D` (GPT-2's attention and MLP projections) is such a type: a linear
# layer whose weight is stored transposed, `y = x W + b` with `W` of shape `d x p`. With
# logging at INFO the module tells us which path every trainable layer takes:

# %%
from transformers import GPT2Config, GPT2ForSequenceClassification  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

config = GPT2Config(
    vocab_size=1000, n_positions=256, n_embd=64, n_layer=2, n_head=4,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, num_labels=2,
    pad_token_id=0, bos_token_id=0, eos_token_id=0,
)  # fmt: skip
torch.manual_seed(0)
gpt2 = GPT2ForSequenceClassification(config).train()
for p in gpt2.transformer.wte.parameters():
    p.requires_grad_(False)  # token embeddings frozen, as in the main job
for p in gpt2.transformer.wpe.parameters():
    p.requires_grad_(False)  # position embeddings see [1, T] position_ids (Opacus issue 841)


class NormPaths(logging.Handler):
    """Collects the module's one-line-per-layer report of which norm path each layer takes."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def show_norm_paths(model):
    handler, log = NormPaths(), logging.getLogger("opacus_rc")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # only this handler prints
    GradSampleModuleRandomizedClipping(model, max_grad_norm=1.0, sketch_dim=32).cleanup()
    log.removeHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = True
    for line in handler.lines:
        if "transformer.h.0." in line or "score" in line or "ln_f" in line:
            print(line)
    print(f"... ({len(handler.lines)} trainable modules in all)")


show_norm_paths(gpt2)

# %% [markdown]
# The `Conv1D` layers take the functorch fallback. A sketched norm sampler has the signature
#
# ```python
# sampler(layer, activations, backprops, *, estimator, sketch_dim, generator)
#     -> {parameter: (B,) per-sample gradient norms}
# ```
#
# `activations` is the list of the layer's inputs and `backprops` the gradient of its output,
# both batch first and already scaled to each sample's own loss; `estimator` is the squared-norm
# estimator the user chose (`hutchinson_sqnorm` or `hutch++`) and `generator` the module's
# secret probe generator. The sampler must return a norm for **every** trainable parameter of
# the layer (the module checks), must draw its probes from `generator` only, and must call the
# estimator with fresh probes every time (the accountant assumes independent sketches per
# sample, layer and step).
#
# `Conv1D`'s per-sample weight gradient is `A_i^T G_i`, the transpose of `nn.Linear`'s
# `G_i^T A_i`, with the same Frobenius norm; the bias gradient `sum_t G_i[t]` is cheap and exact.


# %%
@register_sketched_norm_sampler(Conv1D)
def compute_conv1d_sketched_norm_sample(
    layer, activations, backprops, *, estimator, sketch_dim, generator
):
    A = activations[0]  # (B, T, d)
    G = backprops  # (B, T, p)
    B = A.shape[0]
    A = A.reshape(B, -1, A.shape[-1])
    G = G.reshape(B, -1, G.shape[-1])
    norms = {}
    if layer.weight.requires_grad:
        squared = estimator(A, G, sketch_dim=sketch_dim, generator=generator)
        norms[layer.weight] = squared.clamp(min=0).sqrt()
    if layer.bias is not None and layer.bias.requires_grad:
        norms[layer.bias] = G.sum(dim=1).norm(dim=1)
    return norms


show_norm_paths(gpt2)

# %% [markdown]
# ### Checking the sampler
#
# As with a grad sampler, compare against the truth: exact per-sample norms from a batch-size-1
# loop. A sketched sampler is random, so check two things:
#
# * **unbiasedness** -- the mean of the squared estimates over many independent steps
#   converges to the exact squared norm;
# * **the law** -- with a large `k` every single estimate is close to the exact norm.
#
# `per_sample_gradient_norms` holds the whole model's norm estimate of the last backward pass.


# %%
def exact_per_sample_norms(model, x, y):
    norms = []
    for i in range(len(x)):
        model.zero_grad()
        F.cross_entropy(model(input_ids=x[i : i + 1]).logits, y[i : i + 1]).backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        norms.append(torch.sqrt(sum((g**2).sum() for g in grads)))
    model.zero_grad()
    return torch.stack(norms)


def estimated_norms(model, x, y, *, sketch_dim, seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a seeded generator is for experiments only
        gsm = GradSampleModuleRandomizedClipping(
            model, max_grad_norm=1.0, sketch_dim=sketch_dim,
            sketch_generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
    F.cross_entropy(gsm(input_ids=x).logits, y).backward()
    norms = gsm.get_norm_sample().float()
    gsm.cleanup()
    model.zero_grad()
    return norms


x = torch.randint(1, 1000, (4, 128 if not SMOKE else 32))
y = torch.tensor([0, 1, 1, 0])
truth = exact_per_sample_norms(gpt2, x, y)
draws = torch.stack(
    [estimated_norms(gpt2, x, y, sketch_dim=8, seed=s) for s in range(50 if not SMOKE else 10)]
)
print("exact norms                    ", truth.detach())
print("mean of squared estimates, k=8 ", (draws**2).mean(0).sqrt())
print("one estimate, k = 1024         ", estimated_norms(gpt2, x, y, sketch_dim=1024, seed=0))

# %% [markdown]
# ### Using it
#
# Registration is global to the process and by exact type (subclasses are not matched, as in
# Opacus). From now on `make_private(clipping="randomized")` sketches every `Conv1D`:

# %%
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

engine = opacus_rc.PrivacyEngine()
optimizer = torch.optim.AdamW([p for p in gpt2.parameters() if p.requires_grad], lr=1e-3)
loader = DataLoader(TensorDataset(x, y), batch_size=2)
private_model, optimizer, criterion, loader = engine.make_private(
    module=gpt2, optimizer=optimizer, data_loader=loader, criterion=nn.CrossEntropyLoss(),
    noise_multiplier=1.0, max_grad_norm=1.0, clipping="randomized", sketch_dim=32,
)  # fmt: skip
for xb, yb in loader:
    if len(xb) == 0:
        continue  # an empty Poisson batch (see the main job for the noise-only step)
    loss = criterion(private_model(input_ids=xb).logits, yb)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"loss {loss.item():.4f}, norms {private_model.per_sample_gradient_norms.tolist()}")
print(f"epsilon after {len(engine.accountant)} step(s): {engine.get_epsilon(1e-5):.2f}")

# %% [markdown]
# ## Summary
#
# * A sketched norm sampler returns per-sample gradient **norms** for every trainable parameter
#   of its layer, drawing its probes only from the generator it is given.
# * The estimate is unbiased in the squared norm; its relative error falls like `1/sqrt(k)` and
#   is worst (`chi2_k / k`) for rank-one gradients, which the RC accountant always assumes.
# * Register one with `@opacus_rc.register_sketched_norm_sampler(MyLayer)`, check it against a
#   batch-size-1 loop, and `make_private(clipping="randomized")` uses it. Layers without one keep
#   Opacus' exact norms.
