"""The distributed Poisson sampler: independent masks per rank (privacy) and reproducibility."""

from __future__ import annotations

from unittest import mock

import torch
from torch import nn
from torch.utils.data import DataLoader

from opacus_rc.data_loader import DistributedPoissonSampler
from opacus_rc.privacy_engine import PrivacyEngine
from tests import flat_mlp

N, Q = 20_000, 0.5


def masks(rank: int, seed: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """This rank's first two batches, as 0/1 masks over its local positions, after seeding the
    global RNG with ``seed`` (as every rank of a run seeded alike does)."""
    torch.manual_seed(seed)
    with (
        mock.patch("torch.distributed.get_world_size", return_value=2),
        mock.patch("torch.distributed.get_rank", return_value=rank),
    ):
        sampler = DistributedPoissonSampler(
            total_size=2 * N, sample_rate=Q, shuffle=False, generator=generator
        )
    out = []
    for batch in list(iter(sampler))[:2]:
        m = torch.zeros(N)
        m[(batch - rank) // 2] = 1.0  # local position of each sampled global index
        out.append(m)
    return torch.stack(out)


def test_ranks_seeded_alike_draw_independent_masks() -> None:
    """Opacus' sampler gives both ranks the same mask (agreement 1.0). Independent
    Bernoulli(1/2) masks agree on a position with probability 1/2; over 2N = 40,000 positions
    the agreement fraction has standard deviation sqrt(1/4 / 40000) = 0.0025, so |agree - 1/2|
    < 0.02 is an 8-sigma bound."""
    a, b = masks(0, seed=0), masks(1, seed=0)
    agree = (a == b).float().mean().item()
    assert abs(agree - 0.5) < 0.02, agree
    # Each mask is still Bernoulli(q): mean within 8 sigma (sqrt(q(1-q)/2N) = 0.0025).
    assert abs(a.mean().item() - Q) < 0.02 and abs(b.mean().item() - Q) < 0.02


def test_masks_are_reproducible_under_a_global_seed_and_differ_across_seeds() -> None:
    assert torch.equal(masks(1, seed=3), masks(1, seed=3))
    assert not torch.equal(masks(1, seed=3), masks(1, seed=4))


def test_a_passed_generator_is_used_as_given() -> None:
    a = masks(0, seed=0, generator=torch.Generator().manual_seed(5))
    b = masks(1, seed=9, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)  # the user's generator, unchanged (documented: must differ per rank)


def test_rand_on_empty_holds_from_the_first_batch_in_one_process() -> None:
    """Opacus' collate wrapper learns the batch layout from the first non-empty batch, so an
    empty *first* batch came back with B = 0 even with ``rand_on_empty=True`` (a model that
    cannot take B = 0 then crashed on the batch the flag was meant to replace). The engine's
    randomized path now uses :class:`RandomOnEmptyCollate`: a batch of one random input
    (data-independent, so the accounting is unchanged)."""
    import warnings

    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from opacus_rc import PrivacyEngine

    data = TensorDataset(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    model = nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, _, loader = PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=1),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
            rand_on_empty=True,
        )
    x, y = loader.collate_fn([])  # an empty Poisson batch before any non-empty one
    assert x.shape == (1, 3) and y.shape == (1,)
    assert bool(((x == 0) | (x == 1)).all())  # Opacus' random 0/1 input, not a record


class DictDataset(torch.utils.data.Dataset):
    """Records as dicts, as a Hugging Face dataset with a data collator gives them."""

    def __init__(self, n: int = 8) -> None:
        self.x, self.y = flat_mlp.data(n).tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def dict_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in ("x", "labels")}


class IntLabelDataset(torch.utils.data.Dataset):
    """Records ``(tensor, python int)``: labels that are not tensors."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return flat_mlp.data(8).tensors[0][i], int(i % flat_mlp.CLASSES)


def test_empty_poisson_batch_from_a_dict_collate_fn_is_a_noise_only_step() -> None:
    """meta-pytorch/opacus#806 (PR 812, 2026-03): with a collate_fn that returns a dict (Hugging
    Face collators), Opacus' empty Poisson batch used to be a list, so the training loop
    crashed on ``batch["input_ids"]``. With the installed Opacus and opacus_rc's engine every
    batch, empty ones included, is a dict with the right trailing shapes and dtypes, and every
    batch is one accounted step (the empty ones noise-only)."""
    torch.manual_seed(0)
    model = nn.Linear(flat_mlp.D, flat_mlp.CLASSES)
    engine = PrivacyEngine()
    module, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(DictDataset(), batch_size=1, collate_fn=dict_collate),
        noise_multiplier=1.0,
        max_grad_norm=flat_mlp.C,
        clipping="randomized",
    )
    shapes = set()
    empty = 0
    for _ in range(4):  # q = 1/8: P(no empty batch in 32 draws) = (1 - (7/8)^8)^32 < 1e-6
        for b in loader:
            assert isinstance(b, dict) and set(b) == {"x", "labels"}
            shapes.add((tuple(b["x"].shape[1:]), b["x"].dtype, b["labels"].dtype))
            empty += int(len(b["x"]) == 0)
            crit(module(b["x"]), b["labels"]).backward()
            opt.step()
            opt.zero_grad()
    assert empty > 0
    assert shapes == {((flat_mlp.D,), torch.float32, torch.int64)}
    assert len(engine.accountant) == 4 * len(loader)


def test_empty_poisson_batch_with_python_int_labels_is_a_noise_only_step() -> None:
    """meta-pytorch/opacus#743 (2025): records whose label is a python int made Opacus' empty
    batch fail with "zeros() received an invalid combination of arguments - got (tuple,
    dtype=type)". Here the empty batch has labels of shape (0,) and dtype int64 (as the
    non-empty ones after default_collate) and is an accounted noise-only step."""
    torch.manual_seed(0)
    model = nn.Linear(flat_mlp.D, flat_mlp.CLASSES)
    engine = PrivacyEngine()
    module, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
        data_loader=DataLoader(IntLabelDataset(), batch_size=1),
        noise_multiplier=1.0,
        max_grad_norm=flat_mlp.C,
        clipping="randomized",
    )
    empty_labels = []
    for _ in range(4):  # as above, an empty batch occurs with probability > 1 - 1e-6
        for x, y in loader:
            if len(x) == 0:
                empty_labels.append((tuple(y.shape), y.dtype))
            crit(module(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert empty_labels and set(empty_labels) == {((0,), torch.int64)}
    assert len(engine.accountant) == 4 * len(loader)
