"""Issue 20, round 3 (engine): the paths of ``PrivacyEngine.make_private`` inherited from Opacus.

Items 2 (the divisor and sampling rate from public inputs only, Opacus #819), 3 (a parameter
outside the model in the optimizer), 4 (a custom sampler replaced by Poisson sampling), 8 (an
``IterableDataset`` loader) and 10 (an empty Poisson batch on a Hugging Face model). Each test
fails on the code before its fix (the "before" column of tests/reliability/CATALOGUE.md,
section "Round 3 (engine)").
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from opacus.data_loader import DPDataLoader
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from opacus_rc.privacy_engine import PrivacyEngine

D, H, CLASSES = 6, 40, 5
B = 4
SIGMA, C = 1.0, 1.0

pytestmark = pytest.mark.filterwarnings("ignore:Secure RNG turned off")


def dataset(n: int, *, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, D, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    )


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(D, H)
        self.lin2 = nn.Linear(H, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))


def private(
    data_loader: DataLoader,
    *,
    model: nn.Module | None = None,
    clipping: str = "randomized",
    **kwargs: Any,
) -> tuple[PrivacyEngine, tuple[Any, ...]]:
    torch.manual_seed(0)
    model = MLP() if model is None else model
    engine = PrivacyEngine()
    options: dict[str, Any] = {"noise_multiplier": SIGMA, "max_grad_norm": C, "clipping": clipping}
    if clipping == "randomized":
        options["sketch_dim"] = 8
    options.update(kwargs)
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=data_loader,
        **options,
    )
    return engine, out


# ----------------------------------------------------------------------------------------------
# Item 2: every quantity of the mechanism from public inputs
# ----------------------------------------------------------------------------------------------


def mechanism(n: int, **kwargs: Any) -> dict[str, Any]:
    """The sampling rate, steps per epoch, divisor and the released noise of one noise-only step
    (seeded noise generator) of a randomized run on ``n`` records at batch size ``B``."""
    engine, (module, optimizer, _, loader) = private(
        DataLoader(dataset(n), batch_size=B),
        noise_generator=torch.Generator().manual_seed(3),
        **kwargs,
    )
    before = [p.detach().clone() for p in module.parameters()]
    optimizer.noise_only_step()  # lr = 1: the update is minus the released noisy mean
    noise = torch.cat([(b - p.detach()).flatten() for p, b in zip(module.parameters(), before)])
    ((_, rate, steps, *_),) = engine.accountant.history
    return {
        "sample_rate": loader.sample_rate,
        "accounted_rate": rate,
        "steps_per_epoch": len(loader),
        "divisor": optimizer.expected_batch_size,
        "noise": noise,
    }


@pytest.mark.parametrize(
    ("sizes", "kwargs"),
    [
        pytest.param((12, 11), {}, id="opacus#819-N12-vs-N11"),
        pytest.param((12, 13), {"dataset_size": 12}, id="public-dataset_size-N12-vs-N13"),
        pytest.param((12, 11), {"dataset_size": 12}, id="public-dataset_size-N12-vs-N11"),
    ],
)
def test_neighbouring_datasets_get_the_same_mechanism(
    sizes: tuple[int, int], kwargs: dict[str, Any]
) -> None:
    """Issue 20 item 2 (Opacus #819, #571): neighbours N = 12 and N = 11 at batch size 4 had
    the same q = 1/3 but divisors int(12/3) = 4 and int(11/3) = 3, so one release's noise sd
    differed by 4/3. Now the divisor is the loader's batch size, and with a public
    ``dataset_size`` the rate and the number of steps do not depend on len(dataset) either:
    both neighbours release bit-identical noise (same seed) whose sd is sigma C / B.

    Tolerance: the n = 6 * 40 + 40 + 40 * 5 + 5 = 485 coordinates are i.i.d. N(0, (sigma C /
    B)^2); the sample sd has relative standard error 1 / sqrt(2 n) = 0.032, so +-0.16 is a
    5-sigma band (a divisor 3 would give +0.33)."""
    a, b = (mechanism(n, **kwargs) for n in sizes)
    for key in ("sample_rate", "accounted_rate", "steps_per_epoch", "divisor"):
        assert a[key] == b[key], key
    assert a["divisor"] == B
    assert a["sample_rate"] == a["accounted_rate"] == pytest.approx(1 / 3, abs=0)
    assert a["steps_per_epoch"] == 3
    assert torch.equal(a["noise"], b["noise"])
    assert a["noise"].numel() == 485
    assert a["noise"].std().item() == pytest.approx(SIGMA * C / B, rel=0.16)


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
def test_divisor_is_the_loaders_batch_size_for_every_clipping(clipping: str) -> None:
    """Opacus' own clipping goes through the same seam: N = 11, B = 4 gave a divisor of 3."""
    for n in (11, 12, 13, 15):
        _, out = private(DataLoader(dataset(n), batch_size=B), clipping=clipping)
        assert out[1].expected_batch_size == B


def test_without_dataset_size_the_rate_is_opacus_rate() -> None:
    """Without ``dataset_size`` the rate stays Opacus' 1 / ceil(N / B) (documented: N is then
    treated as public): N = 13 gives q = 1/4 and 4 steps; with dataset_size=12 it is 1/3 and
    3 steps, on the same 13 records."""
    plain = mechanism(13)
    assert (plain["sample_rate"], plain["steps_per_epoch"]) == (0.25, 4)
    public = mechanism(13, dataset_size=12)
    assert (public["sample_rate"], public["steps_per_epoch"]) == (1 / 3, 3)
    drop_last = private(DataLoader(dataset(13), batch_size=B, drop_last=True), dataset_size=14)
    assert drop_last[1][3].sample_rate == 1 / 3  # floor(14 / 4) = 3 batches


def test_loader_without_batch_size_divides_by_the_public_expected_size() -> None:
    """An Opacus ``DPDataLoader`` (no ``batch_size``): the divisor is int(N' q) with the public
    N' = dataset_size; the rate is the loader's (1 / int(1 / q))."""
    loader = DPDataLoader(dataset(13), sample_rate=0.25)
    _, out = private(loader, dataset_size=20)
    assert out[1].expected_batch_size == 5
    assert out[3].sample_rate == 0.25


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset_size": 0}, "dataset_size must be an integer >= 1"),
        ({"dataset_size": 12.0}, "dataset_size must be an integer >= 1"),
        ({"dataset_size": True}, "dataset_size must be an integer >= 1"),
        ({"dataset_size": 12, "poisson_sampling": False}, "needs poisson_sampling=True"),
    ],
)
def test_invalid_dataset_size_is_refused(kwargs: dict[str, Any], match: str) -> None:
    model = MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(ValueError, match=match):
            private(DataLoader(dataset(12), batch_size=B), model=model, **kwargs)
    assert not hasattr(model, "autograd_grad_sample_hooks")


def test_noise_search_uses_the_public_rate() -> None:
    """make_private_with_epsilon searches at the rate that is accounted (q = 1/3 with
    dataset_size=12 on 13 records, not Opacus' 1/4)."""
    torch.manual_seed(0)
    model = MLP()
    engine = PrivacyEngine()
    _, optimizer, _, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(dataset(13), batch_size=B),
        target_epsilon=8.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=C,
        clipping="randomized",
        sketch_dim=8,
        dataset_size=12,
    )
    for _ in range(len(loader)):
        optimizer.noise_only_step()
    assert len(loader) == 3
    assert engine.accountant.history[0][1] == 1 / 3
    assert engine.get_epsilon(1e-5) == pytest.approx(8.0, rel=0.02)


@pytest.mark.parametrize(
    ("clipping", "accountant"), [("randomized", "rc"), ("flat", "prv")], ids=["rc", "flat-prv"]
)
def test_target_epsilon_holds_when_an_epoch_is_one_step_short(
    clipping: str, accountant: str
) -> None:
    """N = 93 at batch size 1: q = 1/93, but a Poisson loader has int(1 / q) = 92 batches (in
    floating point 1 / (1/93) < 93) and Opacus accounts each at 1 / len(loader) = 1/92.
    Searched at q = 1/93 over int(1 / q) steps, one epoch ended at epsilon 4.018 for a target
    of 4; the search now uses the accounted rate and the loader's steps. The noise search stops
    within its tolerance 0.01 below the target, so epsilon is in [3.96, 4]."""
    torch.manual_seed(0)
    model = MLP()
    engine = PrivacyEngine(accountant=accountant)
    made = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(dataset(93), batch_size=1),
        target_epsilon=4.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=C,
        clipping=clipping,
        **({"sketch_dim": 8} if clipping == "randomized" else {}),
    )
    optimizer, loader = made[1], made[-1]  # flat clipping returns no criterion
    assert len(loader) == 92
    for _ in range(len(loader)):
        if clipping == "randomized":
            optimizer.noise_only_step()
        else:
            engine.accountant.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=1 / 92)
    assert sum(entry[2] for entry in engine.accountant.history) == 92
    assert engine.accountant.history[0][1] == 1 / 92
    assert 3.96 <= engine.get_epsilon(1e-5) <= 4.0


@pytest.mark.parametrize("clipping", ["randomized", "flat"])
def test_a_noise_multiplier_below_the_accountants_range_is_refused_at_make_private(
    clipping: str,
) -> None:
    """A new user's report: noise_multiplier = 0.005 with the RC accountant trained, then
    ``get_epsilon`` raised after the run (the accountant records it but computes no epsilon
    below 0.01). Now refused at make_private, before any hook, naming the range; 0.01 is
    accepted."""
    engine = PrivacyEngine()  # the RC accountant, for both clippings
    model = MLP()
    with pytest.raises(ValueError, match=r"noise_multiplier=0.005 .* must be >= 0.01 \(or 0"):
        engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(dataset(12), batch_size=B),
            noise_multiplier=0.005,
            max_grad_norm=C,
            clipping=clipping,
        )
    assert not hasattr(model, "autograd_grad_sample_hooks")
    private(DataLoader(dataset(12), batch_size=B), clipping=clipping, noise_multiplier=0.01)


# ----------------------------------------------------------------------------------------------
# Item 3: a parameter outside the model in the optimizer
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bookkeeping", [True, False, "always"])
def test_parameter_outside_the_model_is_refused(bookkeeping: bool | str) -> None:
    """Issue 20 item 3: a learnable temperature added with ``add_param_group`` after
    make_private. With book-keeping its gradient was silently dropped and the step accounted;
    with two passes it was refused (``StepProtocolError ... ['<unnamed>']``). Now both refuse
    at ``add_param_group``, naming the group and position; a group slipped into
    ``param_groups`` directly is refused at ``step()``, before anything is noised or
    accounted."""
    engine, (module, optimizer, criterion, _) = private(
        DataLoader(dataset(12), batch_size=B), bookkeeping=bookkeeping
    )
    temperature = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\] \(shape \(\)\)"):
        optimizer.add_param_group({"params": [temperature]})
    assert len(optimizer.param_groups) == 1

    optimizer.original_optimizer.param_groups.append(
        {**optimizer.param_groups[0], "params": [temperature]}
    )
    x, y = dataset(B, seed=1).tensors
    before = [p.detach().clone() for p in module.parameters()]
    criterion(module(x) / temperature, y).backward()
    with pytest.raises(RuntimeError, match="not parameters of the private model"):
        optimizer.step()
    assert engine.accountant.history == []
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))


def test_parameter_of_the_model_in_a_new_group_is_accepted() -> None:
    """A group of the model's own parameters (e.g. another learning rate) is not refused."""
    model = MLP()
    engine = PrivacyEngine()
    module, optimizer, criterion, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.lin1.parameters(), lr=1.0),
        data_loader=DataLoader(dataset(12), batch_size=B),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        clipping="randomized",
        sketch_dim=8,
    )
    optimizer.add_param_group({"params": list(model.lin2.parameters()), "lr": 0.1})
    x, y = dataset(B, seed=1).tensors
    criterion(module(x), y).backward()
    optimizer.step()
    assert len(engine.accountant.history) == 1


# ----------------------------------------------------------------------------------------------
# Item 4: a custom sampler replaced by Poisson sampling
# ----------------------------------------------------------------------------------------------


class EveryOtherBatch(BatchSampler):
    """Not a ``torch.utils.data.BatchSampler`` subclass in behaviour: a custom batch sampler."""


class PairsSampler:
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter([[i, i + 1] for i in range(0, self.n - 1, 2)])

    def __len__(self) -> int:
        return self.n // 2


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
@pytest.mark.parametrize(
    ("make_loader", "name"),
    [
        (
            lambda ds: DataLoader(
                ds, batch_size=B, sampler=WeightedRandomSampler(torch.arange(1.0, 13.0), 12)
            ),
            "sampler WeightedRandomSampler",
        ),
        (lambda ds: DataLoader(ds, batch_sampler=PairsSampler(12)), "batch_sampler PairsSampler"),
    ],
)
def test_custom_sampler_replaced_by_poisson_sampling_warns(
    make_loader: Any, name: str, clipping: str
) -> None:
    """Issue 20 item 4: a ``WeightedRandomSampler`` (or a custom batch sampler) was replaced
    by uniform Poisson sampling without a word. Now a ``UserWarning`` at the caller's line says
    which, why, and what to do; the replacement (the accounted Poisson sampler) is unchanged.
    (The batch sampler gives no batch_size: its divisor comes from the public dataset_size,
    issue 30.)"""
    with pytest.warns(UserWarning, match=f"data loader's {name} is replaced by Poisson") as rec:
        _, out = private(make_loader(dataset(12)), clipping=clipping, dataset_size=12)
    assert {w.filename for w in rec if "replaced by Poisson" in str(w.message)} == {__file__}
    assert type(out[-1]).__name__ == "DPDataLoader"


@pytest.mark.parametrize(
    "make_loader",
    [
        lambda ds: DataLoader(ds, batch_size=B),
        lambda ds: DataLoader(ds, batch_size=B, shuffle=True),
        lambda ds: DataLoader(ds, batch_size=B, sampler=SequentialSampler(ds)),
        lambda ds: DPDataLoader(ds, sample_rate=1 / 3),
    ],
    ids=["sequential", "shuffle", "explicit-sequential", "dp-data-loader"],
)
def test_uniform_samplers_do_not_warn(make_loader: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        private(make_loader(dataset(12)), dataset_size=12)  # public: the DPDataLoader's divisor


# ----------------------------------------------------------------------------------------------
# Item 8: an IterableDataset loader
# ----------------------------------------------------------------------------------------------


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        yield from zip(*dataset(12).tensors)


class NoLen(torch.utils.data.Dataset):
    def __getitem__(self, i: int) -> Any:
        return dataset(12)[i]


@pytest.mark.parametrize("clipping", ["flat", "randomized"])
@pytest.mark.parametrize("poisson_sampling", [True, False])
def test_iterable_dataset_is_refused_with_the_reason(clipping: str, poisson_sampling: bool) -> None:
    """Issue 20 item 8: ``TypeError: object of type 'Stream' has no len()`` (randomized) or
    Opacus' ``Uniform sampling is not supported for IterableDataset``. Now a ``ValueError``
    before any hook: Poisson sampling needs a map-style dataset of known size."""
    model = MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(
            ValueError, match="IterableDataset \\(Stream\\).*map-style dataset of known size"
        ):
            private(
                DataLoader(Stream(), batch_size=B),
                model=model,
                clipping=clipping,
                poisson_sampling=poisson_sampling,
            )
    assert not hasattr(model, "autograd_grad_sample_hooks")


def test_dataset_without_len_is_refused() -> None:
    with pytest.raises(ValueError, match="has no len\\(\\).*known size"):
        private(DataLoader(NoLen(), batch_size=B))


# ----------------------------------------------------------------------------------------------
# Item 10: an empty Poisson batch on a Hugging Face model
# ----------------------------------------------------------------------------------------------


def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def test_empty_poisson_batch_on_an_hf_model_says_what_to_do() -> None:
    """Issue 20 item 10: an empty Poisson batch crashed inside the model (``cannot reshape
    tensor of 0 elements``). Now the error says it was an empty batch and names
    ``optimizer.noise_only_step()`` and ``rand_on_empty=True``; the original error is its
    cause, nothing recorded is left behind, and the noise-only step is then noised and
    accounted."""
    model = tiny_llama()
    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(0))
    engine = PrivacyEngine()
    module, optimizer, _, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(ids, ids), batch_size=2),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        clipping="randomized",
        sketch_dim=4,
    )
    empty = ids[:0]
    with pytest.raises(RuntimeError, match="empty batch") as info:
        module(input_ids=empty, attention_mask=torch.ones_like(empty))
    message = str(info.value)
    assert "optimizer.noise_only_step()" in message and "rand_on_empty=True" in message
    assert info.value.__cause__ is not None
    optimizer.noise_only_step()
    assert len(engine.accountant.history) == 1


# ----------------------------------------------------------------------------------------------
# Item 12: checkpoint weights for the plain model
# ----------------------------------------------------------------------------------------------


def test_checkpoint_weights_load_into_the_plain_model(tmp_path: Any) -> None:
    """Issue 20 item 12: the checkpoint's ``module_state_dict`` keys carry ``_module.``, so
    ``plain.load_state_dict(...)`` raised ``Missing key(s) in state_dict: "lin1.weight", ...``.
    ``unwrap_state_dict`` gives the plain model's keys: loaded strictly, the weights and the
    outputs equal the trained private model's."""
    from opacus_rc import unwrap_state_dict

    engine, (module, optimizer, criterion, loader) = private(DataLoader(dataset(12), batch_size=B))
    for x, y in loader:
        if len(y):
            criterion(module(x), y).backward()
            optimizer.step()
        else:
            optimizer.noise_only_step()
        optimizer.zero_grad()
    path = tmp_path / "run.ckpt"
    engine.save_checkpoint(path=path, module=module, optimizer=optimizer)
    saved = torch.load(path, weights_only=True)["module_state_dict"]
    assert all(key.startswith("_module.") for key in saved)

    plain = MLP()
    with pytest.raises(RuntimeError, match="Missing key"):
        plain.load_state_dict(saved)
    plain.load_state_dict(unwrap_state_dict(saved))  # strict
    trained = dict(module._module.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(p, trained[name]), name
    x = dataset(3, seed=5).tensors[0]
    assert torch.equal(plain(x), module(x))
    assert list(unwrap_state_dict(plain.state_dict())) == list(plain.state_dict())


def test_unwrap_state_dict_refuses_a_mixed_state_dict() -> None:
    from opacus_rc import unwrap_state_dict

    state = {"_module.lin1.weight": torch.zeros(1), "lin2.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="only some keys carry the '_module.' prefix"):
        unwrap_state_dict(state)
    twice = {"_module._module.lin1.weight": torch.zeros(1)}
    assert list(unwrap_state_dict(twice)) == ["lin1.weight"]
