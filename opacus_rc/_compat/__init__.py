"""The one place where ``opacus_rc`` touches another package's private names.

**The rule.** No module of ``opacus_rc`` outside this package imports a private module of
another package (``torch._C``, ``opacus.optimizers.optimizer._generate_noise``), reads or writes
an underscore attribute that another package defines (``p._forward_counter``, which Opacus sets
on every trainable parameter; ``module._parameters`` of ``nn.Module``; a ``GradSampleModule``'s
``_module``), or overrides another package's private method (Opacus' ``PrivacyEngine.
_prepare_model``, the Hugging Face ``Trainer._save_checkpoint``). Such uses go through a function
or class here, one adapter per package:

* :mod:`opacus_rc._compat.opacus` -- Opacus (noise, processed flags, the accountant registry,
  forward counters, the grad-sample module's wrapped model, the engine's build steps);
* :mod:`opacus_rc._compat.torch` -- PyTorch (autograd engine state, saved-tensor hooks,
  sequence numbers, a module's registered parameter and child dictionaries);
* :mod:`opacus_rc._compat.transformers` -- Hugging Face ``Trainer`` (private hooks and helpers
  the DP trainer overrides or calls); imported by ``opacus_rc.integrations`` only.

Our own underscore names (``opacus_rc``'s ``_foo``) are not concerned.

**Why.** Private names change without deprecation. Each adapter says what it relies on, the
versions it was checked against, and which test catches a change: ``tests/compat/`` holds one
contract test per adapter (it does what the callers rely on, on the installed versions), and
``tests/compat/test_boundary.py`` walks every module outside this package and fails on any
private name of another package. ``setup.cfg`` pins the range these were checked on.

Importing this package imports none of its modules (``transformers`` is optional).
"""
