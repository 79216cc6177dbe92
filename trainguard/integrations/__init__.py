"""Watching a job without rewriting its loop (SPEC §6).

- ``trainguard run --instrument -- CMD`` (or ``TRAINGUARD_INSTRUMENT=1``): an unmodified
  PyTorch script, through PyTorch's global hooks (:mod:`.instrument`, :mod:`.torch_hooks`);
- ``trainguard.integrations.hf.TrainguardCallback``: Hugging Face ``transformers`` Trainer;
- ``trainguard.integrations.lightning.TrainguardCallback``: PyTorch Lightning.

All three feed a :class:`~.watcher.StepWatcher`, which sends the events of the explicit API
(SPEC §5) through the rank's collector. Importing this package imports nothing heavy; each
callback module imports its framework only when imported itself. See docs/INTEGRATIONS.md.
"""
