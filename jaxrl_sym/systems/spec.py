"""What a generation system *is*, without running it: its name, capabilities, the checks a
command line can make before JAX is imported, and the module that binds it to a model.

Why a spec apart from the code that runs: the CLI validates ``--systems`` and prints refusals in
well under a second, before JAX's multi-second import; the code that generates (the symbolic
runtime, the baselines, Tunix) imports JAX and is loaded only by :meth:`SystemSpec.bind`, by the
module name the spec holds. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jaxrl_sym.errors import InputError


@dataclass(frozen=True)
class Capabilities:
    """What a system can do, as flags a caller filters on (:func:`jaxrl_sym.systems.names`).

    ``patterns``: the decode CLI's ``--attention`` values the system can run (None: all)."""

    trains: bool = False  # offers the RL step's halves (SystemSpec.trainer: layout, logits, ...)
    speculates: bool = False  # BindOptions.speculate applies
    draft_models: bool = False  # speculation with a draft *model* (not only prompt lookup)
    shards: bool = False  # BindOptions.mesh applies (else it is the single-device reference)
    stops_itself: bool = False  # can end a generation early (partial rollouts)
    engine: bool = False  # BindOptions.engine (the runtime's EngineOptions) applies
    peer: bool = False  # another library's system: optional package, no shape estimate
    patterns: frozenset[str] | None = None


@dataclass(frozen=True)
class BindOptions:
    """How a system is bound to a model — the one options object of every binding (the decode
    command, evaluation, an RL trainer); every field is JAX-free, so a command line's choices
    become options before any work.

    ``backend``: the kernels' backend (None: the engine's own, ``EngineOptions.backend``).
    ``engine``: the symbolic runtime's ``EngineOptions`` (refill, resident rows, tiles; None: its
    defaults). ``speculate``: the most draft tokens per verify (0: plain decoding),
    ``speculate_adaptive``: pick k per verify tile (sym only), ``draft``: ``"ngram"`` (prompt
    lookup) or a draft model. ``progress(tokens_so_far)`` is called by systems that read tokens
    back as they go. ``budget``: a :class:`~jaxrl_sym.sharding.MemoryBudget` every compiled
    program is checked against (None: no check). ``logprob_chunk``: the RL forward's logits
    chunk (None: whole logits; a trainer passes ``ExecutionConfig.logprob_chunk``, the knob's one
    default)."""

    backend: str | None = None
    mesh: Any = None
    speculate: int = 0
    speculate_adaptive: bool = False
    draft: Any = "ngram"
    progress: Callable[[int], None] | None = None
    engine: Any = None
    budget: Any = None
    logprob_chunk: int | None = None


@dataclass(frozen=True)
class SystemSpec:
    """One generation system: the registry's entry (see :mod:`jaxrl_sym.systems`).

    ``binder``: ``"module"`` or ``"module:function"``; the function (default ``bind``) is called
    as ``function(spec, model, options) -> BoundSystem``. ``needs``/``package``/``install``: the
    importable module a peer needs, its distribution, and how to install it. ``same_function``:
    computes the model's own function on its weights, so its tokens are checked against the
    reference system's. ``preset_only``/``patterns_why``: the reasons behind the refusals of a
    user model and of an attention pattern outside ``capabilities.patterns``. ``variants``:
    suffixes that name a value of ``variant_option`` (``sym-triton``: backend ``triton``).
    ``trainer``: ``"module:Class"`` of the system's RL half (a
    :class:`jaxrl_sym.systems.trainable.TrainableSystem` subclass, in the system's own module:
    layout and the program key; its binder's class is then a ``TrainBound``), set exactly when
    ``capabilities.trains``; imported by :meth:`trainable` only, so this module stays JAX-free.
    """

    name: str
    summary: str
    capabilities: Capabilities
    binder: str
    install: str | None = None
    needs: str | None = None
    package: str | None = None
    same_function: bool = True
    preset_only: str | None = None
    patterns_why: str | None = None
    variants: tuple[str, ...] = ()
    variant_option: str = "backend"
    fixed: tuple[tuple[str, Any], ...] = ()  # the options a variant sets (see ``variant``)
    trainer: str | None = None

    def __post_init__(self) -> None:
        if self.capabilities.trains != (self.trainer is not None):
            raise InputError(f"system {self.name!r}: capabilities.trains={self.capabilities.trains}"
                             f" but trainer={self.trainer!r}; a system trains exactly when it "
                             "names its RL half (trainer='module:Class')")

    def variant(self, suffix: str) -> SystemSpec:
        """``sym`` + ``triton`` → the spec named ``sym-triton`` that binds with backend triton."""
        if suffix not in self.variants:
            raise InputError(f"unknown system {self.name}-{suffix!r}: {self.name} has variants "
                             f"{', '.join(self.variants) or 'none'}")
        return dataclasses.replace(self, name=f"{self.name}-{suffix}",
                                   fixed=((self.variant_option, suffix),))

    def unavailable(self) -> str | None:
        """None, or why this system cannot run in this environment (its package is missing),
        with the install hint; found without importing the package."""
        if self.needs is None:
            return None
        if sys.modules.get(self.needs) is not None or importlib.util.find_spec(self.needs):
            return None
        return f"needs the {self.package or self.needs} package: {self.install}"

    def refusals(self, options: BindOptions, *, attention: str, user_model: bool) -> list[str]:
        """What stops this system from running a decode request, each naming the flag to
        change; JAX-free, so the CLI prints them before any work. ``attention``: the CLI's
        ``--attention`` (ignored for a user model, which defines its own)."""
        caps, out = self.capabilities, []
        if user_model and self.preset_only:
            out.append(f"--systems {self.name} {self.preset_only}; it cannot take --model")
        elif not user_model and caps.patterns is not None and attention not in caps.patterns:
            allowed = " or ".join(sorted(caps.patterns))
            out.append(f"--systems {self.name}: {self.patterns_why}; use --attention {allowed} "
                       f"(got {attention})")
        if options.speculate and caps.speculates and attention == "linear" and not user_model:
            out.append(f"--speculate with --attention {attention}: linear attention's recurrent "
                       "state cannot roll back rejected drafts; use --speculate 0")
        return out

    def options(self, options: BindOptions | None = None) -> BindOptions:
        """``options`` with what this spec's variant fixes (``sym-triton``: the backend)."""
        return dataclasses.replace(options or BindOptions(), **dict(self.fixed))

    def bind(self, model: Any, options: BindOptions | None = None) -> Any:
        """This system on ``model``, a :class:`~jaxrl_sym.systems.bound.BoundSystem`: imports its
        binder (JAX and the system's code load here). Typed ``Any`` because the bound class
        imports this module (the spec stays JAX-free and below it)."""
        options = self.options(options)
        if options.mesh is not None and not self.capabilities.shards:
            raise InputError(f"mesh={options.mesh!r} applies to systems that shard, not "
                             f"{self.name!r}")
        if options.speculate and not self.capabilities.speculates:
            raise InputError(f"speculate={options.speculate} applies to systems that "
                             f"speculate, not {self.name!r}")
        return _load(self.binder, "bind")(self, model, options)

    def trainable(self) -> Any:
        """This system's RL half, ``trainer(self)`` (a
        :class:`jaxrl_sym.systems.trainable.TrainableSystem`;
        typed ``Any`` for the reason :meth:`bind` is). An :class:`InputError` for a system
        that does not train."""
        if self.trainer is None:
            raise InputError(f"system {self.name!r} does not train (capabilities.trains is "
                             "False): it only generates")
        return _load(self.trainer, "")(self)


def _load(ref: str, default: str) -> Any:
    """The object ``"module:name"`` (``"module"``: its ``default``) names, imported now."""
    module, _, name = ref.partition(":")
    if not (name or default):
        raise InputError(f"{ref!r}: name the object as 'module:name'")
    return getattr(importlib.import_module(module), name or default)
