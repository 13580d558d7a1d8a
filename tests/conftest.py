"""Shared fixtures for the randomized-clipping tests (sketching, grad_sample, optimizers,
engine)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from opacus.accountants import PRVAccountant
from opacus.grad_sample.gsm_base import OPACUS_PARAM_MONKEYPATCH_ATTRS
from torch import nn


def pytest_configure(config: pytest.Config) -> None:
    # Opacus' two-pass loss always triggers this torch warning (inputs do not require grad), and
    # PrivacyEngine warns about secure RNG being off; neither is what these tests look at.
    config.addinivalue_line("filterwarnings", "ignore:Full backward hook is firing")
    config.addinivalue_line("filterwarnings", "ignore:Secure RNG turned off")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the machine is shared and the tensors are tiny."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class FakeRCAccountant(PRVAccountant):
    """Test-only stand-in for ``opacus_rc.accountants.RCAccountant``.

    Declares ``supports_randomized_clipping`` and records the ``sketch_spec`` of every step the
    optimizer's step hook reports, reading it as the real accountant does
    (``getattr(optim, "sketch_spec", None)``). Epsilons are PRV (exact clipping): never use them.
    """

    supports_randomized_clipping = True

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[Any] = []

    def step(self, *, noise_multiplier: float, sample_rate: float, sketch_spec: Any = None) -> None:
        self.specs.append(sketch_spec)
        super().step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)

    def get_optimizer_hook_fn(self, sample_rate: float) -> Callable[[Any], None]:
        def hook_fn(optim: Any) -> None:
            self.step(
                noise_multiplier=optim.noise_multiplier,
                sample_rate=sample_rate * optim.accumulated_iterations,
                sketch_spec=getattr(optim, "sketch_spec", None),
            )

        return hook_fn

    @classmethod
    def mechanism(cls) -> str:
        return "fake_rc_test"


@pytest.fixture
def fake_engine() -> Any:
    """An ``opacus_rc.PrivacyEngine`` whose accountant is :class:`FakeRCAccountant`.

    The fake is assigned to the instance; nothing is written into Opacus' accountant registry.
    """
    from opacus_rc.privacy_engine import PrivacyEngine

    engine = PrivacyEngine(accountant="prv")
    engine.accountant = FakeRCAccountant()
    return engine


def assert_no_hooks(model: nn.Module) -> None:
    """Fail if any hook or Opacus/opacus_rc attribute is left on ``model``."""
    assert not hasattr(model, "autograd_grad_sample_hooks")
    for name, sub in model.named_modules():
        assert not sub._forward_hooks, f"forward hook left on {name!r}"
        assert not sub._backward_hooks, f"backward hook left on {name!r}"
        assert not getattr(sub, "_forward_pre_hooks", {}), f"pre-hook left on {name!r}"
        for attr in ("activations", "max_batch_len", "ft_compute_sample_grad"):
            assert attr not in sub.__dict__, f"{attr} left on {name!r}"
    for name, p in model.named_parameters():
        for attr in OPACUS_PARAM_MONKEYPATCH_ATTRS:
            assert not hasattr(p, attr), f"{attr} left on parameter {name!r}"
        assert not p._post_accumulate_grad_hooks, f"grad hook left on parameter {name!r}"


@pytest.fixture(name="assert_no_hooks")
def _assert_no_hooks_fixture() -> Callable[[nn.Module], None]:
    return assert_no_hooks


def microbatch_norms(
    model: nn.Module, x: torch.Tensor, per_sample_loss: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Exact per-sample gradient norms by a batch-size-1 loop in float64 (the oracle).

    Args:
        model: Model (copied to float64; not modified).
        x: Batch ``(B, ...)``.
        per_sample_loss: Maps the model output of one sample ``(1, ...)`` to a scalar loss.

    Returns:
        ``{parameter name: (B,) float64 norms}`` for the trainable parameters, plus
        ``"__total__"``: the norm over all of them.
    """
    import copy

    ref = copy.deepcopy(model).double()
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for i in range(x.shape[0]):
        ref.zero_grad()
        xi = x[i : i + 1]
        xi = xi.double() if xi.is_floating_point() else xi
        per_sample_loss(ref(xi)).backward()
        params = dict(ref.named_parameters())
        for n in names:
            g = params[n].grad
            out[n].append(torch.zeros((), dtype=torch.float64) if g is None else g.norm())
    norms = {
        n: (torch.stack(v) if v else torch.zeros(0, dtype=torch.float64)) for n, v in out.items()
    }
    total = torch.zeros(x.shape[0], dtype=torch.float64)
    for v in norms.values():
        total = total + v**2
    norms["__total__"] = total.sqrt()
    return norms


@pytest.fixture(name="microbatch_norms")
def _microbatch_norms_fixture() -> Callable[..., dict[str, torch.Tensor]]:
    return microbatch_norms
