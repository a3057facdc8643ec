"""What the experiments (``bench/experiments/``) share; no experiment lives here.

Rooms:

* here — running work in a child process (:mod:`bench.lib.child`, also the repository's
  ``ROOT``), a result's provenance (:mod:`bench.lib.record`), which systems a run compares
  (:mod:`bench.lib.roles`), requests built from the workloads (:mod:`bench.lib.requests`),
  plots (:mod:`bench.lib.plots`), the non-DecoderLM models (:mod:`bench.lib.models`),
  random-weight checkpoints (:mod:`bench.lib.checkpoints`), the export's peak memory
  (:mod:`bench.lib.export_memory`) and a GPU plan's page (:mod:`bench.lib.gpu_report`);
* :mod:`bench.lib.projection` — a step or a decode projected to a GPU from XLA's own analyses:
  the RL step's ledger and roofline (the package itself), the decode projection and its page,
  compiling for an H100 without one (:mod:`bench.lib.projection.xla_gpu`), XLA:GPU's thunk
  sequence (:mod:`bench.lib.projection.thunks`) and the dispatch ledger built on both
  (:mod:`bench.lib.projection.dispatch_ledger`);
* :mod:`bench.lib.suite` — the benchmark suite's jobs, child, padding counts, replayed traces
  and tables (``python -m bench suite``).

Every module name under ``bench/`` is unique, so a bare name (``suite_jobs``, ``xla_gpu``) names
one file.
"""
