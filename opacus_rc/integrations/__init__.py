"""Integrations of randomized clipping with training frameworks.

* :mod:`opacus_rc.integrations.transformers`:
  :class:`~opacus_rc.integrations.transformers.DPTrainer` (a ``transformers.Trainer``) and
  :class:`~opacus_rc.integrations.transformers.PrivacyArguments` (parsed by
  ``transformers.HfArgumentParser``).
* :mod:`opacus_rc.integrations.trl`: :class:`~opacus_rc.integrations.trl.DPSFTTrainer` (a
  ``trl.SFTTrainer``), importable where TRL is installed.

Nothing is imported here: each submodule imports its framework (``transformers``, ``trl``) only
when it is itself imported, so ``import opacus_rc`` never needs either.
"""

__all__: list[str] = []
