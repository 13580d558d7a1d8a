"""The engine's noise multiplier: the ``noise_multiplier=0`` check and the search for a target.

* :func:`check_zero_noise`: a noise multiplier the accountant cannot record (or cannot compute
  an epsilon for) is refused before any hook is attached, never at a later step; a run without
  noise warns that it is not private.
* :func:`search_noise_multiplier`: ``make_private_with_epsilon``'s search, at the schedule the
  run will have (the validated options' :class:`~opacus_rc.mechanism.PublicSizes`, from
  :func:`~opacus_rc.engine.schedule.public_sizes`, which the run's mechanism holds), with this
  engine's accountant (and, for randomized clipping, the module's exact sketch spec).
"""

from __future__ import annotations

import copy
import importlib
import math
import warnings
from types import SimpleNamespace
from typing import Any

from opacus.accountants.utils import get_noise_multiplier as opacus_get_noise_multiplier

from opacus_rc.engine.options import MakePrivateOptions
from opacus_rc.sampling_schedule import steps_for_epochs

__all__ = ["check_zero_noise", "search_noise_multiplier"]

#: Delta at which a noiseless probe step must report an infinite epsilon.
_PROBE_DELTA = 1e-5


def check_zero_noise(accountant: Any, options: MakePrivateOptions, noise_multiplier: Any) -> None:
    """``noise_multiplier=0``: refuse it unless the accountant records it; then warn once.

    A noise multiplier in ``(0, 0.01)`` with the RC accountant is refused too: the
    accountant records it but computes no epsilon for it (it would fail after the run).

    The accountant decides whether a step can be accounted, so it is asked with a probe: a
    copy of it records one noiseless step through its optimizer hook (as every real step
    would) and must then report an infinite epsilon. An accountant that refuses the step
    (today's ``RCAccountant``) would make every ``optimizer.step()`` raise, and one that
    reports a finite epsilon for a run without noise would claim a guarantee that does not
    hold: both are refused here, before any hook is attached.

    Raises:
        ValueError: As described, saying what to do.
    """
    try:
        sigma = float(noise_multiplier)
    except (TypeError, ValueError):
        return  # Opacus' concern (non-numeric noise multipliers are not checked here)
    if accountant.mechanism() == "rc" and sigma > 0.0:
        # Looked up at call time (the accountants are imported lazily, see
        # ``PrivacyEngine.__init__``).
        smallest = importlib.import_module(
            "opacus_rc.accountants.analysis.epsilon"
        ).MIN_NOISE_MULTIPLIER
        if sigma < smallest:
            # The accountant records such a step but cannot compute its epsilon: refused
            # here, not after the run at get_epsilon.
            raise ValueError(
                f"noise_multiplier={sigma:.3g} is outside the range the RC accountant "
                f"computes epsilon for: noise_multiplier must be >= {smallest} (or 0, a "
                "debugging run without noise, accounted at epsilon = inf). Below it "
                "epsilon is far beyond any useful budget; use a larger noise multiplier."
            )
    if sigma != 0.0:
        return
    mechanism = accountant.mechanism()
    sample_rate = options.sizes.sample_rate
    probe = copy.deepcopy(accountant)
    probe.history = []
    step = SimpleNamespace(noise_multiplier=0.0, accumulated_iterations=1)
    if options.config is not None:
        step.sketch_spec = options.config.sketch_spec
    with warnings.catch_warnings():  # the probe's own warnings are not the user's concern
        warnings.simplefilter("ignore")
        try:
            probe.get_optimizer_hook_fn(sample_rate=sample_rate)(step)
        except Exception as err:
            raise ValueError(
                f"noise_multiplier=0: the {mechanism!r} accountant cannot record a step "
                f"without noise ({type(err).__name__}: {err}), so every optimizer step "
                "would fail. Pass a noise_multiplier > 0, or, for a debugging run without "
                "noise, an accountant that records sigma = 0 with an infinite epsilon."
            ) from err
        try:
            epsilon = float(probe.get_epsilon(_PROBE_DELTA))
        except Exception:  # noqa: BLE001 - no epsilon at all is not a false claim
            epsilon = math.inf
    if math.isfinite(epsilon):
        raise ValueError(
            f"noise_multiplier=0: the {mechanism!r} accountant reports a finite epsilon "
            f"({epsilon:g} at delta={_PROBE_DELTA:g}) for a step without noise, whose "
            "epsilon is infinite; pass a noise_multiplier > 0"
        )
    warnings.warn(
        "noise_multiplier=0: no noise is added, so this run is not differentially private "
        "and its epsilon is infinite; use it for debugging only",
        UserWarning,
        stacklevel=4,
    )


def search_noise_multiplier(
    accountant: Any,
    options: MakePrivateOptions,
    *,
    target_epsilon: float,
    target_delta: float,
    epochs: int,
) -> float:
    """The noise multiplier reaching ``(target_epsilon, target_delta)`` after ``epochs``.

    Searched at the schedule the run will have (``options.sizes``: ``accounted_rate`` and
    ``steps_per_epoch``, the values the run's :class:`~opacus_rc.mechanism.Mechanism` will
    hold), not at ``q`` and ``int(epochs / q)``: for some ``q`` an epoch is one step short
    of ``1 / q`` and the accountant records the larger rate ``1 / int(1 / q)``
    (``q = 1/93``: 92 steps at ``1/92``), which would end the run above the target.
    """
    sample_rate, per_epoch = options.sizes.accounted_rate, options.sizes.steps_per_epoch
    schedule: dict[str, Any] = {"epochs": epochs, "steps": None}
    if isinstance(epochs, (int, float)) and 0 < epochs < math.inf:
        schedule = {"epochs": None, "steps": steps_for_epochs(epochs, per_epoch)}
    if len(accountant) > 0:
        warnings.warn(
            "make_private_with_epsilon is called with privacy budget already spent; the "
            "noise multiplier assumes a zero starting point, so the total epsilon will be "
            "higher than the target",
            UserWarning,
            stacklevel=3,
        )
    if options.config is None:
        # Opacus' make_private_with_epsilon, including where it sends **kwargs.
        return opacus_get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            sample_rate=sample_rate,
            **schedule,
            accountant=accountant.mechanism(),
            **options.kwargs,
        )
    # Looked up at call time (the package is imported lazily, see ``PrivacyEngine.__init__``).
    accountants = importlib.import_module("opacus_rc.accountants")
    return accountants.get_noise_multiplier(
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sample_rate=sample_rate,
        **schedule,
        sketch_spec=options.config.sketch_spec,
        accountant=accountant,
        epsilon_tolerance=0.01,
    )
