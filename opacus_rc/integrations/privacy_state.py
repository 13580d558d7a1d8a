"""A DP trainer's privacy state in a checkpoint: what is saved, checked and restored.

Every checkpoint of a DP trainer holds :data:`PRIVACY_STATE_NAME`: the accountant's history, the
sampler's seed, the noise generator's state (and the sketch generators', if seeded), and the
privacy settings the run was trained with. Restoring it makes a resumed run draw the batches and
noise of the uninterrupted run, so its epsilon is the same; a checkpoint of other settings is
refused. The file is as private as the training data (the seed reveals the batches).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "PRIVACY_STATE_NAME",
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


def restore_privacy_state(
    private: Any, state: dict[str, Any], *, rank: int, world_size: int
) -> int:
    """Restore the accountant and the generators of ``private`` from ``state``.

    Args:
        private: The trainer's :class:`~opacus_rc.integrations.private_run.PrivateRun`.
        state: What :func:`privacy_state` returned for the checkpointed run.
        rank: This process' rank.
        world_size: The number of processes.

    Returns:
        The sampler seed of the checkpointed run.

    Raises:
        ValueError: An unknown format version, or other privacy settings than this run's.
    """
    if state.get("version") != _STATE_VERSION:
        raise ValueError(f"unknown privacy-state version {state.get('version')!r}")
    mine = _settings(private, world_size=world_size)
    # A checkpoint written before DDP support has no world size: one process.
    differ = {k: (state.get(k, 1), v) for k, v in mine.items() if state.get(k, 1) != v}
    if differ:
        details = ", ".join(
            f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in differ.items()
        )
        raise ValueError(
            "the checkpoint was trained with other privacy settings than this run "
            f"({details}); resume with the same PrivacyArguments, dataset size, "
            "num_train_epochs / max_steps and number of processes"
        )
    private.engine.accountant.load_state_dict(state["accountant"])
    private.noise_generator.set_state(state["noise_generator"])
    by_rank = state.get("sketch_generators_by_rank") or [state["sketch_generator"]]
    if private.sketch_generator is not None and by_rank[rank] is not None:
        private.sketch_generator.set_state(by_rank[rank])
    return int(state["sampler_seed"])
