"""The main job, tutorials/long_document_classification.py, on the real model and real data.

``--smoke`` runs a few randomized-clipping steps of the packaged SmolLM2-135M on the vendored
Brown corpus at a short length (seconds of compute on two cores; slower on a loaded machine),
in a subprocess exactly as a user runs it, and the results table it writes with
``--output-json`` is checked field by field, including the per-step norm record (the clipped
fraction recomputed from the norms and C) and the head-only ablation. The split of the model
into a frozen bottom, computed once per document, and a trainable top is checked to be exact.
On a tiny random Llama the sketched share of each document's squared norm is checked against a
float64 per-document oracle, and the set of parameters counted as sketched against the norms
that actually change with the sketch.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tutorials" / "long_document_classification.py"


def load_job():
    """The main job's script as a module (its functions, without running ``main``)."""
    spec = importlib.util.spec_from_file_location("long_document_classification", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_job(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_help() -> None:
    proc = run_job("--help", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for option in (
        "--clipping",
        "--sketch",
        "--sketch-dim",
        "--epsilon",
        "--max-length",
        "--epochs",
        "--batch-size",
        "--lr",
        "--trainable-layers",
        "--dataset",
        "--seed",
        "--smoke",
        "--output-json",
    ):
        assert option in proc.stdout, option
    assert "{randomized,ghost,none}" in proc.stdout and "{brown,spam}" in proc.stdout


@pytest.mark.slow
def test_smoke_run_results_table(tmp_path) -> None:
    out = tmp_path / "results.json"
    proc = run_job("--smoke", "--no-progress", "--output-json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())

    # What ran: randomized clipping (Hutchinson, k = 32) on Brown, as the default run.
    assert (r["dataset"], r["clipping"], r["sketch"], r["sketch_dim"]) == (
        "brown",
        "randomized",
        "hutchinson",
        32,
    )
    assert r["smoke"] is True and r["steps"] > 0 and r["train_docs"] > 0 and r["test_docs"] > 0
    # Training: finite losses.
    assert math.isfinite(r["first_loss"]) and math.isfinite(r["final_loss"])
    # Privacy: a real noise multiplier, epsilon spent in (0, target].
    assert r["noise_multiplier"] > 0 and math.isfinite(r["noise_multiplier"])
    assert 0 < r["epsilon"] <= r["target_epsilon"] == 8.0 and r["delta"] == 1e-5
    # Evaluation and costs.
    assert 0.0 <= r["test_accuracy"] <= 1.0 and 0.5 <= r["majority_baseline"] <= 1.0
    assert r["wall_time_s"] > 0 and r["peak_memory_gib"] > 0
    # The table is printed too.
    for row in (
        "test accuracy",
        "majority-class baseline",
        "noise multiplier",
        "peak memory",
        "sketched share of norm^2",
        "documents clipped / step",
        "decoder block moved",
        "ablation: head only",
    ):
        assert row in proc.stdout, row

    # The norms each step clipped with: one (B,) list per non-empty step, positive and finite.
    norms, shares, c = r["norms_per_step"], r["sketched_share_per_step"], r["max_grad_norm"]
    assert c == 100.0 and 0 < len(norms) <= r["steps"] and len(shares) == len(norms)
    assert all(len(n) == len(s) > 0 for n, s in zip(norms, shares))
    assert all(0 < x < math.inf for step in norms for x in step)
    # The clipped fraction is the share of documents with n_hat_i > C, step by step.
    fractions = [sum(x > c for x in step) / len(step) for step in norms]
    clipped = r["clipped_fraction"]
    assert clipped["mean"] == pytest.approx(sum(fractions) / len(fractions), abs=1e-12)
    assert (clipped["min"], clipped["max"]) == (min(fractions), max(fractions))
    # Shares in [0, 1]; the summary is their mean and range. At step 1 the head is zero, so
    # the block's gradient W^T (p - y) d pooled / d theta is exactly zero: share 0.
    flat = [x for step in shares for x in step]
    assert all(0.0 <= x <= 1.0 for x in flat) and all(x == 0.0 for x in shares[0])
    share = r["sketched_share"]
    assert share["min"] == min(flat) and share["max"] == max(flat)
    assert share["mean"] == pytest.approx(sum(flat) / len(flat), abs=1e-12)
    assert share["sketched_parameters"] == 7  # q, k, v, o, gate, up, down of the one block
    # The block moved; at body_lr 1e-6 the DP noise accounts for all of it: over n steps the
    # noise's norm is within ~1/sqrt(2 n P) ~ 2e-4 (relative) of the expectation the job
    # reports (P = 3.5 M), and the clipped gradients move the block by at most n lr C = 3e-4
    # against the noise's ~0.05, so 1% is a margin of many standard deviations.
    block = r["block_weight_change"]
    assert block["params"] == r["trainable_params"] - 2 * 576 - 2
    assert block["relative_change"] == pytest.approx(block["noise_relative_change"], rel=0.01)

    # The ablation: the head alone, same privacy budget, same Poisson batches.
    a = r["ablation_head_only"]
    assert a["trainable_params"] == 2 * 576 + 2 and a["steps"] == r["steps"]
    assert a["noise_multiplier"] == r["noise_multiplier"] and a["epsilon"] == r["epsilon"]
    assert 0.0 <= a["test_accuracy"] <= 1.0 and math.isfinite(a["final_loss"])
    over = a["test_accuracy_over_seeds"]
    assert a["noise_seeds"] == list(range(10)) and len(over["values"]) == 10
    assert over["values"][0] == a["test_accuracy"] and all(0 <= x <= 1 for x in over["values"])
    assert over["min"] <= over["mean"] <= over["max"]
    assert [len(n) for n in a["norms_per_step"]] == [len(n) for n in norms]
    # Paired: at the main run's noise seed the ablation gets the same batches and the head's
    # noise value for value (the block's drawn and discarded), so it is the main run with the
    # block frozen. At body_lr 1e-6 the block moves by ~1e-4 (relative), so the two runs must
    # agree: at step 1 exactly (both heads zero, the block's gradient zero: each norm is the
    # head's, on the same pooled vector, up to float32 roundoff), later within the block's own
    # part of each norm (share < 1e-2, so < 1%), and in their losses. Without the pairing
    # (measured, the block's draws not skipped) the step-3 norms differ by 8-65% and the final
    # loss by 2%, so this fails.
    for step, (x, y) in enumerate(zip(a["norms_per_step"], norms)):  # batch sizes vary
        rtol = 1e-4 if step == 0 else 1e-2
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=rtol, atol=0.0)
    assert a["final_loss"] == pytest.approx(r["final_loss"], rel=1e-4)


def test_frozen_bottom_split_is_exact() -> None:
    """Top blocks on ``frozen_features`` == the whole (untruncated) body on the token ids."""
    job = load_job()
    args = job.parse_args(["--max-length", "32", "--num-layers", "3", "--trainable-layers", "1"])
    tokenizer = job.rc_models.load_smollm2_tokenizer()
    texts = [
        "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary "
        "election produced no evidence that any irregularities took place, and the jury "
        "further said in term-end presentments that the City Executive Committee had over-all "
        "charge of the election.",
        "She closed the door and listened to the rain.",  # shorter than 32 tokens: padded
    ]
    data = job.rc_data.TokenizedDataset(texts, [0, 1], tokenizer, max_length=32)
    ids, mask = data.input_ids, data.attention_mask
    assert mask[0].all() and not mask[1].all()

    # Reference: embeddings, 3 blocks and the final norm, run directly on the token ids.
    full = job.load_body(args).eval()
    assert len(full.layers) == 3
    with torch.no_grad():
        hidden = full(input_ids=ids, attention_mask=mask).last_hidden_state
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    expected = (hidden * weights).sum(dim=1) / weights.sum(dim=1)

    # Split: the bottom (embeddings + 2 blocks) once, then the classifier on the top block.
    body = job.load_body(args)
    with job.frozen_bottom(body, args.num_layers - args.trainable_layers) as bottom:
        features = job.frozen_features(bottom, data, desc="", disable=True)
    assert features.shape == (2, 32, 576) and len(body.layers) == 3  # restored on exit
    model, counts = job.build_classifier(body, args, (features, mask))
    assert len(model.top.layers) == 1 and counts["trainable"] > 0
    model.eval()
    with torch.no_grad():
        pooled = model.pool(features, mask)
    torch.testing.assert_close(pooled, expected, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# The sketched share on a tiny model
# ------------------------------------------------------------------------------------------------


def tiny_classifier(job):
    """A DocumentClassifier on a random 1-block Llama (hidden 16, MLP 32), a random head,
    and a batch of three documents (one padded)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        max_position_embeddings=32,
        pad_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(0)
    top = transformers.LlamaModel(cfg)
    top.embed_tokens.requires_grad_(False)
    model = job.DocumentClassifier(top, num_labels=2).train()
    # A non-zero head, so that the block gets a gradient, and logits of order 1 (no saturated
    # document: its tiny gradients would only test float32 roundoff), so that neither the
    # block nor the head dominates the norm.
    model.logit_scale = 1.0
    with torch.no_grad():
        model.head.weight.normal_(0.0, 1.0)
        model.head.bias.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(1)
    features = torch.randn(3, 6, 16, generator=g)
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[2, 4:] = 0  # a padded document
    labels = torch.tensor([0, 1, 1])
    return model, (features, mask, labels)


def private(job, model, batch, *, sketch: str, sketch_dim: int):
    from opacus_rc import PrivacyEngine

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*batch), batch_size=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # parameters stay put
    wrapped, optimizer, criterion, _ = PrivacyEngine(accountant="rc").make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        criterion=torch.nn.CrossEntropyLoss(),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch=sketch,
        sketch_dim=sketch_dim,
    )
    return wrapped, optimizer, criterion


def private_step(wrapped, optimizer, criterion, batch) -> dict[str, torch.Tensor]:
    features, mask, labels = batch
    optimizer.zero_grad()
    criterion(wrapped(features, mask), labels).backward()
    optimizer.step()
    return {name: t.detach().clone() for name, t in wrapped.norm_samples.items()}


def test_sketched_share_matches_float64_oracle() -> None:
    """norm_split's share on a tiny model == sum of the sketched weights' squared per-document
    gradient norms over the total, from float64 per-document backward passes.

    Hutch++ with ``s = k = 32`` head columns is exact here: its head ``Q`` (``d x min(d, s)``,
    orthonormal) spans the whole input side when ``d <= s``, so the tail is zero, and every
    sketched weight has ``d <= 32`` (16, or 32 for down_proj). The recorded norms, and the
    share, must then equal the oracle up to float32 roundoff (v_proj and o_proj carry 0.1-0.3
    of each document's squared norm here; the head, the biases and the RMSNorms the rest).
    """
    job = load_job()
    model, batch = tiny_classifier(job)
    oracle_model = copy.deepcopy(model).double()
    wrapped, optimizer, criterion = private(job, model, batch, sketch="hutch++", sketch_dim=32)
    sketched = job.sketched_parameter_names(wrapped)
    assert sketched == {
        f"top.layers.0.{m}.weight"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    recorded = private_step(wrapped, optimizer, criterion, batch)
    n_hat, share = job.norm_split(recorded, sketched)

    # Oracle: per-document gradients of the float64 copy, one backward pass per document.
    features, mask, labels = batch
    params = {n: p for n, p in oracle_model.named_parameters() if p.requires_grad}
    assert set(params) == set(recorded)
    sq = {n: torch.zeros(3, dtype=torch.float64) for n in params}
    for i in range(3):
        logits = oracle_model(features[i : i + 1].double(), mask[i : i + 1])
        loss = torch.nn.functional.cross_entropy(logits, labels[i : i + 1])
        grads = torch.autograd.grad(loss, list(params.values()))
        for n, g in zip(params, grads):
            sq[n][i] = (g**2).sum()
    total = sum(sq.values())
    expected_share = sum(sq[n] for n in sketched) / total
    for n in params:  # each recorded norm is the exact one (a wrong route would show here)
        torch.testing.assert_close(recorded[n].double(), sq[n].sqrt(), rtol=2e-4, atol=1e-7)
    torch.testing.assert_close(n_hat, total.sqrt(), rtol=2e-4, atol=0.0)
    torch.testing.assert_close(n_hat, wrapped.per_sample_gradient_norms, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(share, expected_share, rtol=1e-3, atol=1e-6)
    # Not a degenerate split: both the sketched block and the exact head carry weight.
    assert bool(((share > 0.05) & (share < 0.95)).all()), share


def test_sketched_parameters_are_those_the_sketch_changes() -> None:
    """Two steps on the same batch with parameters held fixed (lr 0) draw fresh probes: the
    norms that change are exactly those counted as sketched (Hutchinson, k = 1: each changes by
    a factor chi2_1-distributed, never equal in floating point); exact ones repeat bit for bit.
    """
    job = load_job()
    model, batch = tiny_classifier(job)
    wrapped, optimizer, criterion = private(job, model, batch, sketch="hutchinson", sketch_dim=1)
    first = private_step(wrapped, optimizer, criterion, batch)
    second = private_step(wrapped, optimizer, criterion, batch)
    changed = {n for n in first if not torch.equal(first[n], second[n])}
    assert changed == job.sketched_parameter_names(wrapped)
    assert "head.weight" not in changed  # nn.Linear on the pooled (B, hidden) vector: exact


def test_norm_recorder_summary() -> None:
    """The summary's clipped fractions and share statistics from hand-made records."""
    job = load_job()
    rec = job.NormRecorder.__new__(job.NormRecorder)
    rec.max_grad_norm, rec.sketched = 2.0, frozenset({"a", "b"})
    rec.norms = [[1.0, 3.0, 2.0], [5.0], [0.5, 0.25]]
    rec.shares = [[0.0, 0.5, 1.0], [0.25], [0.1, 0.2]]
    out = rec.summary()
    assert out["clipped_fraction_per_step"] == [1 / 3, 1.0, 0.0]  # 2.0 is not above C = 2
    assert out["clipped_fraction"] == {"mean": pytest.approx(4 / 9), "min": 0.0, "max": 1.0}
    assert out["sketched_share"]["mean"] == pytest.approx(2.05 / 6)
    assert (out["sketched_share"]["min"], out["sketched_share"]["max"]) == (0.0, 1.0)
    assert out["norm_mean"] == pytest.approx(11.75 / 6)


def test_noise_only_step_of_the_job_takes_an_accounted_step_with_randomized_clipping() -> None:
    """The job's empty-batch branch (``noise_only_step``, also used by the generative tutorial)
    zeroed the gradients and called ``step()``, which randomized clipping's step protocol
    refuses ("no clip factors"): the job crashed on any empty Poisson batch (new-user test).
    Now it takes the optimizer's noise-only step: parameters move, one step is accounted."""
    job = load_job()
    from opacus_rc import PrivacyEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    engine = PrivacyEngine()
    module, opt, crit, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=torch.utils.data.DataLoader(data, batch_size=2),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
    )
    before = model.weight.detach().clone()
    opt.zero_grad()
    job.noise_only_step(opt)
    assert len(engine.accountant) == 1
    assert not torch.equal(model.weight, before)
