"""Two-process randomized clipping of a tiny FSDP2 Llama (gloo, CPU), run by test_fsdp_llama.py.

``python fsdp_llama_worker.py OUT.json`` spawns 2 processes; each runs every scenario and
asserts; rank 0 writes a JSON summary. A script, not a pytest module (spawned children import
it as ``__mp_main__``).

The model: a 2-layer ``LlamaForCausalLM`` with the input embedding tied to the LM head
(``tie_word_embeddings=True``), every weight trainable, the RMSNorm weights included; each
decoder layer ``fully_shard``-ed, then the root (which then owns the tied weight and the final
norm). Every sample's clipped gradient is compared with a float64 oracle that computes each
sample's gradient alone (``per_sample_grads``):

* the norms: each rank's per-sample norms equal a single process's on the rank's own samples
  drawn with the same sketch generator (the same probes, so any communication or sharding
  error in a norm shows; relative 1e-5), and the norms of the exact layers (RMSNorm weights,
  LayerNorm weight and bias) equal the oracle's (relative 1e-5);
* the clip factors ``c_i = min(1, C / (n_i + 1e-6))`` of both ranks, gathered, and the update:
  ``theta_0 - lr sum_i c_i g_i / B`` over the global batch with the oracle's ``g_i`` (absolute
  2e-6; the update itself is ~1e-2), clipping active (at least 4 of 8 samples clipped).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint
from worker_common import WORLD, B, free_port, gather  # noqa: E402  (the script's folder)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tiny_hf_models as hf  # noqa: E402

import opacus_rc  # noqa: E402,F401  (registers the "rc" accountant)
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping  # noqa: E402
from opacus_rc.grad_sample.fsdp import GradSampleModuleRandomizedClippingFSDP  # noqa: E402
from opacus_rc.optimizers import (  # noqa: E402
    DPLossRandomizedClipping,
    FSDPRandomizedClipOptimizer,
    RandomizedClipOptimizer,
)

V, T = 29, 7
LR = 0.5
ORDER = torch.cat([torch.arange(r, B, WORLD) for r in range(WORLD)])


class SeqCE(nn.Module):
    """Each sample's mean next-token cross-entropy (``reduction="none"``: ``(B,)``)."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        per = nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
        ).mean(1)
        if self.reduction == "none":
            return per
        return per.mean() if self.reduction == "mean" else per.sum()


class Checkpointed(nn.Module):
    """A decoder layer under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)


def tied_llama(seed: int = 0) -> nn.Module:
    """Two decoder layers, the embedding tied to the head, biases on every Linear but the head."""
    model = hf.llama(
        vocab=V,
        tie=True,
        layers=2,
        intermediate_size=24,
        seed=seed,
        attention_bias=True,
        mlp_bias=True,
    ).train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.requires_grad for p in model.parameters())
    return model


def checkpointed(model: nn.Module, checkpointing: str | None) -> nn.Module:
    """``model`` with activation checkpointing: ``"torch"`` (each decoder layer wrapped in
    :class:`Checkpointed`), ``"hf"`` (``gradient_checkpointing_enable``, non-reentrant) or
    ``"hf_reentrant"`` (``use_reentrant=True``)."""
    layers = model.model.layers
    if checkpointing == "torch":
        for i in range(len(layers)):
            layers[i] = Checkpointed(layers[i])
    elif checkpointing in ("hf", "hf_reentrant"):
        reentrant = checkpointing == "hf_reentrant"
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    return model


def shard(model: nn.Module, *, own: bool = False) -> nn.Module:
    """Each decoder layer ``fully_shard``-ed, then the root (which owns the tied weight and the
    final norm). ``own``: first every module with parameters of its own in a group of its own,
    the embedding and the LM head in one (``fully_shard([embed, head])``, the one grouping
    FSDP2 accepts for a tied weight)."""
    if own:
        for layer in model.model.layers:
            for sub in list(layer.modules())[1:]:
                if any(True for _ in sub.parameters(recurse=False)):
                    fully_shard(sub)
        fully_shard(model.model.norm)
        fully_shard([model.model.embed_tokens, model.lm_head])
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded (a collective for sharded ones), by its plain name."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[plain(name)] = t.detach().double().clone()
    return out


def plain(name: str) -> str:
    for junk in ("_module.", "layer.", "base_model.model."):
        name = name.replace(junk, "")
    return name


def batch(seed: int) -> torch.Tensor:
    """The global batch of ids ``(B, T)``; sample 2 repeats its tokens (a large cross term)."""
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    x[2] = torch.tensor([5, 9, 5, 9, 5, 9, 5])
    return x


def per_sample_grads(base: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: (B, *shape)}``: each sample's float64 gradient of its own loss, computed alone
    (autograd sums the tied weight's two uses)."""
    ref = copy.deepcopy(base).double()
    named = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    rows: dict[str, list[torch.Tensor]] = {n: [] for n in named}
    for i in range(len(x)):
        ref.zero_grad()
        SeqCE()(ref(input_ids=x[i : i + 1]).logits, x[i : i + 1]).backward()
        for n, p in named.items():
            rows[n].append(p.grad.clone())
    return {plain(n): torch.stack(r) for n, r in rows.items()}


def step_pieces(gsm: nn.Module, C: float, *, per_rank: int) -> tuple[Any, Any]:
    opt = FSDPRandomizedClipOptimizer(
        torch.optim.SGD(gsm.parameters(), lr=LR),
        grad_sample_module=gsm,
        noise_multiplier=0.0,
        max_grad_norm=C,
        expected_batch_size=per_rank,
        loss_reduction="mean",
    )
    return opt, DPLossRandomizedClipping(gsm, opt, SeqCE(), "mean")


def check_update(
    theta0: dict[str, torch.Tensor],
    theta: dict[str, torch.Tensor],
    g: dict[str, torch.Tensor],
    c: torch.Tensor,
) -> float:
    """max |theta - (theta_0 - lr sum_i c_i g_i / B)| over the trainable parameters."""
    worst = 0.0
    for name, gi in g.items():
        want = theta0[name] - LR * torch.einsum("b,b...->...", c, gi) / B
        worst = max(worst, (theta[name] - want).abs().max().item())
    return worst


def lora_llama() -> nn.Module:
    """peft LoRA (r = 2, both factors random) on the q, v and down projections of the tied
    Llama; the base, the tied weight and the norms frozen."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=2,
        lora_alpha=4,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
    )
    torch.manual_seed(1)
    model = get_peft_model(tied_llama(), cfg).train()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable
    return model


def shard_lora(model: nn.Module) -> nn.Module:
    """Each decoder layer of the peft model ``fully_shard``-ed (frozen base weights and
    trainable adapters in one group), then the root."""
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


class NormNet(nn.Module):
    """An untied embedding, an ``nn.LayerNorm`` (weight and bias) and two ``nn.Linear`` with
    biases, every weight trainable; an HF-style output (``.logits``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(V, 8)
        self.norm = nn.LayerNorm(8)
        self.hidden, self.head = nn.Linear(8, 12), nn.Linear(12, V)
        with torch.no_grad():  # not the identity affine map
            self.norm.weight.normal_(1.0, 0.3)
            self.norm.bias.normal_(0.0, 0.3)

    def forward(self, input_ids: torch.Tensor) -> Any:
        from transformers.modeling_outputs import CausalLMOutput

        h = torch.tanh(self.hidden(self.norm(self.embed(input_ids))))
        return CausalLMOutput(logits=self.head(h))


def shard_norm_net(model: nn.Module, *, wrapper: bool) -> nn.Module:
    """``wrapper``: Opacus' ``FSDP2Wrapper`` (every layer in a group of its own); else only
    the root (one group owning every parameter)."""
    if wrapper:
        from opacus.utils.fsdp_utils import FSDP2Wrapper

        return FSDP2Wrapper(model)
    fully_shard(model)
    return model


def scenario_tied(
    rank: int,
    *,
    checkpointing: str | None = None,
    bookkeeping: bool = True,
    own: bool = False,
    lora: bool = False,
    norm_net: str | None = None,
) -> dict[str, Any]:
    """The tied Llama, every weight trainable (``lora``: LoRA adapters only; ``norm_net``:
    :class:`NormNet` sharded by ``"wrapper"`` or at the ``"root"`` only), at sigma = 0 (see the
    module docstring)."""
    base = lora_llama() if lora else NormNet() if norm_net else tied_llama()
    x = batch(5)
    mine = x[rank::WORLD]
    g = per_sample_grads(base, x[ORDER])
    exact_norm = torch.cat([v.flatten(1) for v in g.values()], 1).norm(dim=1)
    C = 0.6 * float(exact_norm.median())
    theta0 = full(base)
    if lora:
        model = shard_lora(copy.deepcopy(base))
    elif norm_net:
        model = shard_norm_net(copy.deepcopy(base), wrapper=norm_net == "wrapper")
    else:
        model = shard(checkpointed(copy.deepcopy(base), checkpointing), own=own)
    gsm = GradSampleModuleRandomizedClippingFSDP(
        model,
        max_grad_norm=C,
        sketch_dim=8,
        loss_reduction="mean",
        bookkeeping=bookkeeping,
        sketch_generator=torch.Generator().manual_seed(10 + rank),
    )
    assert gsm.bookkeeping is bookkeeping
    routes = {n: r.path.value for n, r in gsm.norm_routes.items()}
    if not (lora or norm_net):
        assert routes["lm_head"] == routes["model.embed_tokens"] == "tied", routes
    opt, crit = step_pieces(gsm, C, per_rank=B // WORLD)
    crit(gsm(input_ids=mine).logits, mine).backward()
    norms = gsm.per_sample_gradient_norms.double()
    smaller_stash = gsm.step_smaller_stash
    layer_norms = {plain(n): v.double() for n, v in gsm.norm_samples.items()}
    opt.step()
    opt.zero_grad()
    theta = full(gsm)
    ranks = gather(torch.cat([v.flatten() for v in theta.values()]))
    assert torch.equal(ranks[0], ranks[1]), "ranks diverged"
    # One process on this rank's samples, same probes (and checkpointing): the same norms.
    ref = GradSampleModuleRandomizedClipping(
        copy.deepcopy(base)
        if lora or norm_net
        else checkpointed(copy.deepcopy(base), checkpointing),
        max_grad_norm=C,
        sketch_dim=8,
        loss_reduction="mean",
        sketch_generator=torch.Generator().manual_seed(10 + rank),
        bookkeeping=bookkeeping,
    )
    ref_opt = RandomizedClipOptimizer(
        torch.optim.SGD(ref.parameters(), lr=LR),
        grad_sample_module=ref,
        noise_multiplier=0.0,
        max_grad_norm=C,
        expected_batch_size=B // WORLD,
        loss_reduction="mean",
    )
    DPLossRandomizedClipping(ref, ref_opt, SeqCE(), "mean")(
        ref(input_ids=mine).logits, mine
    ).backward()
    ref_norms = ref.per_sample_gradient_norms.double()
    ref.cleanup()
    vs_single = ((norms - ref_norms).abs() / ref_norms).max().item()
    assert vs_single < 1e-5, (norms, ref_norms)
    # The exact layers (RMSNorm, LayerNorm) against the oracle, for this rank's samples.
    mine_rows = torch.arange(rank * (B // WORLD), (rank + 1) * (B // WORLD))
    exact_gap = 0.0
    for name, v in layer_norms.items():
        if "norm" in name.split(".")[-2]:
            want = g[name][mine_rows].flatten(1).norm(dim=1)
            exact_gap = max(exact_gap, ((v - want).abs() / want).max().item())
    assert 0 < exact_gap < 1e-5 or exact_gap == 0, exact_gap
    expected = 0 if lora else 2 if norm_net else 5  # RMSNorm weights; LayerNorm weight, bias
    assert sum("norm" in n for n in layer_norms) == expected, sorted(layer_norms)
    n_all = torch.cat(gather(norms))
    c = (C / (n_all + 1e-6)).clamp(max=1.0)
    clipped = int((c < 1).sum())
    assert clipped >= 4, c
    diff = check_update(theta0, theta, g, c)
    assert diff < 2e-6, diff
    moved = max((theta[n] - theta0[n]).abs().max().item() for n in g)
    frozen = max(
        ((theta[n] - theta0[n]).abs().max().item() for n in theta if n not in g), default=0.0
    )
    assert frozen == 0.0, frozen
    assert moved > 1e-3, moved
    return {
        "norms_vs_single_process": vs_single,
        "norm_layers_vs_oracle": exact_gap,
        "update_vs_oracle": diff,
        "max_update": moved,
        "clipped_samples": clipped,
        "smaller_stash": smaller_stash,
        "biases": sum(n.endswith("bias") for n in g),
    }


class TwoHeads(nn.Module):
    """Two ``nn.Linear`` sharing one weight: no supported tying (not an embedding and a head)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 5, bias=False), nn.Linear(5, 5, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class UseOutside(nn.Module):
    """``lin2.weight`` also used through ``F.linear`` in the root's forward, outside ``lin2``'s
    own forward: with ``lin2`` in the root's group the use runs on FSDP2's unsharded parameter
    (sharded on its own, FSDP2 would refuse the resharded DTensor itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(x))
        return self.lin2(h) + 5 * nn.functional.linear(h, self.lin2.weight)


def scenario_use_outside(rank: int) -> dict[str, Any]:
    """A trainable weight used outside its module's forward under FSDP2 is refused at the
    criterion's backward in both modes, as in one process. Before the check knew FSDP2's
    unsharded parameters, two passes trained the outside use unclipped (sigma = 0, C = 0.01,
    8 samples: an update of norm 0.016 > C) and book-keeping dropped it silently. Also the
    contract of :func:`opacus_rc._compat.torch.fsdp_unsharded_parameters`: after a forward,
    every leaf FSDP2 created maps to a registered sharded parameter."""
    from opacus_rc._compat.torch import fsdp_unsharded_parameters

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(1)
    x = 3 * torch.randn(B, 5, generator=g)
    y = torch.randint(0, 3, (B,), generator=g)
    for bookkeeping in (True, False):
        torch.manual_seed(0)
        model = UseOutside()
        fully_shard(model.lin1)
        fully_shard(model)
        sharded = {id(p) for p in model.parameters()}
        gsm = GradSampleModuleRandomizedClippingFSDP(
            model, max_grad_norm=0.01, loss_reduction="mean", bookkeeping=bookkeeping
        )
        opt = FSDPRandomizedClipOptimizer(
            torch.optim.SGD(gsm.parameters(), lr=1.0),
            grad_sample_module=gsm,
            noise_multiplier=0.0,
            max_grad_norm=0.01,
            expected_batch_size=B // WORLD,
            loss_reduction="mean",
        )
        crit = DPLossRandomizedClipping(gsm, opt, nn.CrossEntropyLoss(), "mean")
        logits = gsm(x[rank::WORLD])
        aliases = fsdp_unsharded_parameters(model)
        assert len(aliases) == 4 and {id(p) for p in aliases.values()} == sharded, aliases
        try:
            crit(logits, y[rank::WORLD]).backward()
        except RuntimeError as err:
            out["bookkeeping" if bookkeeping else "two_pass"] = str(err)
        else:
            raise AssertionError("a use outside the module's forward was accepted")
        assert all(p.grad is None for p in model.parameters())
        gsm.cleanup()
    return out


def scenario_empty_batch(rank: int) -> str:
    """An empty Poisson batch the tied Llama cannot take, under FSDP2: the error says to pass
    ``rand_on_empty=True`` and not to call ``optimizer.noise_only_step()``, which FSDP2 refuses
    (every rank runs the step's forward and backward)."""
    gsm = GradSampleModuleRandomizedClippingFSDP(
        shard(tied_llama()), max_grad_norm=1.0, loss_reduction="mean"
    )
    empty = torch.zeros((0, T), dtype=torch.long)
    try:
        gsm(input_ids=empty)
    except RuntimeError as err:
        message = str(err)
    else:
        raise AssertionError("the tiny Llama took an empty batch")
    finally:
        gsm.cleanup()
    assert "empty batch" in message and "rand_on_empty=True" in message, message
    assert "noise_only_step" not in message, message
    return message


def _refusal(model: nn.Module, error: type[BaseException]) -> str:
    try:
        GradSampleModuleRandomizedClippingFSDP(model, max_grad_norm=1.0, loss_reduction="mean")
    except error as err:
        assert not hasattr(model, "autograd_grad_sample_hooks")
        return str(err)
    raise AssertionError("the model was accepted")


def scenario_refusals(rank: int) -> dict[str, str]:
    """What FSDP2 still refuses, each with its message: a model not ``fully_shard``-ed at its
    root; a trainable parameter no FSDP2 group manages (``ignored_params``); a weight tied
    between modules other than one embedding and one head (as in one process)."""
    out = {}
    out["no_root"] = _refusal(tied_llama(), ValueError)
    assert "not fully_shard-ed at its root" in out["no_root"], out
    model = tied_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model, ignored_params={model.model.norm.weight})
    out["ignored"] = _refusal(model, ValueError)
    assert "no FSDP2 group manages" in out["ignored"] and "'model.norm'" in out["ignored"], out
    assert "freeze them" in out["ignored"], out
    two = TwoHeads()
    fully_shard([two.a, two.b])
    fully_shard(two)
    out["tied_two_linears"] = _refusal(two, NotImplementedError)
    assert "tied between modules 'a' (FSDPLinear), 'b' (FSDPLinear)" in out["tied_two_linears"]
    return out


def run(rank: int, port: int | None, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if port is not None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(WORLD)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        only = set(os.environ.get("FSDP_LLAMA_ONLY", "").split(",")) - {""}
        scenarios = {
            "tied_bk": lambda: scenario_tied(rank),
            "tied_two_pass": lambda: scenario_tied(rank, bookkeeping=False),
            "tied_ckpt_torch": lambda: scenario_tied(rank, checkpointing="torch"),
            "tied_ckpt_hf": lambda: scenario_tied(rank, checkpointing="hf"),
            "tied_ckpt_hf_reentrant": lambda: scenario_tied(rank, checkpointing="hf_reentrant"),
            "tied_own_groups": lambda: scenario_tied(rank, own=True),
            "tied_own_groups_ckpt": lambda: scenario_tied(rank, own=True, checkpointing="torch"),
            "lora": lambda: scenario_tied(rank, lora=True),
            "layernorm_root": lambda: scenario_tied(rank, norm_net="root"),
            "layernorm_wrapper": lambda: scenario_tied(rank, norm_net="wrapper"),
            "refusals": lambda: scenario_refusals(rank),
            "use_outside": lambda: scenario_use_outside(rank),
            "empty_batch": lambda: scenario_empty_batch(rank),
        }
        results = {k: f() for k, f in scenarios.items() if not only or k in only}
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(free_port(), sys.argv[1]), nprocs=WORLD, join=True)
