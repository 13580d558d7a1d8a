"""The privacy options of a DP trainer run (:class:`PrivacyArguments`).

A plain dataclass that ``transformers.HfArgumentParser`` parses beside ``TrainingArguments``;
importing it needs neither ``transformers`` nor TRL. Used by
:class:`~opacus_rc.integrations.transformers.DPTrainer` and
:class:`~opacus_rc.integrations.trl.DPSFTTrainer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from opacus_rc.validation import validate_delta, validate_max_grad_norm, validate_noise_multiplier

__all__ = ["PrivacyArguments"]

#: ``bookkeeping`` strings of :class:`PrivacyArguments` and the engine's values for them.
BOOKKEEPING = {"true": True, "false": False, "always": "always"}


@dataclass
class PrivacyArguments:
    """The privacy options of a :class:`~opacus_rc.integrations.transformers.DPTrainer` run,
    parseable by ``HfArgumentParser``.

    Args:
        target_epsilon: Epsilon to reach after the whole run (the noise multiplier is searched
            for the Trainer's number of steps). Give exactly one of ``target_epsilon`` and
            ``noise_multiplier``.
        noise_multiplier: ``sigma``: the noise std is ``sigma * max_grad_norm``. Epsilon is
            then whatever the run spends.
        target_delta: Delta of the reported epsilon, in ``(0, 1 / N)`` for ``N`` training
            examples; with ``privacy_unit``, in ``(0, 1 / U)`` for the ``U`` units (the
            records of the guarantee; ``U <= N``, so a bound over rows is not enough).
        max_grad_norm: ``C``, the per-example clipping bound, in the units of the per-example
            gradient's Euclidean norm (of the per-example loss, a mean over its labelled
            tokens).
        expected_batch_size: The logical batch: Poisson sampling at rate ``q = 1 /
            ceil(N / expected_batch_size)``; the noisy sum is divided by
            ``expected_batch_size`` itself (public, never computed from ``N``:
            docs/privacy/mechanism.md#mechanism-public).
        dataset_size: The public number of training records ``N'`` (of units with
            ``privacy_unit``), announced before the data are seen, or None. Given, the sampling
            rate and the steps per epoch come from it, ``q = 1 / ceil(N' / expected_batch_size)``,
            and are the same for neighbouring datasets; None takes ``N = len(train_dataset)``
            (the number of units), treated as public as Opacus does: then one record more or
            less can change ``ceil(N / expected_batch_size)`` and so ``q``. The records
            actually sampled are still every record of the data, each at rate ``q``.
        clipping: ``"randomized"`` (the only value): sketched per-example norms, DP-SGD-RC.
        sketch: ``"hutchinson"`` or ``"hutch++"``.
        sketch_dim: ``k``, the sketch's Gaussian (tail) columns (>= 2 for the proved default
            envelope).
        sketch_head_dim: Hutch++ head columns (default ``sketch_dim``); Hutch++ only.
        bookkeeping: ``"true"`` (one backward pass where the model allows it), ``"always"``
            or ``"false"`` (two backward passes): the engine's ``bookkeeping``.
        denoise: A post-processing denoiser of the noisy gradient (``"spectral"``), or None.
        denoise_kappa: The denoiser's threshold factor (``None``: its default).
        seed: Seed of the Poisson sampler and the noise. ``None`` (default): both seeded from
            the operating system's CSPRNG (:mod:`secrets`). A seed makes batches and noise
            reproducible, and the guarantee then holds only while the seed stays secret (a
            warning says so).
        sketch_seed: Seed of the sketch's probes, or None (secret, from the operating system).
            A seed makes the sketch reproducible; the engine then accounts every step under the
            more conservative ``"revealed"`` threat model (a larger epsilon) and warns.
        privacy_unit: A column of the training dataset naming each row's privacy unit (a
            document, a user: one hashable scalar per row, such as an int or a str; a missing
            id, None or NaN, and a list such as ``input_ids`` are refused), or None (each row is
            its own unit). When set, the *units* are Poisson-sampled, at ``q = 1 / ceil(U /
            expected_batch_size)`` for ``U`` units (``expected_batch_size`` then counts units),
            every row of a sampled unit is in the step, each unit's summed gradient is clipped
            once at ``max_grad_norm`` and epsilon is per unit (docs/privacy/units.md). Under DDP
            each sampled unit trains on one rank.
        max_sequences_per_unit: With ``privacy_unit``: at most this many rows of a unit are used
            (its first ones in dataset order, chosen without looking at content), or None
            (all). A unit's rows must fit in one micro-batch
            (``per_device_train_batch_size``).
        resume_exact: How ``train(resume_from_checkpoint=...)`` continues a run. ``False``
            (default): the resumed run draws *fresh* Poisson masks and fresh noise (the sampler
            and the noise generator reseeded from the checkpoint's seed and a new nonce from the
            operating system), so no mask already trained and accounted is trained again and
            two continuations of one checkpoint are independent releases; its epsilon is the
            uninterrupted run's for the same steps, but its weights are not bit-identical to it.
            ``True``: the checkpoint's sampler seed and noise-generator state are restored and
            the resumed run equals the uninterrupted run bit for bit (same masks, same noise).
            Unsafe when two continuations of one checkpoint are published (say after replacing a
            record, or re-running a later part with other settings): they add the *same* noise,
            so their difference is noise-free and the epsilons do not compose; and with
            ``TrainingArguments.ignore_data_skip=True`` (refused with a ``ValueError`` at resume),
            which would train again the masks of the checkpoint epoch's accounted steps.
        log_non_private_token_counts: Log the number of tokens trained on so far (the
            attention mask's ones, else the input's elements, summed over the private batches
            of this ``train()`` call) as ``non_private/num_input_tokens_seen``. The count is
            taken from the private data without noise and no epsilon covers it (neighbouring
            datasets log different counts); the Trainer's own
            ``include_num_input_tokens_seen`` is refused.
        check_batch_independence: ``True`` (default): at the first non-empty logical batch,
            before anything is noised or accounted, a few examples collated alone by the
            trainer's data collator must equal their rows of the collated batch, and their
            outputs and per-example losses alone must equal the same inside the batch
            (:mod:`opacus_rc.integrations.batch_check`); otherwise
            :class:`~opacus_rc.batch_independence.BatchIndependenceError` names the likely
            cause. ``False``: no check.

    Raises:
        ValueError: Neither or both of ``target_epsilon`` and ``noise_multiplier``; a value out
            of range; an unknown ``clipping`` or ``bookkeeping``.
    """

    target_epsilon: float | None = field(
        default=None, metadata={"help": "Epsilon after the whole run (searches the noise)."}
    )
    noise_multiplier: float | None = field(
        default=None, metadata={"help": "Noise multiplier sigma (instead of target_epsilon)."}
    )
    target_delta: float = field(
        default=1e-5, metadata={"help": "Delta, below 1 / N (1 / U units with privacy_unit)."}
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Per-example clipping bound C."})
    expected_batch_size: int | None = field(
        default=None,
        metadata={"help": "Logical (Poisson) batch size; the physical one is the Trainer's."},
    )
    dataset_size: int | None = field(
        default=None,
        metadata={
            "help": "The public number of training records (units with privacy_unit): the "
            "sampling rate is 1 / ceil(dataset_size / expected_batch_size) instead of one "
            "from len(train_dataset)."
        },
    )
    clipping: str = field(
        default="randomized", metadata={"help": "Clipping.", "choices": ["randomized"]}
    )
    sketch: str = field(
        default="hutchinson",
        metadata={"help": "Norm estimator.", "choices": ["hutchinson", "hutch++"]},
    )
    sketch_dim: int = field(default=32, metadata={"help": "Sketch columns k."})
    sketch_head_dim: int | None = field(default=None, metadata={"help": "Hutch++ head columns."})
    bookkeeping: str = field(
        default="true",
        metadata={"help": "One backward pass.", "choices": sorted(BOOKKEEPING)},
    )
    denoise: str | None = field(default=None, metadata={"help": "Denoiser, e.g. spectral."})
    denoise_kappa: float | None = field(default=None, metadata={"help": "Denoiser threshold."})
    seed: int | None = field(
        default=None, metadata={"help": "Seed of batches and noise (default: from the OS)."}
    )
    sketch_seed: int | None = field(
        default=None, metadata={"help": "Seed of the sketch (accounted as revealed)."}
    )

    privacy_unit: str | None = field(
        default=None,
        metadata={
            "help": "Column naming each row's privacy unit (document, user): units are "
            "Poisson-sampled and clipped; expected_batch_size then counts units."
        },
    )
    max_sequences_per_unit: int | None = field(
        default=None,
        metadata={"help": "With privacy_unit: at most this many rows per unit (its first)."},
    )
    resume_exact: bool = field(
        default=False,
        metadata={
            "help": "Resume bit-identically (restore the sampler and noise generators); unsafe "
            "when two continuations of one checkpoint are published. Default: fresh draws."
        },
    )
    log_non_private_token_counts: bool = field(
        default=False,
        metadata={
            "help": "Log the tokens trained on as non_private/num_input_tokens_seen (counted "
            "from the private data without noise: not covered by epsilon)."
        },
    )

    check_batch_independence: bool = field(
        default=True,
        metadata={
            "help": "Check at the first batch that each example's loss does not depend on "
            "the other examples of its batch."
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.bookkeeping, bool):
            self.bookkeeping = str(self.bookkeeping).lower()
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "PrivacyArguments needs exactly one of target_epsilon (the noise multiplier is "
                "then searched for the run) and noise_multiplier; got "
                f"target_epsilon={self.target_epsilon!r}, "
                f"noise_multiplier={self.noise_multiplier!r}"
            )
        if self.target_epsilon is not None and not (
            math.isfinite(self.target_epsilon) and self.target_epsilon > 0
        ):
            raise ValueError(
                f"target_epsilon must be a finite number > 0, got {self.target_epsilon}"
            )
        if self.noise_multiplier is not None:
            validate_noise_multiplier(self.noise_multiplier)
        validate_delta(self.target_delta, "target_delta")
        validate_max_grad_norm(self.max_grad_norm)
        if self.expected_batch_size is None or int(self.expected_batch_size) < 1:
            raise ValueError(
                "PrivacyArguments.expected_batch_size (the logical batch, Poisson-sampled) must "
                f"be an integer >= 1, got {self.expected_batch_size!r}; the physical batch is "
                "TrainingArguments.per_device_train_batch_size"
            )
        if self.clipping != "randomized":
            raise ValueError(
                f"clipping={self.clipping!r}: DPTrainer implements clipping='randomized' only"
            )
        if self.privacy_unit is not None and (
            not isinstance(self.privacy_unit, str) or not self.privacy_unit
        ):
            raise ValueError(
                f"privacy_unit must be a column name (a non-empty str) or None, got "
                f"{self.privacy_unit!r}"
            )
        m = self.max_sequences_per_unit
        if m is not None and self.privacy_unit is None:
            raise ValueError(
                f"max_sequences_per_unit={m} needs privacy_unit (the column naming each row's "
                "unit); without it every row is its own unit"
            )
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_sequences_per_unit must be an integer >= 1 or None, got {m!r}")
        n = self.dataset_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"dataset_size must be an integer >= 1 or None, got {n!r}")
        if not isinstance(self.resume_exact, bool):
            raise ValueError(f"resume_exact must be a bool, got {self.resume_exact!r}")
        if not isinstance(self.log_non_private_token_counts, bool):
            raise ValueError(
                "log_non_private_token_counts must be a bool, got "
                f"{self.log_non_private_token_counts!r}"
            )
        if self.bookkeeping not in BOOKKEEPING:
            raise ValueError(
                f"bookkeeping must be one of {sorted(BOOKKEEPING)}, got {self.bookkeeping!r}"
            )
