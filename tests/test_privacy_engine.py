"""opacus_rc.PrivacyEngine: make_private(clipping="randomized"), validation, cleanup.

Most tests use ``FakeRCAccountant`` (tests/conftest.py), which records the sketch spec of every
step. Tests marked ``needs_rc_accountant`` use the real ``opacus_rc.accountants`` and are
skipped until it is importable.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from opacus.grad_sample import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_rc.privacy_engine as pe
from opacus_rc.grad_sample import (
    GradSampleHooksRandomizedClipping,
    GradSampleModuleRandomizedClipping,
)
from opacus_rc.optimizers import RandomizedClipOptimizer
from opacus_rc.sketching import SketchSpec

VOCAB, EMB, CLASSES, SEQ = 16, 8, 2, 6

pytestmark = pytest.mark.filterwarnings("ignore:a sketch_generator was passed")


def _rc_accountant_available() -> bool:
    try:
        from opacus_rc.accountants import RCAccountant, get_noise_multiplier  # noqa: F401
    except ImportError:
        return False
    return True


needs_rc_accountant = pytest.mark.skipif(
    not _rc_accountant_available(), reason="opacus_rc.accountants.RCAccountant not available yet"
)


class TinyTransformer(nn.Module):
    """Embedding + Linear + LayerNorm over sequences, mean-pooled, linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMB)
        self.proj = nn.Linear(EMB, EMB)
        self.norm = nn.LayerNorm(EMB)
        self.head = nn.Linear(EMB, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)
        h = self.norm(torch.relu(self.proj(e)) + e)
        return self.head(h.mean(1))


def token_task(n: int, seed: int) -> TensorDataset:
    """Label 1 iff the sequence contains more tokens >= VOCAB/2 than tokens below."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = ((x >= VOCAB // 2).sum(1) > SEQ // 2).long()
    return TensorDataset(x, y)


def setup(
    engine: Any, *, batch_size: int = 16, n: int = 64, **kwargs: Any
) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(token_task(n, 0), batch_size=batch_size)
    args = {
        "module": model,
        "optimizer": opt,
        "data_loader": loader,
        "criterion": nn.CrossEntropyLoss(),
        "noise_multiplier": 0.5,
        "max_grad_norm": 1.0,
        "clipping": "randomized",
        "sketch_dim": 8,
        **kwargs,
    }
    return model, engine.make_private(**args)


def test_make_private_randomized_returns_rc_objects(fake_engine: Any) -> None:
    model, (module, optimizer, criterion, loader) = setup(
        fake_engine, sketch="hutch++", sketch_dim=16
    )
    assert isinstance(module, GradSampleModuleRandomizedClipping)
    assert isinstance(optimizer, RandomizedClipOptimizer)
    assert isinstance(criterion, DPLossFastGradientClipping)
    spec = SketchSpec("hutch++", 16, 16, per_sample=True, secret=True)
    assert module.sketch_spec == spec and optimizer.sketch_spec == spec
    assert optimizer.noise_multiplier == 0.5 and optimizer.expected_batch_size == 16
    assert module.max_grad_norm == optimizer.max_grad_norm == 1.0
    assert module.sketch_generator is not optimizer.generator
    module.cleanup()


def test_every_step_reports_the_modules_spec_to_the_accountant(fake_engine: Any) -> None:
    model, (module, optimizer, criterion, loader) = setup(fake_engine)
    steps = 0
    for x, y in loader:
        criterion(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    assert steps == 4
    assert fake_engine.accountant.specs == [module.sketch_spec] * 4
    assert module.sketch_spec == SketchSpec("hutchinson", 8, None, per_sample=True, secret=True)


def test_transformer_like_model_trains(fake_engine: Any) -> None:
    """20 DP steps (sigma = 0.3, C = 1, k = 32, Poisson q = 1/4) reduce the full-data loss."""
    torch.manual_seed(0)
    model = TinyTransformer()
    data = token_task(256, 1)
    loader = DataLoader(data, batch_size=64)
    module, optimizer, criterion, loader = fake_engine.make_private(
        module=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
        data_loader=loader,
        criterion=nn.CrossEntropyLoss(),
        noise_multiplier=0.3,
        max_grad_norm=1.0,
        clipping="randomized",
        noise_generator=torch.Generator().manual_seed(3),
        sketch_generator=torch.Generator().manual_seed(4),
    )
    x_all, y_all = data.tensors

    def full_loss() -> float:
        with torch.no_grad():
            return nn.functional.cross_entropy(model(x_all), y_all).item()

    before = full_loss()
    steps = 0
    while steps < 20:
        for x, y in loader:
            criterion(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == 20:
                break
    after = full_loss()
    assert len(fake_engine.accountant.specs) == 20
    assert after < 0.7 * before, (before, after)  # measured: 0.73 -> 0.38


def test_wrap_model_false(fake_engine: Any, assert_no_hooks: Callable) -> None:
    model, (hooks, optimizer, criterion, loader) = setup(fake_engine, wrap_model=False)
    assert isinstance(hooks, GradSampleHooksRandomizedClipping)
    before = model.proj.weight.detach().clone()
    x, y = next(iter(loader))
    criterion(model(x), y).backward()
    optimizer.step()
    assert not torch.equal(model.proj.weight, before)
    assert fake_engine.accountant.specs == [hooks.sketch_spec]
    hooks.cleanup()
    assert_no_hooks(model)


def test_empty_poisson_batch_is_noised_and_counted(fake_engine: Any) -> None:
    """Poisson sampling with q = 1/4 over 4 records: some batches are empty (B = 0). Such a
    step must still add noise and be accounted."""
    torch.manual_seed(5)
    model = TinyTransformer()
    loader = DataLoader(token_task(4, 2), batch_size=1)
    module, optimizer, criterion, dp_loader = fake_engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),  # lr=1, sigma=1 diverges to NaN
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=4,
    )
    empty_steps = 0
    for _ in range(10):
        for x, y in dp_loader:
            before = model.proj.weight.detach().clone()
            n_before = len(fake_engine.accountant.specs)
            criterion(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert len(fake_engine.accountant.specs) == n_before + 1
            if len(x) == 0:
                empty_steps += 1
                assert not torch.equal(model.proj.weight, before)  # noise only
        if empty_steps >= 2:
            break
    assert empty_steps >= 2


BAD_INPUTS = [
    (
        {"sketch": "gauss"},
        ValueError,
        r"sketch must be one of \('hutchinson', 'hutch\+\+'\), got 'gauss'",
    ),
    ({"sketch_dim": 0}, ValueError, "sketch_dim must be >= 1, got 0"),
    ({"sketch_dim": 2.5}, TypeError, "sketch_dim must be an int"),
    ({"sketch_head_dim": 3}, ValueError, "sketch_head_dim is only used by sketch='hutch\\+\\+'"),
    (
        {"loss_reduction": "sum"},
        ValueError,
        "criterion has reduction='mean' but loss_reduction='sum'",
    ),
    ({"max_grad_norm": [1.0, 1.0]}, TypeError, "one float max_grad_norm"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm must be a finite number > 0"),
    ({"noise_multiplier": float("nan")}, ValueError, "noise_multiplier must be a finite number"),
    ({"grad_sample_mode": "ew"}, ValueError, "grad_sample_mode must be one of"),
    ({"bogus_option": 1}, TypeError, r"unexpected keyword arguments.*bogus_option"),
    ({"clipping": "flat", "sketch_dim": 8}, ValueError, "only apply to clipping='randomized'"),
]


@pytest.mark.parametrize(("override", "error", "match"), BAD_INPUTS)
def test_bad_input_raises_and_leaves_no_hooks(
    fake_engine: Any, assert_no_hooks: Callable, override: dict, error: type, match: str
) -> None:
    torch.manual_seed(0)
    model = TinyTransformer()
    args = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "data_loader": DataLoader(token_task(8, 0), batch_size=4),
        "criterion": nn.CrossEntropyLoss(),
        "noise_multiplier": 1.0,
        "max_grad_norm": 1.0,
        "clipping": "randomized",
        **override,
    }
    with pytest.raises(error, match=match):
        fake_engine.make_private(**args)
    assert_no_hooks(model)
    assert len(fake_engine.accountant.specs) == 0


def test_eval_mode_model_raises(fake_engine: Any, assert_no_hooks: Callable) -> None:
    model = TinyTransformer().eval()
    with pytest.raises(ValueError, match=r"eval mode.*model\.train\(\)"):
        fake_engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(token_task(8, 0), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
        )
    assert_no_hooks(model)


@pytest.mark.filterwarnings("ignore:GDP accounting is experimental")
@pytest.mark.parametrize("accountant", ["prv", "rdp", "gdp"])
def test_accountant_without_rc_support_is_rejected(
    accountant: str, assert_no_hooks: Callable
) -> None:
    engine = pe.PrivacyEngine(accountant=accountant)
    model = TinyTransformer()
    with pytest.raises(ValueError) as info:
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(token_task(8, 0), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
        )
    assert str(info.value) == (
        "clipping='randomized' needs an accountant that can account for sketched norms; "
        "use accountant='rc'"
    )
    assert_no_hooks(model)


def test_failure_after_hooks_are_attached_cleans_up(
    fake_engine: Any, assert_no_hooks: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure late in make_private (after the hooks exist) removes them again."""

    def broken_loader(*args: Any, **kwargs: Any) -> DataLoader:
        raise RuntimeError("data loader preparation failed")

    monkeypatch.setattr(fake_engine, "prepare_data_loader_seam", broken_loader)
    model = TinyTransformer()
    with pytest.raises(RuntimeError, match="data loader preparation failed"):
        setup(fake_engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert_no_hooks(model)
    assert fake_engine.dataset is None


def test_other_clipping_values_are_opacus(fake_engine: Any, assert_no_hooks: Callable) -> None:
    loader = DataLoader(token_task(8, 0), batch_size=4)
    model = TinyTransformer()
    out = fake_engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="flat",
    )
    assert len(out) == 3
    assert type(out[0]) is GradSampleModule and type(out[1]) is DPOptimizer
    assert not hasattr(out[1], "sketch_spec")  # the accountant then accounts exact clipping
    out[0].cleanup()
    # Opacus raises after attaching hooks for an unknown clipping; the engine removes them.
    model = TinyTransformer()
    with pytest.raises(ValueError, match="Unexpected optimizer parameters"):
        fake_engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="bogus",
        )
    assert_no_hooks(model)


def test_make_private_with_epsilon_searches_with_the_modules_spec(
    fake_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The noise search gets the exact SketchSpec the module ends up using, the engine's
    accountant and Opacus' sample rate; its sigma is the optimizer's."""
    import opacus_rc.accountants as accountants

    calls: list[dict[str, Any]] = []

    def fake_search(**kwargs: Any) -> float:
        calls.append(kwargs)
        return 1.234

    monkeypatch.setattr(accountants, "get_noise_multiplier", fake_search, raising=False)
    torch.manual_seed(0)
    model = TinyTransformer()
    module, optimizer, criterion, loader = fake_engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(token_task(40, 0), batch_size=10),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch="hutch++",
        sketch_dim=24,
        sketch_head_dim=8,
    )
    assert len(calls) == 1
    call = calls[0]
    assert call["sketch_spec"] == module.sketch_spec == optimizer.sketch_spec
    assert call["sketch_spec"] == SketchSpec("hutch++", 24, 8, per_sample=True, secret=True)
    assert call["accountant"] is fake_engine.accountant
    assert call["sample_rate"] == pytest.approx(0.25)
    # Two epochs of int(1 / 0.25) = 4 steps, searched as steps (the schedule the run has).
    assert (call["epochs"], call["steps"], call["epsilon_tolerance"]) == (None, 8, 0.01)
    assert (call["target_epsilon"], call["target_delta"]) == (3.0, 1e-5)
    assert optimizer.noise_multiplier == 1.234


def test_make_private_with_epsilon_validates_before_searching(
    fake_engine: Any, monkeypatch: pytest.MonkeyPatch, assert_no_hooks: Callable
) -> None:
    import opacus_rc.accountants as accountants

    def must_not_run(**kwargs: Any) -> float:
        raise AssertionError("the noise search ran before validation")

    monkeypatch.setattr(accountants, "get_noise_multiplier", must_not_run, raising=False)
    model = TinyTransformer()
    with pytest.raises(ValueError, match="sketch_dim must be >= 1"):
        fake_engine.make_private_with_epsilon(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(token_task(8, 0), batch_size=4),
            target_epsilon=3.0,
            target_delta=1e-5,
            epochs=1,
            max_grad_norm=1.0,
            clipping="randomized",
            sketch_dim=0,
        )
    assert_no_hooks(model)


@needs_rc_accountant
def test_real_rc_accountant_end_to_end() -> None:
    """Default engine (accountant="rc"): two randomized steps, a finite epsilon, and the spec
    in the accountant's history."""
    engine = pe.PrivacyEngine()
    assert getattr(type(engine.accountant), "supports_randomized_clipping", False)
    model, (module, optimizer, criterion, loader) = setup(engine, sketch_dim=32)
    for x, y in loader:
        criterion(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    eps = engine.get_epsilon(1e-5)
    assert math.isfinite(eps) and eps > 0
    spec = module.sketch_spec.to_dict()
    assert [entry[3] for entry in engine.accountant.history] == [spec]


@needs_rc_accountant
def test_real_make_private_with_epsilon_reaches_target() -> None:
    engine = pe.PrivacyEngine()
    torch.manual_seed(0)
    model = TinyTransformer()
    module, optimizer, criterion, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(token_task(400, 0), batch_size=4),
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=32,
    )
    assert optimizer.noise_multiplier > 0
    for _, (x, y) in zip(range(3), loader):
        criterion(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert engine.get_epsilon(1e-5) < 3.0


def test_opacus_module_validation_runs_before_hooks(
    fake_engine: Any, assert_no_hooks: Callable
) -> None:
    """BatchNorm mixes samples; Opacus' ModuleValidator rejects it before any hook exists."""
    from opacus.validators.errors import UnsupportedModuleError

    model = nn.Sequential(nn.Embedding(VOCAB, EMB), nn.Flatten(), nn.BatchNorm1d(EMB * SEQ))
    with pytest.raises(UnsupportedModuleError, match="BatchNorm"):
        fake_engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(token_task(8, 0), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
        )
    assert_no_hooks(model)


# --------------------------------------------------------------------------------------------
# The README's Usage section (issue 14, items 5, 10 and 11)
# --------------------------------------------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_usage() -> str:
    """The README's Usage section (up to the next level-2 heading)."""
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Usage\n")
    return text[start : text.index("\n## ", start + 1)]


def test_make_private_with_epsilon_takes_every_option_of_make_private() -> None:
    """Both methods share one option list (issue 14, item 5: rand_on_empty was missing from
    make_private_with_epsilon): same names, same defaults, all keyword-only."""
    own = {"noise_multiplier"}
    epsilon_only = {"target_epsilon", "target_delta", "epochs"}
    plain = inspect.signature(pe.PrivacyEngine.make_private).parameters
    with_eps = inspect.signature(pe.PrivacyEngine.make_private_with_epsilon).parameters
    shared = {n: (p.kind, p.default) for n, p in plain.items() if n not in own}
    assert {n: (p.kind, p.default) for n, p in with_eps.items() if n not in epsilon_only} == shared
    assert "rand_on_empty" in shared
    for params in (plain, with_eps):
        kinds = {p.kind for n, p in params.items() if n not in ("self", "kwargs")}
        assert kinds == {inspect.Parameter.KEYWORD_ONLY}


def test_options_record_has_every_shared_option() -> None:
    """The one record both methods build (opacus_rc.engine.options) has exactly the options
    their signatures share, ``**kwargs`` as its ``kwargs`` field, beside the fields validation
    derives (with defaults): an option added to the signatures but not to the record (or the
    reverse) fails here, not silently at a call."""
    from dataclasses import MISSING, fields

    from opacus_rc.engine.options import DERIVED_FIELDS, OPACUS_OPTIONS, MakePrivateOptions

    plain = inspect.signature(pe.PrivacyEngine.make_private).parameters
    shared = set(plain) - {"self", "noise_multiplier"}
    required = {f.name for f in fields(MakePrivateOptions) if f.default is MISSING}
    assert required == shared
    assert {f.name for f in fields(MakePrivateOptions)} == shared | set(DERIVED_FIELDS)
    assert len(shared) == 25
    assert set(OPACUS_OPTIONS) < shared
    assert "noise_multiplier" not in OPACUS_OPTIONS


@needs_rc_accountant
def test_readme_usage_snippet_trains_for_the_epochs_it_budgets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 14, item 11: the snippet searched sigma for ``epochs=3`` but looped once. Run it
    (with a small model and loader) and check that it takes ``epochs * len(loader)`` steps and
    ends at most at its target epsilon."""
    code = re.search(r"```python\n(.*?)```", readme_usage(), re.S)
    assert code is not None
    snippet = code.group(1)
    torch.manual_seed(0)
    namespace: dict[str, Any] = {
        "MyTransformer": TinyTransformer,
        "train_loader": DataLoader(token_task(64, 0), batch_size=16),
    }
    exec(compile(snippet, str(README), "exec"), namespace)  # the README's own code
    epochs = eval(re.search(r"epochs=(\w+)", snippet).group(1), namespace)
    target = float(re.search(r"target_epsilon=([\d.]+)", snippet).group(1))
    assert epochs == 3
    assert len(namespace["engine"].accountant) == epochs * len(namespace["train_loader"]) == 12
    printed = float(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.9 * target < printed <= target  # the search aims within 0.01 below the target


def test_readme_says_what_forgetting_import_opacus_rc_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 14, item 10. Opacus has no plug-in mechanism for accountants (its registry is a
    dict that ``create_accountant`` reads), so ``import opacus_rc`` must register "rc". Without
    the registration Opacus raises the error the README quotes; opacus_rc.PrivacyEngine
    registers the accountant itself."""
    import opacus
    from opacus.accountants import registry

    monkeypatch.delitem(registry._ACCOUNTANTS, "rc")  # as if opacus_rc had not been imported
    with pytest.raises(ValueError, match="^Unexpected accounting mechanism: rc$") as info:
        opacus.PrivacyEngine(accountant="rc")
    usage = readme_usage()
    assert f"ValueError: {info.value}" in usage and "import opacus_rc" in usage
    assert pe.PrivacyEngine().accountant.mechanism() == "rc"


def test_a_loader_expecting_no_record_per_step_is_refused() -> None:
    """A custom batch_sampler of 10 batches over a public dataset_size of 5 records:
    q = 1 / len(loader) = 0.1 and the divisor int(5 * 0.1) is 0, so the first step would
    divide the noisy sum by 0 (NaN parameters, still accounted). Refused at make_private, before any
    hook or step."""
    data = torch.utils.data.TensorDataset(torch.randn(5, 4), torch.randint(0, 2, (5,)))
    batches = [[i % 5] for i in range(10)]
    loader = torch.utils.data.DataLoader(data, batch_sampler=batches)
    model = nn.Linear(4, 2)
    engine = pe.PrivacyEngine(accountant="rc")
    with pytest.raises(
        ValueError, match=r"expected batch size, int\(dataset_size=5 \* rate 0.1\).*is 0"
    ):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
            criterion=nn.CrossEntropyLoss(),
            dataset_size=5,
        )
    assert not engine.accountant.history
    assert not isinstance(model, GradSampleModule)  # the user's module was not wrapped


def test_the_readme_quotes_what_each_omitted_switch_step_gives() -> None:
    """Issue 33 item 3: the switch from an Opacus script is three changes, two of them found
    only by errors that do not say so. The README's "From an Opacus script" quotes the error
    of each omission: reproduced here, and each must be in that section as printed."""
    import opacus

    from opacus_rc.grad_sample.private_step import StepProtocolError

    text = README.read_text(encoding="utf-8")
    start = text.index("\n## From an Opacus script\n")
    section = " ".join(text[start : text.index("\n## ", start + 1)].split())

    def setup() -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=16)

    quoted = []
    model, optimizer, loader = setup()
    with pytest.raises(ValueError) as info:  # opacus.PrivacyEngine with clipping="randomized"
        opacus.PrivacyEngine(accountant="rc").make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
        )
    quoted.append(f"ValueError: {info.value}")
    model, optimizer, loader = setup()
    with pytest.raises(ValueError) as info:  # Opacus' three-value unpacking
        model, optimizer, loader = pe.PrivacyEngine().make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
            criterion=nn.CrossEntropyLoss(),
        )
    quoted.append(f"ValueError: {info.value}")
    model, optimizer, loader = setup()
    model, optimizer, criterion, loader = pe.PrivacyEngine().make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",  # no criterion=: nn.CrossEntropyLoss(), as the README says
    )
    assert isinstance(criterion.criterion, nn.CrossEntropyLoss)
    x, y = next(iter(loader))
    nn.CrossEntropyLoss()(model(x), y).backward()  # the user's own loss, not `criterion`
    with pytest.raises(StepProtocolError) as info:
        optimizer.step()
    message = str(info.value)
    quoted.append(f"StepProtocolError: {message[: message.index(' (the gradients')]}")
    for line in quoted:
        assert line in section, line


@pytest.mark.parametrize(("rank", "shown"), [("0", 1), ("1", 0)])
def test_secure_rng_warning_is_shown_once_per_run_on_rank_zero(rank: str, shown: int) -> None:
    """Issue 33 item 6: Opacus' "Secure RNG turned off" was printed by every rank of a
    distributed run. Each rank (a fresh interpreter with torchrun's $RANK) builds two engines;
    rank 0 shows the warning once, the other ranks not at all."""
    import os
    import subprocess
    import sys

    probe = (
        "import warnings\n"
        "warnings.simplefilter('default')\n"
        "from opacus_rc import PrivacyEngine\n"
        "PrivacyEngine(); PrivacyEngine()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=README.parent,
        env={**os.environ, "RANK": rank},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stderr.count("Secure RNG turned off") == shown
