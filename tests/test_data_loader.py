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
