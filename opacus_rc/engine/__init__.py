"""The parts of :class:`opacus_rc.PrivacyEngine`, one concept a module.

:mod:`opacus_rc.privacy_engine` holds the public methods and the order of one ``make_private``
call; the steps are here:

* :mod:`~opacus_rc.engine.options`: the options the two ``make_private*`` methods share, as one
  typed record, with the fields derived from them;
* :mod:`~opacus_rc.engine.request`: the record validated as a whole before any hook (the data
  loader check) and completed (the public sizes, the randomized-clipping configuration, the
  post-processing);
* :mod:`~opacus_rc.engine.schedule`: the sampling rate, the divisor and the accounted schedule,
  from public inputs;
* :mod:`~opacus_rc.engine.noise`: the check of a given noise multiplier and the search for a
  target epsilon;
* :mod:`~opacus_rc.engine.seams`: Opacus' build steps for randomized clipping;
* :mod:`~opacus_rc.engine.post_processing`: the denoiser and the LoRA guard, built and attached.

Nothing is imported here (each module is imported by name), so importing one part does not
import the engine.
"""
