"""Sketch secrecy and independence (docs/privacy/threat_models.md#threat-models-conditions).

The "hidden" accountant is valid only if every sample's probes are fresh, independent of the
data, the noise and the other samples, and unknown to the adversary. Checked here at the engine
level; the module-level draw interception is test_probes_fresh_per_sample_layer_and_step.
"""

from __future__ import annotations

import io
import math
import secrets
import sys
import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_rc.optimizers.noise as noise_module
import opacus_rc.sketching as sketching
from opacus_rc.grad_sample import GradSampleModuleRandomizedClipping
from opacus_rc.privacy_engine import PrivacyEngine
from tests import flat_mlp

D, H, CLASSES, T = 5, 6, 3, 4


class SeqMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x))).mean(1)


def loader(n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, T, D, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (n,), generator=g)), batch_size=4)


def make(engine: PrivacyEngine, **kwargs: Any) -> tuple[nn.Module, Any, Any, Any, Any]:
    torch.manual_seed(0)
    model = SeqMLP()
    args = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "clipping": "randomized"}
    args.update(kwargs)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=loader(),
        **args,
    )
    return (model, *out)


def train(module: Any, opt: Any, crit: Any, dp_loader: Any, steps: int) -> list[torch.Tensor]:
    seen = []
    for _, (x, y) in zip(range(steps), dp_loader):
        seen.append(x)
        crit(module(x), y).backward()
        opt.step()
        opt.zero_grad()
    return seen


def test_sketch_generator_is_its_own() -> None:
    """The sketch generator is none of: the noise generator, the loader's generator, torch's
    default generator; it is OS-seeded, differently for every module."""
    noise = torch.Generator().manual_seed(1)
    engines = [PrivacyEngine() for _ in range(2)]
    made = [make(e, noise_generator=noise if i == 0 else None) for i, e in enumerate(engines)]
    for _, module, opt, _, dp_loader in made:
        g = module.sketch_generator
        assert g is not torch.default_generator and g is not opt.generator
        assert g is not getattr(dp_loader.batch_sampler, "generator", None)
        assert module.sketch_spec.secret
    assert made[0][2].generator is noise
    seeds = {m[1].sketch_generator.initial_seed() for m in made}
    assert len(seeds) == 2


def test_sketch_noise_and_sampling_randomness_are_independent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two runs with the same noise seed and the same global (sampling) seed but different
    sketch seeds draw the same Poisson batches and exactly the same noise; runs with the same
    sketch seed but different noise seeds draw exactly the same probes. So no stream is
    shared, and the sketch generator advances only by the probes drawn (replayed exactly)."""
    draws: list[torch.Tensor] = []
    original = sketching.draw_gaussian_probes

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        draws.append(out.clone())
        return out

    monkeypatch.setattr(sketching, "draw_gaussian_probes", counting)
    runs = {}
    for sketch_seed, noise_seed in [(1, 7), (2, 7), (1, 8)]:
        engine = PrivacyEngine()
        sketch_gen = torch.Generator().manual_seed(sketch_seed)
        noise_gen = torch.Generator().manual_seed(noise_seed)
        with pytest.warns(UserWarning, match="sketch_generator was passed"):
            model, module, opt, crit, dp_loader = make(
                engine, sketch_generator=sketch_gen, noise_generator=noise_gen, sketch_dim=4
            )
        torch.manual_seed(123)  # Poisson sampling uses torch's default generator
        draws.clear()
        norms = []
        for _, (x, y) in zip(range(3), dp_loader):
            crit(module(x), y).backward()
            norms.append(module.per_sample_gradient_norms.clone())
            opt.step()
            opt.zero_grad()
        replay = torch.Generator().manual_seed(sketch_seed)
        for probes in draws:  # exactly the probes, in order
            replayed = torch.randn(probes.shape, generator=replay)
            replayed.mul_(1.0 / math.sqrt(probes.shape[-1]))
            assert torch.equal(replayed, probes)
        runs[(sketch_seed, noise_seed)] = {
            "norms": norms,
            "probes": list(draws),
            "noise_state": noise_gen.get_state(),
            "sketch_state_matches_probe_count": torch.equal(
                sketch_gen.get_state(), replay.get_state()
            ),
            "batches": [len(n) for n in norms],
        }
    a, b, c = runs[(1, 7)], runs[(2, 7)], runs[(1, 8)]
    assert a["batches"] == b["batches"] == c["batches"]  # sampling unaffected by the sketch
    assert torch.equal(a["noise_state"], b["noise_state"])  # noise unaffected by the sketch
    # The probes do not depend on the noise (the norms then differ after the first update).
    assert all(torch.equal(x, y) for x, y in zip(a["probes"], c["probes"], strict=True))
    assert torch.equal(a["norms"][0], c["norms"][0])
    assert not torch.equal(a["norms"][0], b["norms"][0])
    assert all(r["sketch_state_matches_probe_count"] for r in runs.values())


def test_passed_generator_warns_and_is_accounted_as_revealed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A user-supplied sketch generator (a seed the adversary may know): one warning, a spec
    with secret=False, and the accountant switches that step to the more conservative
    "revealed" threat model (docs/privacy/threat_models.md#threat-models-revealed), so the reported
    epsilon is larger than with an OS seed. The engine's warning at make_private says so; the
    accountant does not log it again (issue 14, new-user test: it used to be said twice)."""
    eps = {}
    for passed in (False, True):
        engine = PrivacyEngine()
        extra = {"sketch_generator": torch.Generator().manual_seed(0)} if passed else {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, module, opt, crit, dp_loader = make(engine, sketch_dim=16, **extra)
        said = [str(w.message) for w in caught if "sketch_generator was passed" in str(w.message)]
        assert len(said) == int(passed)
        assert all("'revealed' threat model" in m for m in said)
        assert module.sketch_spec.secret is not passed
        caplog.clear()
        with caplog.at_level("WARNING", logger="opacus_rc.accountants.rc"):
            train(module, opt, crit, dp_loader, steps=2)
        assert "'revealed' threat model" not in caplog.text
        eps[passed] = engine.get_epsilon(1e-5)
        assert engine.accountant.history[-1][3]["secret"] is not passed
    assert eps[True] > eps[False]


def test_sketch_state_is_not_in_checkpoints(tmp_path: Any) -> None:
    """Neither the module's state_dict nor the optimizer's, nor Opacus' engine checkpoint,
    contains the sketch generator or its state (the seed would reveal every past probe)."""
    engine = PrivacyEngine()
    model, module, opt, crit, dp_loader = make(engine)
    train(module, opt, crit, dp_loader, steps=2)
    gen_state = module.sketch_generator.get_state()
    path = tmp_path / "ckpt.pt"
    engine.save_checkpoint(path=path, module=module, optimizer=opt)
    blob = path.read_bytes()
    assert gen_state.numpy().tobytes()[:64] not in blob
    assert gen_state.numpy().tobytes()[-64:] not in blob
    ckpt = torch.load(path, weights_only=True)  # plain tensors and data only
    assert set(ckpt["module_state_dict"]) == {f"_module.{k}" for k in model.state_dict()}
    seed_bytes = module.sketch_generator.initial_seed().to_bytes(8, "little")
    buffer = io.BytesIO()
    torch.save({"m": module.state_dict(), "o": opt.state_dict()}, buffer)
    assert seed_bytes not in buffer.getvalue()


def test_hutchpp_head_and_tail_probes_fresh_per_sample_layer_and_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hutch++ draws two sketches per layer (head, tail): all draws of a step, and across
    steps, are distinct, per sample (Theorem H, docs/privacy/hutchpp.md#hutchpp-theorem-h, needs the
    tail independent of the head)."""
    draws: list[torch.Tensor] = []
    original = sketching.draw_gaussian_probes

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*args, **kwargs)
        draws.append(out.clone())
        return out

    monkeypatch.setattr(sketching, "draw_gaussian_probes", recording)
    gsm = GradSampleModuleRandomizedClipping(
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)),
        max_grad_norm=1.0,
        sketch="hutch++",
        sketch_dim=3,
    )
    x = torch.randn(5, 6, 4)
    for _ in range(2):
        gsm(x).pow(2).sum().backward()
        gsm.get_clipping_coef()
    assert len(draws) == 8  # 2 steps x 2 layers x (head, tail)
    flat = torch.cat([d.reshape(5, -1) for d in draws])  # one row per (draw, sample)
    assert torch.cdist(flat, flat).add(torch.eye(len(flat))).min() > 0


class _FakeCSPRNG(types.ModuleType):
    """Stand-in for torchcsprng (not installable here): a generator seeded from ``secrets``."""

    def __init__(self) -> None:
        super().__init__("torchcsprng")

    @staticmethod
    def create_random_device_generator(path: str) -> torch.Generator:
        return torch.Generator().manual_seed(secrets.randbits(63))


def test_secure_mode_secure_noise_and_sketch_reseeded_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """secure_mode=True: Opacus' secure noise (the 2n-Gaussian construction) from the engine's
    CSPRNG, a sketch generator that is not the CSPRNG and is reseeded from ``secrets`` after
    every step; passing a sketch generator is refused."""
    monkeypatch.setitem(sys.modules, "torchcsprng", _FakeCSPRNG())
    calls: list[bool] = []
    original = noise_module.generate_noise

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs["secure_mode"])
        return original(*args, **kwargs)

    # The one noise path of every randomized-clipping optimizer (opacus_rc/optimizers/noise.py).
    monkeypatch.setattr(noise_module, "generate_noise", recording)
    engine = PrivacyEngine(secure_mode=True)
    with pytest.raises(ValueError, match="sketch_generator is prohibited in secure mode"):
        make(engine, sketch_generator=torch.Generator())
    model, module, opt, crit, dp_loader = make(engine)
    assert opt.secure_mode and opt.generator is engine.secure_rng
    assert module.sketch_generator is not engine.secure_rng
    seeds = [module.sketch_generator.initial_seed()]
    for x, y in dp_loader:
        crit(module(x), y).backward()
        seeds.append(module.sketch_generator.initial_seed())
        opt.step()
        opt.zero_grad()
    assert len(set(seeds)) == len(seeds) == len(dp_loader) + 1
    assert calls and all(calls)


# --------------------------------------------------------------------------------------------
# Leftovers of the new-user test
# --------------------------------------------------------------------------------------------


def test_passed_sketch_generator_warns_once_at_the_callers_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A user-supplied ``sketch_generator`` used to give two warnings: a UserWarning from the
    module at construction (attributed to Opacus' privacy_engine.py) and a log WARNING from the
    accountant at the first step. Now one UserWarning, at the caller's line, says both facts
    (secret=False; accounted with the 'revealed' threat model); the accounting is unchanged."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, module, opt, crit, _ = flat_mlp.private(
            flat_mlp.FlatMLP(), sketch_generator=torch.Generator().manual_seed(3)
        )
    said = [w for w in caught if "sketch_generator" in str(w.message)]
    assert len(said) == 1
    assert said[0].filename == flat_mlp.__file__  # the line that calls make_private
    assert "'revealed' threat model" in str(said[0].message)
    caplog.clear()
    with caplog.at_level("WARNING"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = flat_mlp.batch()
        crit(module(x), y).backward()
        opt.step()
    assert "revealed" not in caplog.text
    assert not [w for w in caught if "sketch" in str(w.message)]
    assert engine.accountant.history[-1][3]["secret"] is False  # accounted as revealed


def test_runs_are_reproducible_with_seeded_generators_only() -> None:
    """meta-pytorch/opacus#692 (2024-12 comment): ghost clipping did not obey the random seed.
    With randomized clipping the probes come by default from a secret generator seeded by the
    OS (the "hidden" guarantee needs it), so two runs differ even with the same torch seed and
    noise generator. With a seeded ``sketch_generator`` as well (accounted as "revealed"), two
    runs give bit-identical parameters."""

    def run(seeded: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = flat_mlp.FlatMLP()
        model.forward = lambda x: model.lin2(torch.tanh(model.lin1(x))).mean(1)
        extra = {"sketch_generator": torch.Generator().manual_seed(5)} if seeded else {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="a sketch_generator was passed")
            engine, module, opt, crit, loader = flat_mlp.private(
                model, seq=True, noise_generator=torch.Generator().manual_seed(7), **extra
            )
        torch.manual_seed(1)  # Poisson sampling
        flat_mlp.train_all(module, opt, crit, loader)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    assert torch.equal(run(True), run(True))
    assert not torch.equal(run(False), run(False))
