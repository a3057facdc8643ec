"""Benchmarks, one entry point: ``python -m bench <experiment> --preset quick|full|gpu``.

Why one package: every experiment is found by name in one table (:mod:`bench.registry`), sized
by one of three presets (:mod:`bench.presets`), fed workloads from one home
(:mod:`jaxrl_sym.workloads`), and runs systems in separate processes through one runner
(:mod:`bench.lib.child`). Run it from the repository root (``bench`` is a package there, not an
installed one); ``python -m bench`` lists the experiments.

Layout: the entry point (``__main__``, :mod:`bench.registry`, :mod:`bench.presets`), one module
per experiment in ``bench/experiments/``, and the helpers they share in ``bench/lib/``
(:mod:`bench.lib`: the GPU projection and the suite each have a room there). Data stays beside
the code: ``devices.json``, ``devices/``, ``traces/`` and the measured ``results/``.
"""
