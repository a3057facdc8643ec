"""Which rows a benchmark compares: the registry's reference (the system under test) and
baseline, found among the system names a run used (a variant such as ``sym-xla`` counts as its
system).

Why here: every experiment states its ratios against the same two systems; none of them
compares system names itself (:mod:`jaxrl_sym.systems` holds the one list).
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxrl_sym import systems

REFERENCE, BASELINE = systems.REFERENCE, systems.BASELINE


def base_name(system: str) -> str:
    """The registered name ``system`` is, or is a variant of (``sym-xla`` → ``sym``)."""
    for name in systems.names():
        if system == name or system in {f"{name}-{v}" for v in systems.get(name).variants}:
            return name
    return system


def reference(names: Iterable[str]) -> str | None:
    """The first of ``names`` that is the reference system (or one of its variants)."""
    return next((n for n in names if base_name(n) == REFERENCE), None)


def rank(system: str) -> tuple[int, int]:
    """Order of rows within a configuration: the baseline first (the others are checked
    against it), then registration order, a system's variants in their order."""
    if system == BASELINE:
        return (-1, 0)
    names, base = systems.names(), base_name(system)
    if base not in names:
        return (len(names), 0)
    variants = systems.get(base).variants
    suffix = system[len(base) + 1:]
    return (names.index(base), variants.index(suffix) + 1 if suffix in variants else 0)
