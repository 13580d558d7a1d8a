"""The flat all-reduce buckets of the distributed optimizer (no process group needed)."""

from __future__ import annotations

import torch

from opacus_rc.optimizers.distributed_randomized_clip_optimizer import _buckets


def test_buckets_respect_cap_order_and_dtype() -> None:
    a, b, c = torch.zeros(10), torch.zeros(10), torch.zeros(30)  # 40, 40, 120 bytes
    d = torch.zeros(5, dtype=torch.float64)
    out = _buckets([a, d, b, c], cap_bytes=80)
    # float32: a and b fill one bucket (80 bytes); c exceeds the cap alone; float64 apart.
    assert [[id(t) for t in bucket] for bucket in out] == [[id(a), id(b)], [id(c)], [id(d)]]
    assert sum(len(bucket) for bucket in out) == 4
