"""The neighbouring-dataset harness on the distributed paths (issue 30, item 1): 2 CPU processes,
gloo (tests/privacy/neighbouring_worker.py, one ``torchrun`` launch for every case).

Each path runs the same first step on D and on D with its last record (unit) removed, same
seeds, and the test compares the two:

* the mechanism is identical: accounted sampling rate, steps of an epoch, divisor of the noisy
  sum (per rank and global), and the noise sd measured on a trainable parameter whose gradient
  is exactly zero (its update is noise / divisor, sd ``sigma C / divisor``), with and without
  a public ``dataset_size=`` where the path has one;
* at sigma = 0 the released noisy sums (the all-reduced gradient times the global divisor)
  differ by at most C (the sketch's error at large k derived below), by more than 0 when the
  removed record was sampled, and the two runs' batches differ by the removed record only.

Paths: the engine under torch DDP and under FSDP2 (per record, Poisson; under FSDP2 also a
tied Llama, every weight trainable, issue 35), the engine with a
``DistributedUnitDataLoader`` under DDP (units), and ``DPTrainer`` under DDP (the launch) and
under FSDP2 (``fsdp_config={"fsdp_version": 2}``, a second launch).
The unit loader without a public size takes its divisor from the private number of units
(12 units: 3, 11 units: 2; noise sd ratio 1.5): an expected failure until issue 30's item 3.

``fixed_batches`` (issue 30, Opacus PR #745): a ``DistributedSampler`` loader of per-rank batch
4 under DDP, with ``poisson_sampling=False`` and with Poisson sampling, divides the clipped
sum by the global batch 8 (the single-process oracle's update), not by 4.

Run with ``-s`` to see the per-path numbers (a Markdown table) for the closing note.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.privacy.neighbouring import sensitivity_bound  # noqa: E402

WORKER = Path(__file__).with_name("neighbouring_worker.py")
C_RECORDS, C_UNITS, C_TRAINER, C_LM = 0.5, 7.0, 1.5, 0.1  # the worker's clipping bounds
C_TRAINER_FSDP = 0.05  # the worker's bound on the DPTrainer FSDP2 path
K_UNITS = 4096  # the worker's sketch dimension on the unit path (exact norms elsewhere)
K_LM = 4096  # and on the tied Llama's (every record clipped: a bound per pair, below)

#: case -> (C, public global divisor or None (no public number), relative slack on C).
#:
#: Exact norms (records: rank-2 inputs of Linear layers; the Trainer: GPT-2 with exact
#: per-example norms): the bound is C up to float32 rounding, 1e-5.
#:
#: Sketched norms (units, k = 4096): Hutchinson's estimate of ``n^2 = ||g||^2`` with k Gaussian
#: probes has relative variance ``2 sum s_i^4 / (k (sum s_i^2)^2) <= 2 / k``, so ``n_hat / n``
#: has relative sd <= ``sqrt(2 / k) / 2 = 0.011``; at five sd, ``n_hat >= n (1 - eps)`` with
#: ``eps = 5 sqrt(2 / k) / 2 = 0.055``. The worker's data make the removed unit's norm (11.3)
#: larger than C = 7 and every other unit's (<= 4.0) smaller (asserted below), so the others'
#: clip factors are 1 in both runs and the difference is the removed unit's clipped gradient,
#: ``min(1, C / n_hat) n <= C / (1 - eps)``.
EPS_UNITS = 5 * math.sqrt(2 / K_UNITS) / 2
CASES: dict[str, tuple[float, float | None, float]] = {
    "ddp-records-nosize": (C_RECORDS, 8.0, 1e-5),
    "ddp-records-size": (C_RECORDS, 8.0, 1e-5),
    "fsdp2-records-nosize": (C_RECORDS, 8.0, 1e-5),
    "fsdp2-records-size": (C_RECORDS, 8.0, 1e-5),
    "ddp-units-size": (C_UNITS, 3.0, 1 / (1 - EPS_UNITS) - 1),  # int(12 units * 0.25)
    "trainer-ddp": (C_TRAINER, 8.0, 1e-5),  # PrivacyArguments.expected_batch_size
    "trainer-packed-ddp": (C_TRAINER, 8.0, 1e-5),  # the same with a PackingCollator (issue 32)
    "trainer-fsdp2": (C_TRAINER_FSDP, 8.0, 1e-5),  # exact norms (the input embedding)
    # Sketched, every record clipped: the bound of neighbouring.sensitivity_bound, per pair
    # (SKETCHED_CLIPPED); the slack here is unused.
    "fsdp2-tied-llama-nosize": (C_LM, 8.0, 0.0),
    "fsdp2-tied-llama-size": (C_LM, 8.0, 0.0),
}
#: Cases whose norms are sketched (k) with every sampled record clipped: a record present in
#: both runs draws other probes in each, so the bound is
#: tests/privacy/neighbouring.py::sensitivity_bound with the pair's other records.
SKETCHED_CLIPPED: dict[str, int] = {
    "fsdp2-tied-llama-nosize": K_LM,
    "fsdp2-tied-llama-size": K_LM,
}
XFAIL_MECHANISM: dict[str, str] = {}


def _sd_tolerance(n: int) -> float:
    """Five standard deviations of the sample sd's relative error over ``n`` N(0, s^2) values.

    ``(n - 1) s_hat^2 / s^2`` is chi-square with ``n - 1`` degrees of freedom, so
    ``s_hat^2 / s^2`` has variance ``2 / (n - 1)`` and ``s_hat / s`` (delta method) has sd
    ``1 / sqrt(2 (n - 1))``: 0.016 for the 2000 coordinates of the worker's zero-gradient
    layer (tolerance 0.079), 0.040 for the Trainer's 320 unused position rows (0.198). A
    divisor off by the issue's ratio 1.5 is far outside either.
    """
    return 5 / math.sqrt(2 * (n - 1))


@pytest.fixture(scope="session")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The worker's numbers, from one ``torchrun --nproc-per-node 2`` launch."""
    out = tmp_path_factory.mktemp("neighbouring")
    root = str(Path(__file__).resolve().parents[2])  # the checkout under test
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(WORKER), str(out)],
        capture_output=True, text=True, timeout=400, env=env, cwd=out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "results.json").read_text())
    # DPTrainer under FSDP2: a launch of its own (the first launch's cases as they were).
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(WORKER), str(out), "trainer-fsdp2"],
        capture_output=True, text=True, timeout=400, env=env, cwd=out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res.update(json.loads((out / "results_trainer_fsdp2.json").read_text()))
    print("\n" + report(res))
    return res


def report(res: dict[str, Any]) -> str:
    """A Markdown table of the per-path numbers (D / D-1) for the closing note."""
    lines = [
        "| path | q | steps/epoch | divisor global (per rank) | noise sd (sigma C / divisor) "
        "| max ||delta release|| / C | removed sampled |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, (c, _, _) in CASES.items():
        d, d1 = res[case]["D"], res[case]["D-1"]
        ratio = max(p["delta_norm"] for p in res[case]["pairs"]) / c
        sampled = any(p["removed_sampled"] for p in res[case]["pairs"])

        def both(key: str, fmt: str = "{}", d: dict = d, d1: dict = d1) -> str:
            return f"{fmt.format(d[key])} / {fmt.format(d1[key])}"

        lines.append(
            f"| {case} | {both('sample_rate', '{:.4g}')} | {both('steps_per_epoch')} | "
            f"{d['divisor_global']:g} ({d['divisor_rank']:g}) / "
            f"{d1['divisor_global']:g} ({d1['divisor_rank']:g}) | "
            f"{both('dead_sd', '{:.4f}')} ({1.0 * c / d['divisor_global']:.4f} / "
            f"{1.0 * c / d1['divisor_global']:.4f}) | {ratio:.4f} | {sampled} |"
        )
    fixed = res["fixed_batches"]
    lines.append("")
    lines.append(
        "| DDP, DistributedSampler batch 4 per rank | divisor per rank | update / oracle |"
    )
    lines.append("|---|---|---|")
    for name, r in fixed.items():
        lines.append(f"| {name} | {r['divisor_rank']:g} | {r['update_over_oracle']:.6f} |")
    return "\n".join(lines)


def _case_params(xfail: dict[str, str]) -> list[Any]:
    return [
        pytest.param(
            case,
            id=case,
            marks=[pytest.mark.xfail(strict=True, reason=xfail[case])] if case in xfail else [],
        )
        for case in CASES
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", _case_params(XFAIL_MECHANISM))
def test_mechanism_is_identical_on_neighbours(results: dict[str, Any], case: str) -> None:
    """Rate, steps, divisor and noise sd: the same on D and D-1, and the sd is sigma C / divisor
    (sigma = 1) on each, the divisor the public one where the path has one."""
    c, public, _ = CASES[case]
    d, d1 = results[case]["D"], results[case]["D-1"]
    for key in ("sample_rate", "steps_per_epoch", "accounted_steps", "divisor_rank"):
        assert d[key] == d1[key], f"{key}: D {d[key]} vs D-1 {d1[key]}"
    assert d["divisor_global"] == d1["divisor_global"] == 2 * d["divisor_rank"]
    if public is not None:
        assert d["divisor_global"] == public
    for run in (d, d1):
        expected = 1.0 * c / run["divisor_global"]
        tol = _sd_tolerance(run["dead_coords"])
        assert abs(run["dead_sd"] / expected - 1) < tol, (run["dead_sd"], expected, tol)
    # The noise of D and D-1 (drawn independently or not) has the same sd.
    tol_ratio = math.sqrt(2) * _sd_tolerance(d["dead_coords"])
    assert abs(d["dead_sd"] / d1["dead_sd"] - 1) < tol_ratio, (d["dead_sd"], d1["dead_sd"])


@pytest.mark.slow
@pytest.mark.parametrize("case", _case_params({}))
def test_release_moves_by_at_most_c_on_neighbours(results: dict[str, Any], case: str) -> None:
    """sigma = 0: the released sums of D and D-1 differ by at most C (plus the derived slack),
    by more than 0 when the removed record was sampled; the batches differ by that record."""
    c, _, slack = CASES[case]
    pairs = results[case]["pairs"]
    assert any(p["removed_sampled"] for p in pairs), "no seed sampled the removed record"
    for p in pairs:
        a, b = p["D"], p["D-1"]
        if case.startswith("trainer-"):  # counts of examples over both ranks
            assert a["batch"] - b["batch"] == int(p["removed_sampled"]), p
        else:
            removed = max(a["batch"] + b["batch"] + [-1]) if p["removed_sampled"] else None
            assert [i for i in a["batch"] if i != removed] == b["batch"], p
        if case in SKETCHED_CLIPPED:
            bound = sensitivity_bound(
                max_grad_norm=c, sketch_dim=SKETCHED_CLIPPED[case], others=len(b["batch"])
            )
            # both modules of the tied weight took the joint sketch
            assert a["tied_routes"] == ["lm.lm_head", "lm.model.embed_tokens"], a
        else:
            bound = c * (1 + slack)
        assert p["delta_norm"] <= bound, (p["seed"], p["delta_norm"] / c)
        if p["removed_sampled"]:
            assert p["delta_norm"] > 0.1 * c, p["delta_norm"] / c
            if case.startswith("ddp-units"):
                # The premise of the slack (CASES): only the removed unit is clipped.
                assert a["norm_of_removed"] > c, a
                assert max(a["max_norm_of_others"], b["max_norm_of_others"]) < c, (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["poisson_false", "poisson_true"])
def test_distributed_sampler_loader_divides_by_the_global_batch(
    results: dict[str, Any], name: str
) -> None:
    """DDP with a ``DistributedSampler`` loader of batch 4 per rank (Opacus PR #745's set-up),
    sigma = 0: the update is the single-process clipped sum of both ranks' records over the
    global batch 8 (a float64 oracle, each record's gradient computed alone), not over 4."""
    r = results["fixed_batches"][name]
    assert r["batch"] and r["clipped"] >= 1, r
    assert r["divisor_rank"] == 4.0, r
    assert abs(r["update_over_oracle"] - 1) < 1e-5, r
    assert r["max_abs_diff"] < 1e-6, r
    # The accounted rate is the global one, 8 / 40 records, 5 steps an epoch.
    assert r["accounted_rate"] == 0.2 and r["steps_per_epoch"] == 5, r


def test_public_sizes_count_per_rank_batches_globally() -> None:
    """``public_sizes`` in a 2-process run, from public inputs only (no process group needed):
    a ``DistributedSampler`` loader's batch 4 is per rank, so the global batch (the divisor
    before the engine's division by the world size) is 8 and the rate 8 / 40, with or without
    a public ``dataset_size`` (40, also on the neighbour of 39 records); a loader used as it is
    (``poisson_sampling=False``) is per rank too; a plain loader that Poisson sampling shards
    keeps its batch as the global one, and one process is unchanged."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from opacus_rc.engine.schedule import PublicSizes, public_sizes

    def loader(n: int, *, sharded: bool) -> DataLoader:
        ds = TensorDataset(torch.zeros(n, 1))
        sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False) if sharded else None
        return DataLoader(ds, batch_size=4, sampler=sampler)

    def sizes(q: float, divisor: int, steps: int, world_size: int) -> PublicSizes:
        # Poisson or per-rank batches alike: every step accounted at 1 / steps = q here.
        return PublicSizes(q, divisor, 1 / steps, steps, "record", world_size)

    for n in (40, 39):
        for size in (None, 40):
            got = public_sizes(loader(n, sharded=True), dataset_size=size, world_size=2)
            assert got == sizes(0.2, 8, 5, 2), (n, size, got)
            assert got.divisor == 4.0  # each of the two processes divides its share
    fixed = public_sizes(
        loader(40, sharded=True), dataset_size=None, world_size=2, poisson_sampling=False
    )
    assert fixed == sizes(0.2, 8, 5, 2)
    assert public_sizes(loader(40, sharded=False), dataset_size=None, world_size=2) == (
        sizes(0.1, 4, 10, 2)
    )
    assert public_sizes(loader(40, sharded=True), dataset_size=40) == sizes(0.1, 4, 10, 1)


@pytest.mark.slow
def test_unit_loader_without_a_public_size_is_refused_on_neighbours(
    results: dict[str, Any],
) -> None:
    """DistributedUnitDataLoader without expected_batch_size or dataset_size: refused on D and
    D-1 (before issue 30 the divisor was int(num_units * q): 3 vs 2, the noise sd 1.5x)."""
    refusals = results["ddp-units-nosize-refusals"]
    assert len(refusals) == 2
    for message in refusals:
        assert message is not None and "Opacus #819" in message


@pytest.mark.slow
def test_plain_loader_without_poisson_sampling_is_refused_under_ddp(
    results: dict[str, Any],
) -> None:
    """poisson_sampling=False with a plain DataLoader under DDP: each rank would iterate the whole
    dataset, a record entering the step's sum once per rank (2 C where C is accounted);
    refused, naming DistributedSampler."""
    message = results["plain-loader-poisson-false"]
    assert message is not None and "DistributedSampler" in message and "2 times" in message
