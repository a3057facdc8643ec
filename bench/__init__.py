"""Benchmarks, one entry point: ``python -m bench <experiment> --preset quick|full|gpu``.

Why one package: every experiment is found by name in one table (:mod:`bench.registry`), sized
by one of three presets (:mod:`bench.presets`), fed workloads from one home
(:mod:`jaxrl_sym.workloads`), and runs systems in separate processes through one runner
(:mod:`bench.child`). Run it from the repository root (``bench`` is a package there, not an
installed one); ``python -m bench`` lists the experiments.
"""
