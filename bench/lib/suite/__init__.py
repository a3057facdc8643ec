"""The benchmark suite (``python -m bench suite``, :mod:`bench.experiments.suite`): its jobs and
resumable rows (:mod:`bench.lib.suite.suite_jobs`), the per-system child process
(:mod:`bench.lib.suite.suite_child`), padding counted from the request alone
(:mod:`bench.lib.suite.suite_padding`), the ``trace`` scenario (:mod:`bench.lib.suite.suite_trace`)
and its tables (:mod:`bench.lib.suite.suite_report`)."""
