"""Two-process edge cases of distributed randomized clipping (gloo, CPU), run by test_edge.py.

``python edge_worker.py OUT.json`` spawns 2 processes; each runs every scenario and asserts;
rank 0 writes a JSON summary (see test_edge.py for what each scenario checks).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from opacus.distributed import DifferentiallyPrivateDistributedDataParallel
from opacus.utils.fsdp_utils import FSDP2Wrapper
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from worker_common import WORLD, D, FlatMLP, SeqMLP, T, free_port, gather  # noqa: E402

from opacus_rc.grad_sample.private_step import StepProtocolError
from opacus_rc.privacy_engine import PrivacyEngine

H = 7


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
            for p in model.parameters()
        ]
    )


class NoEmptyMLP(FlatMLP):
    """A model that cannot take an empty batch (as an HF Llama cannot: its reshape fails)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            raise ValueError("B = 0")
        return super().forward(x)


def scenario_rand_on_empty(rank: int) -> dict[str, Any]:
    """DPDDP + the distributed loader with rand_on_empty=True: an empty Poisson batch, the
    rank's *first* included, becomes a random batch of size 1 (Opacus' single-process
    behaviour), so a model that cannot take B = 0 trains, and every step is accounted."""
    torch.manual_seed(0)
    model = DifferentiallyPrivateDistributedDataParallel(NoEmptyMLP(H))
    g = torch.Generator().manual_seed(1)
    # Real records are 3 N(0, 1) draws: never all in {0, 1}, as the random batch is.
    data = TensorDataset(3 * torch.randn(16, D, generator=g) + 0.5, torch.randint(0, 3, (16,)))
    engine = PrivacyEngine()
    module, opt, crit, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=1),  # q = 1/16: 8 records per rank
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        rand_on_empty=True,
    )
    sizes, randoms = [], []
    for step, (x, y) in enumerate(loader):
        sizes.append(len(x))
        randoms.append(int(bool(((x == 0) | (x == 1)).all())))
        crit(module(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 5:
            break
    assert min(sizes) >= 1, sizes
    rand = torch.stack(gather(torch.tensor(randoms)))  # (WORLD, steps)
    # With these seeds rank 0's or rank 1's first batch is empty (P = (15/16)^8 = 0.60 per
    # rank): the case Opacus' wrapper returns with B = 0 even with rand_on_empty=True.
    assert int(rand[:, 0].sum()) >= 1, rand
    ranks = gather(_params(module))
    assert torch.equal(ranks[0], ranks[1])
    assert len(engine.accountant) == len(sizes) == 6
    return {"first_batch_random": int(rand[:, 0].sum()), "random_batches": int(rand.sum())}


class ScaleNorm(nn.Module):
    """A trainable norm without any sampler (as HF's LlamaRMSNorm): functorch in one process."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.norm, self.lin2 = nn.Linear(D, H), ScaleNorm(H), nn.Linear(H, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.norm(self.lin1(x))).mean(1)


def _make_private_error(model: nn.Module) -> BaseException:
    data = TensorDataset(torch.randn(8, T, D), torch.randint(0, 3, (8,)))
    try:
        PrivacyEngine().make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=2),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            clipping="randomized",
        )
    except Exception as err:  # noqa: BLE001  (the type is asserted by the caller)
        assert not hasattr(model, "autograd_grad_sample_hooks")
        return err
    raise AssertionError("make_private accepted the model")


def scenario_norm_without_sampler(rank: int) -> dict[str, Any]:
    """A trainable module without a sampler under FSDP2 is refused, naming it, its type and
    what to do, both when FSDP2Wrapper left it unsharded and when it was sharded by hand
    (which reached Opacus' functorch deepcopy: a bare AssertionError from FSDP2)."""
    wrapped = FSDP2Wrapper(NormedMLP())
    by_hand = NormedMLP()
    for sub in (by_hand.lin1, by_hand.norm, by_hand.lin2):
        fully_shard(sub)
    by_hand = fully_shard(by_hand)
    out = {}
    for key, model in (("wrapper", wrapped), ("by_hand", by_hand)):
        err = _make_private_error(model)
        msg = str(err)
        assert type(err) is NotImplementedError, repr(err)
        assert "'norm'" in msg and "ScaleNorm" in msg and "Freeze" in msg, msg
        assert "register a grad sampler" in msg, msg
        out[key] = msg[:60]
    return out


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(11, D), nn.Linear(D, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))


def scenario_tied(rank: int) -> dict[str, Any]:
    """A tied embedding / LM head under FSDP2 in one group (``fully_shard([embed, head])``, as
    torch requires) is accepted since issue 35 (it was refused): both modules take the joint
    sketch, and a step leaves the ranks in sync with the tie intact
    (test_fsdp_llama.py checks the values against a float64 oracle)."""
    model = TiedLM()
    fully_shard([model.embed, model.head])
    model = fully_shard(model)
    engine = PrivacyEngine()
    data = TensorDataset(torch.randint(0, 11, (8, T)), torch.randint(0, 11, (8, T)))
    module, opt, crit, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=8,
    )
    routes = {n: r.path.value for n, r in module.norm_routes.items()}
    assert routes == {"embed": "tied", "head": "tied"}, routes
    x, y = data[rank * 4 : rank * 4 + 4]
    logits = module(x)
    crit(logits.reshape(-1, 11), y.reshape(-1), shape=logits.shape).backward()
    opt.step()
    ranks = gather(_params(module))
    assert torch.equal(ranks[0], ranks[1])
    assert model.head.weight is model.embed.weight
    return {"accepted": True}


def scenario_skip_forward(rank: int) -> dict[str, Any]:
    """FSDP2: a rank that calls step() without forward/backward (skipping its empty batch)
    raises at once instead of entering the step's all-reduce while the other rank waits in
    FSDP2's all-gather (a silent deadlock). Running the forward/backward of its empty batch
    then lets both ranks step in sync. ``noise_only_step()`` is refused likewise."""
    torch.manual_seed(5)
    model = FSDP2Wrapper(SeqMLP(H))
    data = TensorDataset(torch.randn(16, T, D), torch.randint(0, 3, (16,)))
    engine = PrivacyEngine()
    module, opt, crit, _ = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        clipping="randomized",
        sketch_dim=8,
    )
    x, y = data[rank * 4 : rank * 4 + 4]
    crit(module(x), y).backward()
    opt.step()
    opt.zero_grad()
    raised = ""
    if rank == 1:
        x, y = x[:0], y[:0]
        try:
            opt.step()  # skipped the forward
        except StepProtocolError as err:
            raised = str(err)
        assert "every rank must run forward and backward" in raised, raised
        try:  # the empty-batch step of one process is refused here too, for the same reason
            opt.noise_only_step()
            raised = ""
        except StepProtocolError as err:
            raised = str(err)
        assert "noise_only_step() is not available under FSDP2" in raised, raised
    crit(module(x), y).backward()
    opt.step()
    opt.zero_grad()
    ranks = gather(_params(module))
    assert torch.equal(ranks[0], ranks[1])
    assert len(engine.accountant) == 2
    return {"raised": bool(raised) or rank == 0}


def run(rank: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(WORLD)
    # A deadlock (the bug of scenario_skip_forward) fails after 30 s, not gloo's 30 min.
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    try:
        results = {
            "rand_on_empty": scenario_rand_on_empty(rank),
            "norm_without_sampler": scenario_norm_without_sampler(rank),
            "tied": scenario_tied(rank),
            "skip_forward": scenario_skip_forward(rank),
        }
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(free_port(), sys.argv[1]), nprocs=WORLD, join=True)
