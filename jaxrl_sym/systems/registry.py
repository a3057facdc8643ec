"""The registry itself: names → :class:`SystemSpec`, in registration order (JAX-free).

Why a module apart from the package's ``__init__``: the registration lines and the request
checks (:mod:`jaxrl_sym.systems.choice`) both read it, and neither may import the other."""

from __future__ import annotations

import dataclasses

from jaxrl_sym.errors import InputError
from jaxrl_sym.systems.spec import Capabilities, SystemSpec

_REGISTRY: dict[str, SystemSpec] = {}

REFERENCE = "sym"
"""The system under test: the decode comparison checks every other system's tokens against it
and states one verdict per other system."""
BASELINE = "padded"
"""The padded/masked baseline: peers are also checked against it (they run its algorithm)."""


def register(spec: SystemSpec) -> SystemSpec:
    """Make ``spec`` available by its name (an :class:`InputError` if the name is taken)."""
    if spec.name in _REGISTRY:
        raise InputError(f"system {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def names(**capabilities: bool) -> tuple[str, ...]:
    """Registered systems in registration order, those whose :class:`Capabilities` flags equal
    every given one (``names(trains=True)``, ``names(peer=False)``)."""
    fields = {f.name for f in dataclasses.fields(Capabilities)}
    unknown = sorted(set(capabilities) - fields)
    if unknown:
        raise InputError(f"unknown capabilities {unknown}; choose from {sorted(fields)}")
    return tuple(n for n, s in _REGISTRY.items()
                 if all(getattr(s.capabilities, k) == v for k, v in capabilities.items()))


def get(name: str) -> SystemSpec:
    """The spec of ``name``; ``base-variant`` (``sym-triton``) is the base spec with the
    variant's option fixed. Unknown → :class:`InputError` listing the choices."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    base, _, suffix = name.partition("-")
    if suffix and base in _REGISTRY and suffix in _REGISTRY[base].variants:
        return _REGISTRY[base].variant(suffix)
    variants = [f"{n}-{v}" for n, s in _REGISTRY.items() for v in s.variants]
    raise InputError(f"unknown system {name!r}; choose from {', '.join(_REGISTRY)}"
                     + (f" (or a variant: {', '.join(variants)})" if variants else ""))
