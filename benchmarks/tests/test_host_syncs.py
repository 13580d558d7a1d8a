"""``benchmarks/host_syncs.py``: the counter counts what a host waits for, attributes it to the
right call site and phase, and the quick run writes consistent files."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

import opacus_rc
from benchmarks import host_syncs
from benchmarks.host_syncs import HostSyncCounter, is_library_site


def _ops(counter: HostSyncCounter) -> dict[str, int]:
    out: dict[str, int] = {}
    for (_phase, _kind, op, _site), n in counter.record.counts.items():
        out[op] = out.get(op, 0) + n
    return out


def test_scalar_reads_are_counted_once_each():
    t = torch.arange(6.0)
    with HostSyncCounter() as counter:
        u = t * 2 + 1  # no sync
        _ = u.sum()  # no sync
        t.sum().item()  # 1
        bool(t.any())  # 2
        float(t.max())  # 3
        if (t > 4).any():  # 4
            pass
    assert counter.record.total() == 4
    assert _ops(counter) == {"_local_scalar_dense": 4}


def test_equal_and_data_dependent_shapes_are_counted():
    t = torch.arange(6.0)
    with HostSyncCounter() as counter:
        torch.equal(t, t.clone())
        t.nonzero()
        t[t > 2]  # boolean-mask indexing: output size depends on the data
        t[torch.tensor([0, 1])]  # integer indexing: no sync
    kinds = {k for (_p, k, _o, _s) in counter.record.counts}
    assert counter.record.total() == 3
    assert kinds == {"scalar read", "data-dependent shape"}


def test_phases_and_uncounted_stretches():
    t = torch.ones(3)
    with HostSyncCounter() as counter:
        counter.phase = "forward"
        t.sum().item()
        counter.phase = None  # not counted
        t.sum().item()
        counter.phase = "step"
        bool(t.all())
        bool(t.all())
    assert counter.record.total(phase="forward") == 1
    assert counter.record.total(phase="step") == 2
    assert counter.record.total() == 3


def _library_functions():
    """Functions whose code lives (by file name) inside the opacus_rc package."""
    path = Path(opacus_rc.__file__).parent / "_sync_probe.py"
    source = "def read(t):\n    return t.sum().item()\n\n\ndef outer(t):\n    return read(t)\n"
    namespace: dict = {}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace["read"], namespace["outer"]


def test_call_sites_library_and_other():
    read, outer = _library_functions()
    t = torch.ones(2)
    with HostSyncCounter() as counter:
        read(t)
        outer(t)
        t.sum().item()  # this line: outside the libraries
    sites = sorted(s for (_p, _k, _o, s) in counter.record.counts)
    assert sites[0] == "opacus_rc/_sync_probe.py:2 (read)"  # called from here: no library caller
    assert sites[1] == "opacus_rc/_sync_probe.py:2 (read) <- opacus_rc/_sync_probe.py:6 (outer)"
    assert all(is_library_site(s) for s in sites[:2])
    assert sites[2].startswith("other: ") and "test_host_syncs.py" in sites[2]
    assert not is_library_site(sites[2])
    assert counter.record.total(library_only=True) == 2


@pytest.mark.filterwarnings("ignore")
def test_count_host_syncs_is_consistent():
    r = host_syncs.count_host_syncs(
        model="tiny-llama", layers=1, seq_len=8, batch_size=2, sketch_dim=4, steps=2, warmup=1
    )
    assert r.steps_agree
    assert set(r.per_phase) == set(host_syncs.PHASES)
    assert sum(r.per_phase.values()) == r.total == sum(r.per_site.values())
    assert sum(r.library_per_phase.values()) == r.library_total <= r.total
    for (phase, _kind, _op, site), _n in r.per_site.items():
        assert phase in host_syncs.PHASES
        if is_library_site(site):
            assert site.startswith(("opacus_rc/", "opacus/")), site


@pytest.mark.filterwarnings("ignore")
def test_quick_run_writes_files(tmp_path):
    assert host_syncs.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "host_syncs.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames == host_syncs.COLUMNS
        rows = list(reader)
    report = (tmp_path / "host_syncs.md").read_text()
    assert report.startswith("# Host synchronisations")
    total = sum(float(r["per_step"]) for r in rows)
    assert f"| **total** | {total:g} |" in report
    assert (tmp_path / "host_syncs.png").stat().st_size > 10_000


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("layers", [1, 3])
def test_library_host_syncs_do_not_grow_with_depth(layers):
    """Issue 12: at most 2 host synchronisations per randomized-clipping step in the library
    (the norms' finiteness decision in the backward, the gradients' at the step), whatever the
    number of blocks; before the step-protocol redesign it was 16 per block."""
    r = host_syncs.count_host_syncs(
        model="tiny-llama", layers=layers, seq_len=8, batch_size=2, sketch_dim=4, steps=1, warmup=1
    )
    assert r.library_total <= 2, r.per_site
