"""A DP trainer's privacy state in a checkpoint: what is saved, checked and restored.

Every checkpoint of a DP trainer holds :data:`PRIVACY_STATE_NAME`: the accountant's history, the
sampler's seed, the noise generator's state (and the sketch generators', if seeded), the nonces
of the run's fresh resumes, and the privacy settings the run was trained with. Resuming restores
the accountant (a checkpoint of other settings is refused), so the resumed run's epsilon is the
uninterrupted run's for the same steps, and then, by default, draws *fresh* Poisson masks and
noise: the sampler seed and the noise generator are reseeded from the checkpoint's sampler seed
mixed with a nonce from the operating system's CSPRNG (recorded in the run's later
checkpoints). No mask already trained and accounted is drawn again (``ignore_data_skip=True``
included), and two continuations of one checkpoint are independent releases, whose epsilons
compose. ``PrivacyArguments.resume_exact=True`` restores the generators instead, for a resume
bit-identical to the uninterrupted run (unsafe when two continuations of one checkpoint are
published, or part of a run is re-run: they share their noise and masks). The file is as
private as the training data (the seed reveals the batches).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "PRIVACY_STATE_NAME",
    "fresh_seeds",
    "load_privacy_state",
    "privacy_state",
    "restore_privacy_state",
]

#: File of a checkpoint folder that holds the privacy state.
PRIVACY_STATE_NAME = "privacy_state.pt"
#: Version of the privacy-state format written by this module.
_STATE_VERSION = 1


def _settings(private: Any, *, world_size: int) -> dict[str, Any]:
    """The privacy settings a checkpoint must share with the run that resumes it."""
    return {
        "noise_multiplier": float(private.optimizer.noise_multiplier),
        "sample_rate": float(private.sample_rate),
        "expected_batch_size": int(private.optimizer.expected_batch_size),
        "max_grad_norm": float(private.optimizer.max_grad_norm),
        "sketch_spec": repr(private.module.sketch_spec),
        "planned_steps": private.planned_steps,
        "world_size": world_size,
    }


def privacy_state(private: Any, *, sampler_seed: int, world_size: int) -> dict[str, Any]:
    """The privacy state of a run; under DDP the sketch generators' states of every rank are
    gathered (each rank draws its own probes), so every rank must call it.

    Args:
        private: The trainer's :class:`~opacus_rc.integrations.private_run.PrivateRun`.
        sampler_seed: The Poisson sampler's seed.
        world_size: The number of processes.

    Returns:
        The state :func:`restore_privacy_state` takes.
    """
    sketch_states = None
    if private.sketch_generator is not None:
        sketch_states = [private.sketch_generator.get_state()]
        if world_size > 1:
            sketch_states = [None] * world_size
            dist.all_gather_object(sketch_states, private.sketch_generator.get_state())
    return {
        "version": _STATE_VERSION,
        "accountant": private.engine.accountant.state_dict(),
        **_settings(private, world_size=world_size),
        "sampler_seed": int(sampler_seed),
        # Under DDP only rank 0 draws noise; this is its generator (rank 0 saves).
        "noise_generator": private.noise_generator.get_state(),
        "sketch_generator": None if sketch_states is None else sketch_states[0],
        "sketch_generators_by_rank": sketch_states,
        "fresh_resumes": list(private.fresh_resumes),
    }


def load_privacy_state(checkpoint: str) -> dict[str, Any]:
    """The privacy state saved in the checkpoint folder ``checkpoint``.

    Raises:
        FileNotFoundError: The checkpoint has no privacy state (resuming would restart
            epsilon from zero).
    """
    path = os.path.join(checkpoint, PRIVACY_STATE_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: the checkpoint holds no privacy state (accountant "
            "history, sampler and noise generators), so resuming would report epsilon from "
            "zero. Resume only from checkpoints written by a DP trainer"
        )
    return torch.load(path, weights_only=False)


def fresh_seeds(sampler_seed: int, nonce: int) -> tuple[int, int]:
    """The sampler and noise seeds of a fresh resume: two independent streams of a
    :class:`numpy.random.SeedSequence` of the checkpoint's sampler seed and the resume's nonce.

    Args:
        sampler_seed: The checkpointed run's sampler seed.
        nonce: The resume's nonce (from :mod:`secrets`).

    Returns:
        ``(sampler_seed, noise_seed)`` of the resumed run.
    """
    words = [int(sampler_seed), int(nonce)]
    sampler = np.random.SeedSequence(words, spawn_key=(0,)).generate_state(1, np.uint64)[0]
    noise = np.random.SeedSequence(words, spawn_key=(1,)).generate_state(1, np.uint64)[0]
    return int(sampler), int(noise)


def restore_privacy_state(
    private: Any,
    state: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    exact: bool = False,
    ignore_data_skip: bool = False,
) -> int:
    """Restore the accountant of ``private`` from ``state``, and reseed or restore its generators.

    The accountant's history is restored in both modes (the resumed run's epsilon counts the
    checkpointed steps). By default (``exact=False``) the Poisson sampler and the noise are
    reseeded (:func:`fresh_seeds`) from the checkpoint's sampler seed and a nonce from the
    operating system's CSPRNG (rank 0's under DDP: a collective, every rank calls it), appended
    to ``private.fresh_resumes``: the resumed run's masks and noise are new draws, independent
    of the checkpointed run's and of any other continuation of the checkpoint. With
    ``exact=True`` the noise generator's state and the sampler seed are restored: the resumed run
    draws the masks and noise of the uninterrupted run. A seeded sketch generator is restored in
    both modes (a seeded sketch is accounted as revealed).

    Args:
        private: The trainer's :class:`~opacus_rc.integrations.private_run.PrivateRun`.
        state: What :func:`privacy_state` returned for the checkpointed run.
        rank: This process' rank.
        world_size: The number of processes.
        exact: ``PrivacyArguments.resume_exact``.
        ignore_data_skip: ``TrainingArguments.ignore_data_skip``.

    Returns:
        The sampler seed of the resumed run.

    Raises:
        ValueError: An unknown format version, or other privacy settings than this run's;
            ``exact`` with ``ignore_data_skip`` (the Trainer would restart the checkpoint's
            epoch from its first batch and train again the masks of the epoch's steps already
            trained and accounted).
    """
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"unknown privacy-state version {state.get('version')!r}")
    if exact and ignore_data_skip:
        raise ValueError(
            "PrivacyArguments.resume_exact=True with TrainingArguments.ignore_data_skip=True: "
            "the resumed run would restart the checkpoint's epoch from its first batch with the "
            "checkpointed sampler, training again the Poisson masks of steps already trained "
            "and accounted (the accountant would count them as fresh independent steps). Set "
            "ignore_data_skip=False (the exact resume skips those masks), or leave "
            "resume_exact=False (fresh masks and noise)"
        )
    mine = _settings(private, world_size=world_size)
    # A checkpoint written before DDP support has no world size: one process.
    differ = {k: (state.get(k, 1), v) for k, v in mine.items() if state.get(k, 1) != v}
    if differ:
        # The optimizer's expected batch size is a rank's share (the global one over the
        # number of processes): say so, or a user who set the same global size is puzzled.
        label = {"expected_batch_size": "expected_batch_size per process"}
        details = ", ".join(
            f"{label.get(k, k)}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in differ.items()
        )
        raise ValueError(
            "the checkpoint was trained with other privacy settings than this run "
            f"({details}); resume with the same PrivacyArguments, dataset size, "
            "num_train_epochs / max_steps and number of processes"
        )
    private.engine.accountant.load_state_dict(state["accountant"])
    by_rank = state.get("sketch_generators_by_rank") or [state["sketch_generator"]]
    if private.sketch_generator is not None and by_rank[rank] is not None:
        private.sketch_generator.set_state(by_rank[rank])
    resumes = [int(x) for x in state.get("fresh_resumes", [])]
    if exact:
        private.noise_generator.set_state(state["noise_generator"])
        private.fresh_resumes = resumes
        return int(state["sampler_seed"])
    nonce = [secrets.randbits(63)]
    if world_size > 1:  # every rank draws rank 0's masks; only rank 0's noise is added
        dist.broadcast_object_list(nonce, src=0)
    sampler_seed, noise_seed = fresh_seeds(int(state["sampler_seed"]), int(nonce[0]))
    private.noise_generator.manual_seed(noise_seed)
    private.fresh_resumes = [*resumes, int(nonce[0])]
    return sampler_seed
