"""Per-record clipping inside packed rows, wired into the private step (issue 32, items 1-2):
the DP criterion's ``record_ids=`` (opacus_rc/packed_loss.py).

Oracle: each record's own gradient, float64, computed with the record alone and unpadded
(each segment of a record cut across rows run alone at positions ``0..l-1``, no mask), its
loss the mean of its counted next-token losses over all its segments; then clipped
``min(1, C / (||g_r|| + 1e-6))`` and summed. The packed step runs once on the packed rows.

GPT-2 (learned positions; ``Conv1D`` by functorch, embeddings, layer norms, the LM head
frozen: every norm exact) is compared at ``1e-9``. The tied embedding and LM head of Llama and
of ``gpt2-tied`` (the joint sketch) and Llama's ``nn.Linear`` norms are sketched: at ``k = 4096`` a
Hutchinson estimate's relative standard deviation is at most ``sqrt(2 / k) = 0.022``, so the
norms (square roots: half that) are compared at ``RTOL = 0.06`` (more than five standard
deviations, as tests/units/test_unit_models.py), and the clipped update exactly against the
factors made from the module's own reported norms (the clipped sum is exact given the factors).
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_hf_models as hf  # noqa: E402

from opacus_rc import PrivacyEngine  # noqa: E402
from opacus_rc.batch_independence import BatchIndependenceError  # noqa: E402
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping  # noqa: E402
from opacus_rc.optimizers import DPLossRandomizedClipping, RandomizedClipOptimizer  # noqa: E402
from opacus_rc.packing import (  # noqa: E402
    IGNORE_INDEX,
    block_diagonal_attention_mask,
    pack_records,
    record_segments,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:a sketch_generator was passed:UserWarning"),
    pytest.mark.filterwarnings("ignore:noise_multiplier=0"),
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
]

VOCAB = 40
#: With max_length 16: several records per row, the 20-token record cut across two rows.
LENGTHS = (5, 9, 3, 12, 7, 20, 2)
MAX_LENGTH = 16
#: Records grouped into units (a user's several records): units 0..3.
UNITS = torch.tensor([2, 0, 1, 0, 3, 2, 1])
K = 4096
RTOL = 0.06


def records(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in LENGTHS]


def tiny(arch: str) -> nn.Module:
    if arch == "llama":
        model = hf.llama(vocab=VOCAB, tie=True, layers=1, pad_token_id=0)
    elif arch == "llama-varlen":  # the varlen SDPA over records (tests/test_packed_attention.py)
        from opacus_rc.packed_attention import register_packed_sdpa

        model = hf.llama(vocab=VOCAB, tie=True, layers=1, pad_token_id=0)
        model.set_attn_implementation(register_packed_sdpa())
    elif arch == "llama-checkpointed":  # a checkpointed step: the smaller stash per layer
        model = hf.llama(vocab=VOCAB, tie=True, layers=1, pad_token_id=0)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif arch == "llama-lora":  # LoRA factors (nn.Linear) on a frozen base
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
        )
        model = peft.get_peft_model(hf.llama(vocab=VOCAB, tie=False, pad_token_id=0), config)
        for name, p in model.named_parameters():  # B = 0 at init: both factors matter
            if "lora_B" in name:
                with torch.no_grad():
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    elif arch == "gpt2-tied":
        model = hf.gpt2(vocab=VOCAB, tie=True, bos_token_id=1, eos_token_id=2)
    else:  # every norm exact: the LM head (an nn.Linear, sketched) untied and frozen
        model = hf.gpt2(vocab=VOCAB, tie=False, bos_token_id=1, eos_token_id=2)
        model.lm_head.weight.requires_grad_(False)
    return model.double().train()


def record_grads(model: nn.Module, packed: Any, groups: torch.Tensor) -> torch.Tensor:
    """``(G, P)`` float64: each group's summed per-record gradient, every record alone."""
    ref = copy.deepcopy(model).double()
    params = [p for p in ref.parameters() if p.requires_grad]
    segs = record_segments(packed.record_ids)
    rows = []
    for u in range(int(groups.max()) + 1):
        total = torch.zeros((), dtype=torch.float64)
        for r in torch.nonzero(groups == u).flatten().tolist():
            loss_sum, count = torch.zeros((), dtype=torch.float64), 0
            for rec, row, start, end in segs:
                if rec != r:
                    continue
                ids = packed.input_ids[row, start:end][None]
                labels = packed.labels[row, start:end][None]
                logits = ref(input_ids=ids, position_ids=torch.arange(end - start)[None]).logits
                target = labels[:, 1:]
                keep = target != IGNORE_INDEX
                tok = nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, VOCAB),
                    target.clamp(min=0).reshape(-1),
                    reduction="none",
                )
                loss_sum = loss_sum + tok[keep.reshape(-1)].sum()
                count += int(keep.sum())
            total = total + loss_sum / max(count, 1)
        grads = torch.autograd.grad(total, params)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def packed_step(
    model: nn.Module,
    packed: Any,
    *,
    c: float,
    units: torch.Tensor | None = None,
    bookkeeping: Any = True,
    k: int = K,
    padding_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, int, Any]:
    """One private step on the packed rows at ``sigma = 0``, SGD at ``lr = 1``: ``(norms,
    clipped sum (flat, float64), number of clipped records, the step's layout)``."""
    model = copy.deepcopy(model)
    if units is None:
        engine = PrivacyEngine(accountant="rc")
        loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m, opt, crit, _ = engine.make_private(
                module=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                criterion=nn.CrossEntropyLoss(),
                data_loader=loader,
                noise_multiplier=0.0,
                max_grad_norm=c,
                clipping="randomized",
                sketch_dim=k,
                sketch_generator=torch.Generator().manual_seed(3),
                bookkeeping=bookkeeping,
                poisson_sampling=False,
            )
    else:  # units of records: the module by hand (the engine needs a unit loader)
        m = GradSampleModuleRandomizedClipping(
            model,
            max_grad_norm=c,
            sketch_dim=k,
            sketch_generator=torch.Generator().manual_seed(3),
            bookkeeping=bookkeeping,
        )
        opt = RandomizedClipOptimizer(
            torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0),
            grad_sample_module=m,
            noise_multiplier=0.0,
            expected_batch_size=4,
        )
        crit = DPLossRandomizedClipping(m, opt, nn.CrossEntropyLoss(), "mean")
    inputs = packed.model_inputs(padding_free=padding_free, dtype=torch.float64)
    labels = inputs.pop("labels")
    logits = m(**inputs).logits
    R, T = labels.shape
    loss = crit(
        logits[:, :-1].reshape(-1, VOCAB),
        labels[:, 1:].reshape(-1),
        shape=(R, T - 1),
        record_ids=packed.record_ids,
        units=units,
    )
    before = [p.detach().clone() for p in m.parameters() if p.requires_grad]
    loss.backward()
    n = loss.loss_per_sample.numel()
    norms = m.private_step.per_sample_gradient_norms.clone()
    layout = m.private_step.units
    opt.step()
    after = [p.detach() for p in m.parameters() if p.requires_grad]
    divisor = opt.expected_batch_size
    grad = torch.cat([((b - a) * divisor).double().flatten() for b, a in zip(before, after)])
    return norms, grad, n, layout


def check(arch: str, *, units: torch.Tensor | None = None, active: bool = True, **kw: Any) -> None:
    model = tiny(arch)
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    assert int(packed.segments.max()) == 2 and packed.input_ids.shape[0] < len(LENGTHS)
    groups = torch.arange(len(LENGTHS)) if units is None else units
    G = record_grads(model, packed, groups)
    oracle = G.norm(dim=1)
    c = float(oracle.min()) / 2 if active else float(oracle.max()) * 10
    norms, grad, n, layout = packed_step(model, packed, c=c, units=units, **kw)
    assert n == G.shape[0]
    if arch == "llama" and kw.get("bookkeeping", True):
        # Every nn.Linear, the tied head and embedding (the joint sketch) and the RMSNorms
        # took the packed-row paths: the linear layers and the tied pair keep token rows, and
        # nothing was re-laid per record (N x max T_r).
        linears = [x for x in model.modules() if type(x) is nn.Linear]
        assert len(layout._token_rows) == len(linears) + 1 > 1
        assert layout.relaid == 0
    if arch == "llama-checkpointed":  # each layer's smaller stash, re-laid per record
        assert not layout._token_rows
    exact = arch == "gpt2"
    torch.testing.assert_close(norms, oracle, rtol=1e-9 if exact else RTOL, atol=0)
    factors = (c / (norms + 1e-6)).clamp(max=1.0)
    if active:
        assert bool((factors < 1).all())
    want = (factors[:, None] * G).sum(0)
    # Llama's attention takes its softmax in float32 even in a float64 model (its records
    # inside and alone differ by ~2e-8, opacus_rc/packing.py): 1e-6 of the largest entry.
    torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("arch", ["gpt2", "gpt2-tied", "llama"])
@pytest.mark.parametrize("active", [True, False])
def test_packed_update_equals_sum_of_clipped_records(arch: str, active: bool) -> None:
    check(arch, active=active)


@pytest.mark.parametrize("arch", ["llama-lora", "llama-checkpointed"])
def test_packed_update_lora_and_checkpointed(arch: str) -> None:
    check(arch)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_update_records_grouped_into_units(arch: str) -> None:
    check(arch, units=UNITS)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_update_two_passes(arch: str) -> None:
    check(arch, bookkeeping=False)


def test_pack_whose_attention_crosses_records_is_refused() -> None:
    model = tiny("llama")
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    crossing = packed.record_ids.clone()
    crossing[crossing >= 0] = 0  # a causal mask over each whole row
    mask = block_diagonal_attention_mask(crossing, dtype=torch.float64)
    packed_bad = type(packed)(**{**packed.__dict__})
    with pytest.raises(BatchIndependenceError, match="crosses records"):
        _run_with_mask(model, packed_bad, mask)


def _run_with_mask(model: nn.Module, packed: Any, mask: torch.Tensor) -> None:
    model = copy.deepcopy(model)
    engine = PrivacyEngine(accountant="rc")
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, opt, crit, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            clipping="randomized",
            sketch_dim=4,
            poisson_sampling=False,
        )
    inputs = packed.model_inputs(dtype=torch.float64)
    labels = inputs.pop("labels")
    inputs["attention_mask"] = mask
    logits = m(**inputs).logits
    R, T = labels.shape
    crit(
        logits[:, :-1].reshape(-1, VOCAB),
        labels[:, 1:].reshape(-1),
        shape=(R, T - 1),
        record_ids=packed.record_ids,
    )


def _private(model: nn.Module, *, sketch_dim: int = 4, **kw: Any) -> tuple[Any, Any, Any]:
    engine = PrivacyEngine(accountant="rc")
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, opt, crit, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            clipping="randomized",
            sketch_dim=sketch_dim,
            poisson_sampling=False,
            **kw,
        )
    return m, opt, crit


def _loss(m: nn.Module, crit: Any, inputs: dict, labels: torch.Tensor, **kw: Any) -> Any:
    logits = m(**inputs).logits
    R, T = labels.shape
    return crit(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), shape=(R, T - 1), **kw
    )


def _train_one_batch(
    m: nn.Module, opt: Any, crit: Any, packed: Any, **model_inputs: Any
) -> tuple[dict, torch.Tensor]:
    """One private step on ``packed`` (its model inputs with ``model_inputs``); returns the
    inputs and labels for the caller's next batch."""
    inputs = packed.model_inputs(**model_inputs)
    labels = inputs.pop("labels")
    _loss(m, crit, inputs, labels, record_ids=packed.record_ids).backward()
    opt.step()
    opt.zero_grad()
    return inputs, labels


def test_padding_free_position_ids_give_each_record_its_clipped_gradient() -> None:
    # TRL's padding_free=True: one row of concatenated whole records, no padding, no mask,
    # position ids restarting at each record; the criterion derives the records from them.
    model = tiny("gpt2")
    short = [r for r in records() if r.numel() <= MAX_LENGTH]
    packed = pack_records(short, max_length=sum(r.numel() for r in short), pad_token_id=0)
    assert packed.input_ids.shape[0] == 1 and bool((packed.record_ids >= 0).all())
    G = record_grads(model, packed, torch.arange(len(short)))
    oracle = G.norm(dim=1)
    c = float(oracle.min()) / 2
    m, opt, crit = _private(copy.deepcopy(model))
    opt.max_grad_norm = c
    inputs = packed.model_inputs(padding_free=True, dtype=torch.float64)
    labels = inputs.pop("labels")
    assert "attention_mask" not in inputs
    loss = _loss(m, crit, inputs, labels, position_ids=inputs["position_ids"])
    assert loss.loss_per_sample.shape == (len(short),)
    loss.backward()
    torch.testing.assert_close(m.private_step.per_sample_gradient_norms, oracle, rtol=1e-9, atol=0)
    grad = torch.cat([p.grad.double().flatten() for p in m.parameters() if p.requires_grad])
    want = ((c / (oracle + 1e-6)).clamp(max=1.0)[:, None] * G).sum(0)
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_padding_free_pack_whose_positions_do_not_restart_is_refused() -> None:
    # No mask and positions 0..T-1 over the row: the model's causal attention crosses records.
    model = tiny("llama")
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    m, _, crit = _private(model)
    inputs = packed.model_inputs(padding_free=True, dtype=torch.float64)
    labels = inputs.pop("labels")
    inputs["position_ids"] = torch.arange(labels.shape[1]).expand_as(labels)
    with pytest.raises(BatchIndependenceError, match="other logits alone"):
        _loss(m, crit, inputs, labels, record_ids=packed.record_ids)


def test_crossing_mask_is_refused_at_every_batch() -> None:
    # The logits check runs at the first packed batch; the mask's structure at every batch.
    model = tiny("llama")
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    m, opt, crit = _private(model)
    inputs, labels = _train_one_batch(m, opt, crit, packed, dtype=torch.float64)
    assert m.packed_attention_guard.full_checked
    whole_rows = packed.record_ids.clamp(max=0)  # -1 at padding, 0 elsewhere: a causal row
    inputs["attention_mask"] = block_diagonal_attention_mask(whole_rows, dtype=torch.float64)
    with pytest.raises(BatchIndependenceError, match="crosses records"):
        _loss(m, crit, inputs, labels, record_ids=packed.record_ids)


def test_first_batch_of_one_record_per_row_leaves_the_logits_check_due() -> None:
    # A first packed batch whose rows each hold one record (a small Poisson batch) compares no
    # record after another: the check must stay due, and catch the next batch whose rows leak
    # (positions not restarting, no mask). It was spent on the first batch before.
    model = tiny("llama")
    m, opt, crit = _private(model)
    one = pack_records(records()[:1], max_length=MAX_LENGTH, pad_token_id=0)
    _train_one_batch(m, opt, crit, one, padding_free=True, dtype=torch.float64)
    assert not m.packed_attention_guard.full_checked
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    inputs = packed.model_inputs(padding_free=True, dtype=torch.float64)
    labels = inputs.pop("labels")
    inputs["position_ids"] = torch.arange(labels.shape[1]).expand_as(labels)
    with pytest.raises(BatchIndependenceError, match="other logits alone"):
        _loss(m, crit, inputs, labels, record_ids=packed.record_ids)


def test_boolean_mask_under_eager_is_refused_at_every_batch() -> None:
    # Eager adds the mask to the scores: a boolean block mask masks nothing. Refused from the
    # mask's dtype and the attention, whether or not the logits check runs.
    model = tiny("llama")
    model.set_attn_implementation("eager")
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    m, _, crit = _private(model, check_batch_independence=False)
    inputs = packed.model_inputs(dtype=torch.bool)
    labels = inputs.pop("labels")
    with pytest.raises(BatchIndependenceError, match="boolean 4D attention_mask under the eager"):
        _loss(m, crit, inputs, labels, record_ids=packed.record_ids)


def test_attention_change_after_the_check_runs_it_again() -> None:
    model = tiny("llama")
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    m, opt, crit = _private(model)
    inputs, labels = _train_one_batch(m, opt, crit, packed, dtype=torch.float64)
    guard = m.packed_attention_guard
    assert guard.full_checked and guard._checked_attention == "sdpa"
    model.set_attn_implementation("eager")  # a float mask: correct under eager too
    _loss(m, crit, inputs, labels, record_ids=packed.record_ids).backward()
    assert guard.full_checked and guard._checked_attention == "eager"


def test_records_check_under_bfloat16_autocast_compares_in_float32() -> None:
    # TRL's default bf16=True runs the step under a CPU autocast; the check's forwards run
    # without it (structure, not rounding): a correct pack passes, a crossing one is refused.
    from opacus_rc.packing import check_records_independent

    model = tiny("llama").float()
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    inputs = packed.model_inputs(padding_free=True)
    inputs.pop("labels")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check_records_independent(model, inputs, record_ids=packed.record_ids)
        bad = dict(inputs, position_ids=torch.arange(MAX_LENGTH).expand_as(packed.record_ids))
        with pytest.raises(BatchIndependenceError, match="other logits alone"):
            check_records_independent(model, bad, record_ids=packed.record_ids)


def test_records_check_under_an_autocast_inside_the_forward_compares_in_float32() -> None:
    """accelerate under ``bf16=True`` (TRL's default) wraps ``model.forward`` in a bfloat16
    autocast entered inside the forward, out of reach of an enclosing context; the check's
    forwards still run without it: a correct pack passes (before: refused, ``max |difference|
    0.000977, rounding tolerance 0.000345``), positions that do not restart are refused."""
    accelerate = pytest.importorskip("accelerate")
    from opacus_rc.packing import check_records_independent

    model = tiny("llama").float()
    # What Accelerator.prepare_model does under mixed_precision="bf16".
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model.forward = accelerate.utils.convert_outputs_to_fp32(autocast(model.forward))
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    inputs = packed.model_inputs(padding_free=True)
    inputs.pop("labels")
    assert model(**inputs).logits.dtype == torch.float32  # bfloat16 inside, as accelerate
    check = check_records_independent(model, inputs, record_ids=packed.record_ids)
    assert check.max_difference <= check.tolerance < 1e-3
    bad = dict(inputs, position_ids=torch.arange(MAX_LENGTH).expand_as(packed.record_ids))
    with pytest.raises(BatchIndependenceError, match="other logits alone"):
        check_records_independent(model, bad, record_ids=packed.record_ids)
    assert not torch.is_autocast_enabled("cpu")


def test_target_predicted_across_records_is_refused() -> None:
    model = tiny("gpt2")
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    m, _, crit = _private(model)
    inputs = packed.model_inputs(dtype=torch.float64)
    labels = inputs.pop("labels")
    good = labels
    labels = torch.where(packed.record_ids >= 0, packed.input_ids, labels)  # no ignore at starts
    with pytest.raises(ValueError, match="across a record boundary"):
        _loss(m, crit, inputs, labels, record_ids=packed.record_ids)
    # The refused forward's records were dropped: the next step runs.
    _loss(m, crit, inputs, good, record_ids=packed.record_ids).backward()
    assert m.private_step.per_sample_gradient_norms.shape == (len(LENGTHS),)


class ConvLM(nn.Module):
    """An embedding, a convolution over positions (not token-wise), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.conv = nn.Conv1d(8, 8, kernel_size=3, padding=1)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        h = self.conv(self.emb(input_ids).transpose(1, 2)).transpose(1, 2)
        return type("Out", (), {"logits": self.head(h)})()


def test_module_that_is_not_tokenwise_is_refused() -> None:
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    m, _, crit = _private(ConvLM(), check_batch_independence=False)
    labels = packed.labels
    with pytest.raises(NotImplementedError, match="record_ids=.*'conv' \\(Conv1d\\)"):
        _loss(m, crit, {"input_ids": packed.input_ids}, labels, record_ids=packed.record_ids)


def test_record_ids_refusals() -> None:
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    m, _, crit = _private(tiny("gpt2"))
    inputs = packed.model_inputs(dtype=torch.float64)
    labels = inputs.pop("labels")
    logits = m(**inputs).logits
    R, T = labels.shape
    flat = (logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    rid = packed.record_ids
    with pytest.raises(ValueError, match="needs a per-token loss"):
        crit(*flat, record_ids=rid)
    with pytest.raises(TypeError, match="not both"):
        crit(*flat, shape=(R, T - 1), record_ids=rid, position_ids=inputs["position_ids"])
    with pytest.raises(ValueError, match="record_ids of shape"):
        crit(*flat, shape=(R, T - 1), record_ids=rid[:, :-3])
    gap = torch.where(rid == 2, torch.full_like(rid, len(LENGTHS)), rid)
    with pytest.raises(ValueError, match="without gaps"):
        crit(*flat, shape=(R, T - 1), record_ids=gap)
    with pytest.raises(ValueError, match="units has 3 entries for 7 records"):
        crit(*flat, shape=(R, T - 1), record_ids=rid, units=torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="unit_split= is not supported"):
        crit(*flat, shape=(R, T - 1), record_ids=rid, unit_split=(False, True))


def _norms_with_probes(model: nn.Module, inputs: dict, labels: torch.Tensor, **kw: Any) -> Any:
    model = copy.deepcopy(model)
    engine = PrivacyEngine(accountant="rc")
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m, _, crit, _ = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            criterion=nn.CrossEntropyLoss(),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=1.0,
            clipping="randomized",
            sketch_dim=4,
            sketch_generator=torch.Generator().manual_seed(11),
            poisson_sampling=False,
        )
    _loss(m, crit, inputs, labels, **kw).backward()
    return m.private_step.per_sample_gradient_norms


def test_sketched_record_norms_are_each_records_hutchinson_estimate_with_the_same_probes() -> None:
    # Each whole record as its own right-padded row draws the same probes (the same generator,
    # layers in the same order, N samples of the same length max T_r): the packed step's
    # sketched per-record norms must be those estimates, up to rounding. At k = 4 they are far
    # from the exact norms, so equality is not a consequence of both being accurate.
    model = tiny("llama")
    short = [r for r in records() if r.numel() <= MAX_LENGTH]
    packed = pack_records(short, max_length=MAX_LENGTH, pad_token_id=0)
    inputs = packed.model_inputs(dtype=torch.float64)
    labels = inputs.pop("labels")
    assert packed.input_ids.shape[0] < len(short)  # several records per row
    packed_norms = _norms_with_probes(model, inputs, labels, record_ids=packed.record_ids)
    longest = max(r.numel() for r in short)
    ids = torch.zeros(len(short), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(short):
        ids[i, : r.numel()], mask[i, : r.numel()] = r, 1
    rows = {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(longest)}
    rows["position_ids"] = rows["position_ids"].expand_as(ids).contiguous()
    row_labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    alone_norms = _norms_with_probes(model, rows, row_labels)
    torch.testing.assert_close(packed_norms, alone_norms, rtol=1e-6, atol=0)
    exact = record_grads(model, packed, torch.arange(len(short))).norm(dim=1)
    assert float(((alone_norms - exact).abs() / exact).max()) > 0.05


class TokenMLP(nn.Module):
    """Embedding -> Linear (bias) -> tanh -> RMSNorm -> Linear (bias): token-wise only, so a
    record's tokens give the same gradients wherever they lie."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 12)
        self.hidden = nn.Linear(12, 10)
        self.norm = nn.RMSNorm(10)
        self.head = nn.Linear(10, VOCAB)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        h = self.norm(torch.tanh(self.hidden(self.emb(input_ids))))
        return type("Out", (), {"logits": self.head(h)})()


def test_linear_biases_and_rmsnorm_of_a_tokenwise_model() -> None:
    # Sketched weights (k = 4096, RTOL), exact biases, embedding and RMSNorm, through the
    # packed-row path of nn.Linear; the update exactly against the module's own norms.
    model = TokenMLP().double().train()
    packed = pack_records(records(), max_length=MAX_LENGTH, pad_token_id=0)
    G = record_grads(model, packed, torch.arange(len(LENGTHS)))
    oracle = G.norm(dim=1)
    c = float(oracle.min()) / 2
    m, opt, crit = _private(copy.deepcopy(model), sketch_dim=K, check_batch_independence=False)
    opt.max_grad_norm = c
    labels = packed.labels
    loss = _loss(m, crit, {"input_ids": packed.input_ids}, labels, record_ids=packed.record_ids)
    loss.backward()
    norms = m.private_step.per_sample_gradient_norms
    assert len(m.private_step.units._token_rows) == 2  # both nn.Linear from the packed rows
    offsets, at = {}, 0
    for name, p in model.named_parameters():
        offsets[name], at = slice(at, at + p.numel()), at + p.numel()
    by_name = {n.removeprefix("_module."): p for n, p in m.named_parameters()}
    for name in ("hidden.bias", "head.bias", "emb.weight", "norm.weight"):  # exact norms
        torch.testing.assert_close(
            m.private_step.last_norm_samples[by_name[name]].double(),
            G[:, offsets[name]].norm(dim=1),
            rtol=1e-9,
            atol=0,
        )
    torch.testing.assert_close(norms, oracle, rtol=RTOL, atol=0)
    grad = torch.cat([p.grad.double().flatten() for p in m.parameters() if p.requires_grad])
    want = ((c / (norms + 1e-6)).clamp(max=1.0)[:, None] * G).sum(0)
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-9)
