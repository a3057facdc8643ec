"""The generation systems, by name: one registry of :class:`SystemSpec` and one module per
system that binds it to a model.

``import jaxrl_sym.systems`` does not import JAX: the CLI lists and checks systems before
JAX's import. A spec names the module that runs it (its *binder*), imported on
:meth:`SystemSpec.bind` only::

    from jaxrl_sym import systems

    systems.names()                   # every system, registration order
    systems.names(trains=True)        # ("sym", "padded")
    spec = systems.get("sym-triton")  # a variant: sym with backend triton
    bound = spec.bind(model, systems.BindOptions(speculate=4))
    bound.generate(prompts, GenerationConfig(max_new_tokens=64))

Adding a system is one file here (its ``bind(spec, model, options) -> BoundSystem``, see
:mod:`jaxrl_sym.systems.bound`) plus one :func:`register` line below; ``docs/extending.md``
walks through one. No other module compares system names: callers ask a spec's capabilities.
"""

from __future__ import annotations

import dataclasses

from jaxrl_sym.errors import InputError
from jaxrl_sym.systems.spec import BindOptions, Capabilities, SystemSpec

__all__ = ["BASELINE", "REFERENCE", "BindOptions", "Capabilities", "SystemSpec", "get", "names",
           "register"]

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


PEER_INSTALL = ("pip install 'jaxrl_sym[peers]' (light, as CI: pip install --no-deps "
                "google-tunix==0.1.7 jaxtyping wadler_lindig sentencepiece)")
_QWEN2 = "runs the preset DecoderLM's weights in Tunix's Qwen2"
_TUNIX = dict(install=PEER_INSTALL, needs="tunix", package="google-tunix")

register(SystemSpec(
    "sym", "the symbolic runtime: exact-size stores, host-planned dispatches",
    Capabilities(trains=True, speculates=True, draft_models=True, shards=True,
                 stops_itself=True), "jaxrl_sym.systems.sym", variants=("xla", "triton", "auto")))
register(SystemSpec(
    "padded", "the padded/masked XLA baseline: left-padded prompts, MAX_LEN caches, one program",
    Capabilities(trains=True, speculates=True), "jaxrl_sym.systems.padded"))
register(SystemSpec(
    "pershape", "the per-shape baseline: exact caches, re-jitted for every length",
    Capabilities(), "jaxrl_sym.systems.pershape"))
register(SystemSpec(
    "tunix", "Tunix's Sampler on the weights copied into its Qwen2, smallest cache",
    Capabilities(peer=True, patterns=frozenset({"full"})), "jaxrl_sym.systems.tunix",
    preset_only=_QWEN2, patterns_why="Tunix's Qwen2 has full causal attention only", **_TUNIX))
register(SystemSpec(
    "tunix-defaults", "Tunix's Sampler on its Qwen2 at its rollout defaults (1,024-slot cache)",
    Capabilities(peer=True, patterns=frozenset({"full"})), "jaxrl_sym.systems.tunix:bind_defaults",
    preset_only=_QWEN2, patterns_why="Tunix's Qwen2 has full causal attention only", **_TUNIX))
register(SystemSpec(
    "tunix-gemma4", "Tunix's ring-cached Gemma 4 at the model's shape (its own weights: speed at "
    "equal shape)", Capabilities(peer=True, patterns=frozenset({"window", "mixed"})),
    "jaxrl_sym.systems.tunix:bind_gemma4", same_function=False,
    preset_only="builds Tunix's Gemma 4 at the shape of the preset DecoderLM",
    patterns_why="Tunix's Gemma 4 is the ring-cache peer for sliding-window layers", **_TUNIX))
