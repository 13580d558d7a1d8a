"""DPTrainer with ``PrivacyArguments.privacy_unit``: unit-level DP-SGD through the Trainer.

The units (a column naming each row's document) are Poisson-sampled at ``q = 1 / ceil(U /
expected_batch_size)``, all rows of a sampled unit are in the step, micro-batches hold whole
units, and each unit's summed gradient is clipped once. Checked against a float64 oracle that
sums each unit's per-row gradients (computed alone, without padding), and against the accountant.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_helpers as th  # noqa: E402

from opacus_rc.integrations.logical_batches import UNITS_KEY  # noqa: E402
from opacus_rc.integrations.transformers import PrivacyArguments  # noqa: E402

DELTA = 1e-3
SGD = {"optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant", "weight_decay": 0.0}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message="PrivacyArguments.seed")


RecordingTrainer = th.recording_trainer()


def unit_rows(sizes: list[int], *, seed: int = 0) -> list[dict]:
    """Rows of ``len(sizes)`` documents (named ``"doc-u"``), document ``u`` with ``sizes[u]``
    rows; the rows of the documents are interleaved (the trainer groups them)."""
    rows = th.token_examples(sum(sizes), seed=seed)
    docs = [f"doc-{u}" for u, s in enumerate(sizes) for _ in range(s)]
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    return [{**rows[i], "doc": docs[i]} for i in order]


def make(tmp_path: Path, *, data: list[dict], privacy: dict, model: Any = None, **args: Any):
    p = {"target_delta": DELTA, "expected_batch_size": 4, "seed": 3, "privacy_unit": "doc"}
    p.update(privacy)
    return RecordingTrainer(
        model=th.tiny_gpt2_exact() if model is None else model,
        args=th.training_args(tmp_path, **args),
        train_dataset=data,
        data_collator=th.pad_collate,
        privacy_args=PrivacyArguments(**p),
    )


def unit_gradients(model: Any, micro: dict) -> list[list[torch.Tensor]]:
    """Float64 summed gradient of each unit of a micro-batch: the sum over its rows of each
    row's gradient of its mean next-token loss, each row computed alone (padding removed)."""
    ref = th.snapshot(model).double()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    units = micro[UNITS_KEY]
    out = []
    for u in range(int(units.max()) + 1):
        loss = 0.0
        for i in torch.nonzero(units == u).flatten().tolist():
            ids = micro["input_ids"][i][micro["attention_mask"][i].bool()].unsqueeze(0)
            logits = ref(input_ids=ids).logits[0, :-1]
            loss = loss + torch.nn.functional.cross_entropy(logits, ids[0, 1:])
        out.append(list(torch.autograd.grad(loss, trainable)))
    return out


def test_one_step_is_the_per_unit_clipped_sum(tmp_path: Path) -> None:
    """sigma = 0, lr = 1: the update is ``-sum_u min(1, C / (||g_u|| + 1e-6)) g_u / B_exp``
    over the sampled units (the engine's clip factor), ``g_u`` the float64 oracle's."""
    sizes = [1, 3, 2, 1, 3, 2, 1, 2, 3, 1, 2, 3]  # U = 12 units of 1-3 rows
    model = th.tiny_gpt2_exact()
    start = th.snapshot(model)
    C = 4.0
    tr = make(
        tmp_path,
        data=unit_rows(sizes),
        model=model,
        privacy={"noise_multiplier": 0.0, "max_grad_norm": C},
        max_steps=1,
        per_device_train_batch_size=4,
        **SGD,
    )
    tr.train()
    [batch] = tr.batches
    assert len(batch.micro_batches) > 1  # whole units packed into several micro-batches
    g = [gu for micro in batch.micro_batches for gu in unit_gradients(start, micro)]
    counts = [
        int((micro[UNITS_KEY] == u).sum())
        for micro in batch.micro_batches
        for u in range(int(micro[UNITS_KEY].max()) + 1)
    ]
    assert max(counts) > 1 and min(counts) == 1  # units of different sizes in the step
    norms = torch.stack([torch.sqrt(sum((x**2).sum() for x in gu)) for gu in g])
    assert (norms > C).sum() >= 1 and (norms < C).sum() >= 1  # clipping is active
    factors = torch.clamp(C / (norms + 1e-6), max=1.0)
    assert tr.dp_optimizer.expected_batch_size == 4  # units
    p0 = dict(start.named_parameters())
    after = dict(tr.model.named_parameters())
    names = [n for n, p in start.named_parameters() if p.requires_grad]
    for j, name in enumerate(names):
        expected = -sum(f * gu[j] for f, gu in zip(factors, g)) / 4
        got = (after[name].detach() - p0[name].detach()).double()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    # The module's per-unit norms of the last micro-batch are the oracle's (exact layers).
    last = int(batch.micro_batches[-1][UNITS_KEY].max()) + 1
    torch.testing.assert_close(
        tr.dp_module.per_sample_gradient_norms.double(), norms[-last:], rtol=1e-4, atol=1e-6
    )


def test_units_are_sampled_and_accounted_at_the_unit_rate(tmp_path: Path) -> None:
    """U = 40 units, expected_batch_size = 8: q = 8 / 40 = 1 / 5 in the sampler and the
    accountant, epsilon within 1% below the target, and every sampled unit whole."""
    sizes = [1 + (u % 3) for u in range(40)]  # 80 rows
    data = unit_rows(sizes, seed=1)
    tr = make(
        tmp_path,
        data=data,
        model=th.tiny_llama(),
        privacy={"target_epsilon": 4.0, "expected_batch_size": 8},
        max_steps=6,
        per_device_train_batch_size=4,
    )
    tr.train()
    [(sigma, q, n, _spec)] = tr.privacy_engine.accountant.history
    assert q == 8 / 40 and n == 6 and sigma == tr.dp_optimizer.noise_multiplier
    assert tr._poisson_sampler.sample_rate == 8 / 40 and tr._poisson_sampler.num_units == 40
    assert 4.0 * 0.99 <= tr.get_epsilon() <= 4.0
    assert tr.dp_optimizer.expected_batch_size == 8
    # Each batch: whole units, every row of a sampled document, none twice.
    by_doc: dict[str, int] = {}
    for r in data:
        by_doc[r["doc"]] = by_doc.get(r["doc"], 0) + 1
    sampler = tr._poisson_sampler
    sampler.set_epoch(0)
    for indices in list(sampler)[:6]:
        docs = [data[i]["doc"] for i in indices]
        assert len(set(indices)) == len(indices)
        assert all(docs.count(d) == by_doc[d] for d in set(docs))
    assert sum(len(b.sizes) for b in tr.batches) >= 6


def test_refusals_name_the_problem_and_the_fix(tmp_path: Path) -> None:
    data = unit_rows([1, 5, 2, 6, 1] * 4, seed=2)  # units of up to 6 rows
    tr = make(
        tmp_path,
        data=data,
        privacy={"noise_multiplier": 1.0},
        max_steps=1,
        per_device_train_batch_size=4,
    )
    with pytest.raises(
        ValueError,
        match=r"8 of the 20 units of 'doc' have more rows than "
        r"per_device_train_batch_size=4 \(the largest has 6\).*"
        r"max_sequences_per_unit <= 4",
    ):
        tr.train()
    # The fix: at most 4 rows per unit (its first ones) trains.
    tr = make(
        tmp_path / "fixed",
        data=data,
        privacy={"noise_multiplier": 1.0, "max_sequences_per_unit": 4},
        max_steps=2,
        per_device_train_batch_size=4,
    )
    tr.train()
    assert max(len(m) for m in tr._poisson_sampler.members) == 4
    with pytest.raises(ValueError, match="'user' is not a column|row 0 .* no such key"):
        make(
            tmp_path / "c",
            data=data,
            privacy={"noise_multiplier": 1.0, "privacy_unit": "user"},
            max_steps=1,
        ).train()
    with pytest.raises(ValueError, match="max_sequences_per_unit=2 needs privacy_unit"):
        PrivacyArguments(noise_multiplier=1.0, expected_batch_size=4, max_sequences_per_unit=2)
    with pytest.raises(ValueError, match="not below 1 / N .*N = 20 units of 'doc'"):
        make(
            tmp_path / "d",
            data=data,
            privacy={"noise_multiplier": 1.0, "target_delta": 0.1},
            max_steps=1,
            per_device_train_batch_size=6,
        ).train()


def test_resume_exact_mid_epoch_equals_uninterrupted(tmp_path: Path) -> None:
    """The unit sampler is seeded per epoch (as the per-example one): a run resumed with
    ``resume_exact=True`` from a mid-epoch checkpoint draws the same units and noise and ends at
    the same weights and epsilon. U = 12 units, expected_batch_size = 4: 3 steps per epoch,
    checkpoint at step 2. (The default resume draws fresh masks: test_dp_trainer_resume.py.)"""
    data = unit_rows([1, 3, 2, 1, 3, 2, 1, 2, 3, 1, 2, 3], seed=5)
    privacy = {"target_epsilon": 8.0, "sketch_seed": 5, "resume_exact": True}
    save = {"save_strategy": "steps", "save_steps": 2, "max_steps": 5}
    full = make(tmp_path / "full", data=data, privacy=privacy, **save)
    full.train()
    resumed = make(tmp_path / "resumed", data=data, privacy=privacy, **save)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-2"))
    assert len(resumed.batches) == 3
    assert resumed.privacy_engine.accountant.history == full.privacy_engine.accountant.history
    assert resumed.get_epsilon() == full.get_epsilon()
    a, b = th.params(full.model), th.params(resumed.model)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
    assert [x.sizes for x in full.batches[2:]] == [x.sizes for x in resumed.batches]


def test_unit_ids_must_be_present_hashable_scalars() -> None:
    """A missing unit id (None, NaN) is not a unit, and a list (a model input such as
    input_ids) is not a unit id: both are refused before training, naming the column, the
    count and the first row. 0-d tensors are their values (not one unit per row)."""
    from opacus_rc.integrations.train_data import unit_members

    def rows(ids: list) -> list[dict]:
        return [{"doc": v} for v in ids]

    with pytest.raises(
        ValueError,
        match=r"privacy_unit='doc': 3 of the 6 rows have no unit id \(None or NaN; the first "
        r"is row 1\)\. A missing unit id is not a unit",
    ):
        unit_members(rows(["a", None, "b", None, "a", None]), "doc", max_sequences_per_unit=None)
    with pytest.raises(ValueError, match=r"2 of the 4 rows .* the first is row 2"):
        unit_members(
            rows([1.0, 2.0, float("nan"), float("nan")]), "doc", max_sequences_per_unit=None
        )
    with pytest.raises(ValueError, match=r"1 of the 3 rows .* the first is row 0"):
        unit_members(rows([torch.tensor(float("nan")), 1, 2]), "doc", max_sequences_per_unit=None)
    for bad, kind in (([1, 2], "list"), ({"x": 1}, "dict")):
        with pytest.raises(
            ValueError,
            match=rf"privacy_unit='doc': row 1 has a {kind} as its unit id .*; a unit id must "
            r"be one hashable scalar per row",
        ):
            unit_members(rows(["a", bad, "a"]), "doc", max_sequences_per_unit=None)
    with pytest.raises(ValueError, match=r"row 0 has a Tensor of shape \(2,\) as its unit id"):
        unit_members(rows([torch.tensor([1, 2])]), "doc", max_sequences_per_unit=None)
    # 0-d tensors are compared by value: two units, not three.
    unit_of, members = unit_members(
        rows([torch.tensor(7), torch.tensor(8), torch.tensor(7)]),
        "doc",
        max_sequences_per_unit=None,
    )
    assert unit_of == [0, 1, 0] and members == [[0, 2], [1]]


def test_a_model_input_column_as_the_unit_is_refused(tmp_path: Path) -> None:
    data = unit_rows([1, 2, 3, 1] * 2, seed=4)
    tr = make(
        tmp_path,
        data=data,
        privacy={"noise_multiplier": 1.0, "privacy_unit": "input_ids", "target_delta": 1e-2},
        max_steps=1,
    )
    with pytest.raises(
        ValueError,
        match=r"privacy_unit='input_ids': row 0 has a .* as its unit id.*Is the column a model "
        r"input",
    ):
        tr.train()


def test_target_delta_is_bounded_by_one_over_the_units(tmp_path: Path) -> None:
    """With privacy_unit the records are the units: 5 units of 10 rows, delta must be below
    1 / U = 0.2 (not 1 / N_rows = 0.1), as the docstring says. 0.15 trains, 0.25 is refused."""
    assert "``(0, 1 / U)`` for the ``U`` units" in " ".join(PrivacyArguments.__doc__.split())
    data = unit_rows([2, 2, 2, 2, 2], seed=5)
    privacy = {"noise_multiplier": 1.0, "expected_batch_size": 2}
    tr = make(tmp_path, data=data, privacy={**privacy, "target_delta": 0.15}, max_steps=1)
    tr.train()
    assert tr._num_records == 5
    with pytest.raises(
        ValueError, match=r"target_delta=0.25 is not below 1 / N = 0.2 \(N = 5 units of 'doc'\)"
    ):
        make(
            tmp_path / "b", data=data, privacy={**privacy, "target_delta": 0.25}, max_steps=1
        ).train()


def test_a_batch_that_already_has_the_units_key_is_refused(tmp_path: Path) -> None:
    """Rows (and a collator keeping them) with their own ``dp_privacy_units``: the trainer would
    overwrite it with each row's unit. Refused at the first logical batch, before any step is
    taken or accounted."""
    data = [{**r, UNITS_KEY: 99} for r in unit_rows([1, 2, 3, 1] * 2, seed=6)]

    def keep_units(rows: list[dict]) -> dict[str, torch.Tensor]:
        return {**th.pad_collate(rows), UNITS_KEY: torch.tensor([r[UNITS_KEY] for r in rows])}

    model = th.tiny_gpt2_exact()
    before = [p.detach().clone() for p in model.parameters()]
    tr = RecordingTrainer(
        model=model,
        args=th.training_args(tmp_path, max_steps=1, remove_unused_columns=False),
        train_dataset=data,
        data_collator=keep_units,
        privacy_args=PrivacyArguments(
            noise_multiplier=1.0,
            target_delta=DELTA,
            expected_batch_size=4,
            seed=3,
            privacy_unit="doc",
        ),
    )
    with pytest.raises(
        ValueError,
        match=r"already has the key 'dp_privacy_units', which the trainer writes on the "
        r"privacy_unit path .* would be silently replaced",
    ):
        tr.train()
    assert tr.privacy_engine.accountant.history == []
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("bad", ["dropped", "each_row_its_own"])
def test_an_override_of_compute_private_loss_must_pass_the_units(tmp_path: Path, bad: str) -> None:
    """An override of compute_private_loss (the documented extension point) that does not
    forward inputs["dp_privacy_units"] clipped each row alone (2 units of 4 rows gave 2.81 C,
    accounted per unit); one that passes units=torch.arange(B) the same. Both are refused at
    the criterion call, naming the key, and nothing is accounted."""
    from opacus_rc.integrations.per_sample_loss import per_sample_cross_entropy

    class Override(RecordingTrainer):
        def compute_private_loss(self, model: Any, inputs: dict) -> Any:
            units = inputs.pop(UNITS_KEY)
            kw = {} if bad == "dropped" else {"units": torch.arange(len(units))}
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            return per_sample_cross_entropy(
                self._private.criterion, logits, labels, shift=True, **kw
            )

    tr = Override(
        model=th.tiny_gpt2_exact(),
        args=th.training_args(tmp_path, max_steps=1, per_device_train_batch_size=8, **SGD),
        train_dataset=unit_rows([4, 4, 4, 4]),
        data_collator=th.pad_collate,
        privacy_args=PrivacyArguments(
            target_delta=DELTA,
            expected_batch_size=4,
            seed=3,
            privacy_unit="doc",
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        ),
    )
    match = "dp_privacy_units" if bad == "dropped" else "does not group the batch's sequences"
    with pytest.raises(ValueError, match=match):
        tr.train()
    assert not tr.privacy_engine.accountant.history
