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

Another package adds its systems through the ``jaxrl_sym.systems`` entry-point group
(:func:`load_plugins`, run by the first lookup in every process, so the decode command's child
processes see them too).
Adding a system to this package is one file here (its ``bind(spec, model, options) ->
BoundSystem``, see :mod:`jaxrl_sym.systems.bound`) plus one :func:`register` line below;
``docs/extending.md`` walks through one. No other module compares system names: callers ask
a spec's capabilities. A system that trains keeps its RL half in the same file and names it,
``trainer="module:Class"`` (a :class:`jaxrl_sym.systems.trainable.TrainableSystem`, imported by
``spec.trainable()`` only), which ``RLTrainer(system=name)`` runs the step on; its bound class
is then a :class:`~jaxrl_sym.systems.trainable.TrainBound`, one object for both halves.
"""

from __future__ import annotations

from jaxrl_sym.systems.choice import refusals, split
from jaxrl_sym.systems.registry import BASELINE, REFERENCE, get, load_plugins, names, register
from jaxrl_sym.systems.spec import BindOptions, Capabilities, SystemSpec

__all__ = ["BASELINE", "REFERENCE", "BindOptions", "Capabilities", "SystemSpec", "get",
           "load_plugins", "names", "refusals", "register", "split"]

PEER_INSTALL = ("pip install 'jaxrl_sym[peers]' (light, as CI: pip install --no-deps "
                "google-tunix==0.1.7 jaxtyping wadler_lindig sentencepiece)")
_QWEN2 = "runs the preset DecoderLM's weights in Tunix's Qwen2"
_TUNIX = dict(install=PEER_INSTALL, needs="tunix", package="google-tunix")

register(SystemSpec(
    "sym", "the symbolic runtime: exact-size stores, host-planned dispatches",
    Capabilities(trains=True, speculates=True, draft_models=True, shards=True,
                 stops_itself=True, engine=True), "jaxrl_sym.systems.sym",
    variants=("xla", "triton", "pallas", "auto"),
    trainer="jaxrl_sym.systems.sym:SymSystem"))
register(SystemSpec(
    "padded", "the padded/masked XLA baseline: left-padded prompts, MAX_LEN caches, one program",
    Capabilities(trains=True, speculates=True), "jaxrl_sym.systems.padded",
    trainer="jaxrl_sym.systems.padded:PaddedSystem"))
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
