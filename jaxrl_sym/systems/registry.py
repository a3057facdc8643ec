"""The registry itself: names → :class:`SystemSpec`, in registration order (JAX-free).

Why a module apart from the package's ``__init__``: the registration lines and the request
checks (:mod:`jaxrl_sym.systems.choice`) both read it, and neither may import the other."""

from __future__ import annotations

import dataclasses
import importlib.metadata

from jaxrl_sym.errors import InputError
from jaxrl_sym.systems.spec import Capabilities, SystemSpec

_REGISTRY: dict[str, SystemSpec] = {}

PLUGIN_GROUP = "jaxrl_sym.systems"
"""The entry-point group a package outside this one registers its systems under (in its
``pyproject.toml``: ``[project.entry-points."jaxrl_sym.systems"] mine = "mypkg.systems"``)."""
_PLUGINS: list[str] = []
_PLUGINS_LOADED: list[bool] = []  # set once the group has been read (the first lookup reads it)

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
    load_plugins()
    fields = {f.name for f in dataclasses.fields(Capabilities)}
    unknown = sorted(set(capabilities) - fields)
    if unknown:
        raise InputError(f"unknown capabilities {unknown}; choose from {sorted(fields)}")
    return tuple(n for n, s in _REGISTRY.items()
                 if all(getattr(s.capabilities, k) == v for k, v in capabilities.items()))


def get(name: str) -> SystemSpec:
    """The spec of ``name``; ``base-variant`` (``sym-triton``) is the base spec with the
    variant's option fixed. Unknown → :class:`InputError` listing the choices."""
    load_plugins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    base, _, suffix = name.partition("-")
    if suffix and base in _REGISTRY and suffix in _REGISTRY[base].variants:
        return _REGISTRY[base].variant(suffix)
    variants = [f"{n}-{v}" for n, s in _REGISTRY.items() for v in s.variants]
    raise InputError(f"unknown system {name!r}; choose from {', '.join(_REGISTRY)}"
                     + (f" (or a variant: {', '.join(variants)})" if variants else ""))


def load_plugins() -> tuple[str, ...]:
    """Import every installed entry point of :data:`PLUGIN_GROUP` (a module whose import runs its
    :func:`register` lines, or a function called with no arguments), once: the first
    :func:`names` or :func:`get` does it, so an error surfaces where the command line checks its
    systems, not at import. Returns the entry points' names.

    Why entry points: the decode command runs each system in a child process, which sees only
    what importing :mod:`jaxrl_sym.systems` registers; an installed plugin is found by every
    process the same way, without editing this package. Its module must stay JAX-free (name the
    binder by string, as the built-in specs do). A plugin that fails to import is an
    :class:`InputError` naming the entry point and its package."""
    if _PLUGINS_LOADED:
        return tuple(_PLUGINS)
    _PLUGINS_LOADED.append(True)  # first: a plugin that looks systems up does not recurse
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            obj = ep.load()
            if callable(obj):
                obj()
        except InputError:
            raise
        except Exception as err:  # a third party's import error: name whose, and what to do
            dist = ep.dist.name if ep.dist is not None else "an installed package"
            raise InputError(f"system plugin {ep.name!r} ({ep.value}, from {dist}) failed to "
                             f"load: {type(err).__name__}: {err}; fix or uninstall it") from err
        _PLUGINS.append(ep.name)
    return tuple(_PLUGINS)
