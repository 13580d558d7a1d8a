"""Contract tests of :mod:`opacus_rc._compat.opacus`: each adapter does, on the installed
Opacus, what ``opacus_rc`` relies on. A failure here after an Opacus upgrade names the
internal that changed (the adapter's docstring says which callers depend on it)."""

from __future__ import annotations

import math

import opacus
import pytest
import torch
from opacus.accountants import RDPAccountant, create_accountant
from opacus.data_loader import CollateFnWithEmpty
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.grad_sample_module import (
    GradSampleHooks,
    create_or_accumulate_grad_sample,
)
from opacus.layers import DPMultiheadAttention
from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

import opacus_rc  # noqa: F401  (registers the "rc" accountant)
from opacus_rc._compat import opacus as compat
from opacus_rc.accountants import RCAccountant


@pytest.mark.parametrize("secure_mode", [False, True])
def test_generate_noise_distribution(secure_mode: bool) -> None:
    """N(0, std^2) entries of the reference's shape and dtype, reproducible from the generator.

    n = 200 * 300 = 60000 draws with std = 2.5: the sample mean has std 2.5 / sqrt(n) = 0.0102,
    the sample variance std sigma^2 sqrt(2 / (n - 1)) = 0.0361; the tolerances are 5 of those
    (a false failure has probability < 1e-6 each).
    """
    std = 2.5
    ref = torch.zeros(200, 300, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    noise = compat.generate_noise(std=std, reference=ref, generator=gen, secure_mode=secure_mode)
    assert noise.shape == ref.shape and noise.dtype == ref.dtype and noise.device == ref.device
    n = noise.numel()
    assert abs(noise.mean().item()) < 5 * std / math.sqrt(n)
    assert abs(noise.var().item() - std**2) < 5 * std**2 * math.sqrt(2 / (n - 1))
    again = compat.generate_noise(
        std=std, reference=ref, generator=torch.Generator().manual_seed(0), secure_mode=secure_mode
    )
    assert torch.equal(noise, again)
    zero = compat.generate_noise(std=0.0, reference=ref, generator=gen, secure_mode=secure_mode)
    assert torch.equal(zero, torch.zeros_like(ref))


@pytest.mark.parametrize("secure_mode", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_generate_noise_is_opacus_draw(secure_mode: bool, dtype: torch.dtype) -> None:
    """The adapter's draw is Opacus' ``_generate_noise`` bit for bit (same generator state,
    same values, dtype and shape; the plain draw skips only Opacus' unused zeros tensor), and
    leaves the generator where Opacus' leaves it (the next draw agrees too)."""
    from opacus.optimizers.optimizer import _generate_noise

    ref = torch.zeros(7, 13, dtype=dtype)
    ours_gen, theirs_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(2):
        ours = compat.generate_noise(
            std=0.7, reference=ref, generator=ours_gen, secure_mode=secure_mode
        )
        theirs = _generate_noise(0.7, ref, generator=theirs_gen, secure_mode=secure_mode)
        assert ours.dtype == theirs.dtype == dtype and ours.shape == ref.shape
        assert torch.equal(ours, theirs)
        assert ours.std().item() > 0.3


def test_processed_flag_round_trip() -> None:
    t = torch.ones(3)
    compat.check_processed_flag(t)  # fresh: passes
    compat.mark_as_processed(t)
    with pytest.raises(ValueError, match="zero_grad"):
        compat.check_processed_flag(t)
    ts = [torch.ones(2), torch.ones(2)]
    compat.mark_as_processed(ts)
    with pytest.raises(ValueError):
        compat.check_processed_flag([ts[1]])


def _dp_optimizer(cls: type, p: nn.Parameter, **kw: object) -> DPOptimizer:
    return cls(
        torch.optim.SGD([p], lr=1.0),
        noise_multiplier=5.0,
        max_grad_norm=1.0,
        expected_batch_size=1,
        loss_reduction="sum",
        **kw,
    )


def test_adjusted_noise_multiplier() -> None:
    """The attribute the adapter reads is the one Opacus adds its noise with."""
    p = nn.Parameter(torch.zeros(4))
    opt = _dp_optimizer(DPOptimizerFastGradientClipping, p)
    assert compat.adjusted_noise_multiplier(opt) is None
    opt._adjusted_noise_multiplier = 0.0
    assert compat.adjusted_noise_multiplier(opt) == 0.0
    p.summed_grad = torch.arange(4.0)
    opt.add_noise()
    # noise_multiplier is 5, the adjusted one 0: Opacus added no noise
    assert torch.equal(p.grad, torch.arange(4.0))


def test_skip_queue() -> None:
    """next_step_skipped peeks at the queue BatchMemoryManager fills; last_step_skipped is what
    step() decided."""
    lin = nn.Linear(2, 1)
    gsm = GradSampleModule(lin)
    opt = DPOptimizer(
        torch.optim.SGD(lin.parameters(), lr=0.1),
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        expected_batch_size=2,
    )
    assert compat.next_step_skipped(opt) is False
    opt.signal_skip_step(do_skip=True)
    assert compat.next_step_skipped(opt) is True
    assert compat.next_step_skipped(opt) is True  # peeking does not consume
    gsm(torch.ones(2, 2)).sum().backward()
    before = lin.weight.detach().clone()
    opt.step()
    assert compat.last_step_skipped(opt) is True
    assert torch.equal(lin.weight, before)  # skipped: accumulated only
    assert compat.next_step_skipped(opt) is False
    opt.zero_grad()  # keeps the accumulated sum of a skipped step
    gsm(torch.ones(2, 2)).sum().backward()  # the logical batch's last physical batch
    opt.step()
    assert compat.last_step_skipped(opt) is False
    assert not torch.equal(lin.weight, before)


def test_registry_holds_ours() -> None:
    assert compat.registered_accountant("rc") is RCAccountant
    assert compat.registered_accountant("rdp") is RDPAccountant
    assert compat.registered_accountant("no-such-mechanism") is None
    assert type(create_accountant("rc")) is compat.registered_accountant("rc")


def test_wrapped_module() -> None:
    lin = nn.Linear(3, 2)
    gsm = GradSampleModule(lin)
    assert compat.wrapped_module(gsm) is lin
    assert compat.wrapped_module_if_built(gsm) is lin
    other = nn.Linear(3, 2)
    hooks = GradSampleHooks(other)
    assert compat.wrapped_module(hooks) is other
    assert compat.wrapped_module_if_built(hooks) is other
    hooks.cleanup()
    assert compat.wrapped_module_if_built(nn.Linear(1, 1)) is None
    assert compat.wrapped_module_if_built(object()) is None
    assert gsm._modules[compat.WRAPPED_MODULE_ATTR] is lin


def test_fsdp_base_type() -> None:
    """FSDP2 makes ``FSDP<T>`` with bases ``(FSDPModule, T)``; the adapter answers ``T``."""
    fsdp_linear = type("FSDPLinear", (FSDPModule, nn.Linear), {})
    assert compat.fsdp_base_type(fsdp_linear(2, 2)) is nn.Linear
    assert compat.fsdp_base_type(nn.Embedding(3, 2)) is nn.Embedding


def test_forward_counter() -> None:
    """Opacus counts one per recorded forward and one down per processed backward hook."""
    lin = nn.Linear(3, 2)
    gsm = GradSampleModule(lin)
    x = torch.randn(4, 3)
    out = gsm(x) + gsm(x)
    assert compat.forward_count(lin.weight) == 2 and compat.forward_count(lin.bias) == 2
    out.sum().backward()  # Opacus' backward hooks count both uses down
    assert compat.forward_count(lin.weight) == 0
    assert lin.weight.grad_sample.shape == (4, 2, 3)
    gsm(x)
    assert compat.forward_count(lin.weight) == 1
    assert compat.count_down_use(lin.weight) == 0
    compat.reset_forward_counter(lin.bias)
    assert compat.forward_count(lin.bias) == 0
    # the per-sample gradient Opacus accumulates between uses, dropped
    create_or_accumulate_grad_sample(
        param=lin.weight, grad_sample=torch.ones(4, 2, 3), max_batch_len=4
    )
    assert hasattr(lin.weight, "_current_grad_sample")
    compat.drop_current_grad_sample(lin.weight)
    assert not hasattr(lin.weight, "_current_grad_sample")
    compat.drop_current_grad_sample(lin.weight)  # none: a no-op


def test_make_empty_batch() -> None:
    collate = CollateFnWithEmpty(None, batch_first=True, rand_on_empty=True)
    template = [torch.zeros(5, 7, dtype=torch.long), torch.zeros(5)]
    batch = compat.make_empty_batch(collate, template)
    assert [tuple(b.shape) for b in batch] == [(1, 7), (1,)]
    assert batch[0].dtype == torch.long and set(batch[0].unique().tolist()) <= {0, 1}


def test_sequence_bias_is_opacus_layer() -> None:
    """The type the grad-sample module keys its own-layout rule on is the one Opacus'
    attention builds (add_bias_kv=True)."""
    attn = DPMultiheadAttention(4, 2, add_bias_kv=True)
    assert any(type(m) is compat.SequenceBias for m in attn.modules())


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_engine_seams_are_called(mode: str) -> None:
    """make_private reaches every seam, once, and the defaults build Opacus' objects."""
    calls: list[str] = []

    class Recording(compat.PrivacyEngineSeams):
        def prepare_model_seam(self, module, **kw):
            calls.append("model")
            return super().prepare_model_seam(module, **kw)

        def prepare_data_loader_seam(self, data_loader, **kw):
            calls.append("data_loader")
            return super().prepare_data_loader_seam(data_loader, **kw)

        def prepare_optimizer_seam(self, **kw):
            calls.append("optimizer")
            return super().prepare_optimizer_seam(**kw)

        def prepare_criterion_seam(self, **kw):
            calls.append("criterion")
            return super().prepare_criterion_seam(**kw)

    model = nn.Linear(3, 2)
    loader = DataLoader(TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long)), 4)
    out = Recording(accountant="rdp").make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        criterion=nn.CrossEntropyLoss(),
        grad_sample_mode=mode,
    )
    expected = ["model", "data_loader", "optimizer"] + (["criterion"] if mode == "ghost" else [])
    assert calls == expected
    assert isinstance(out[1], opacus.optimizers.DPOptimizer)
