"""The distributed Poisson sampler: independent masks per rank (privacy) and reproducibility."""

from __future__ import annotations

from unittest import mock

import torch

from opacus_rc.data_loader import DistributedPoissonSampler

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
