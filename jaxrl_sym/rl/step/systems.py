"""The RL half of each trainable system: what an RL step runs on, one class per system.

A *system* owns exactly what differs between the symbolic runtime and the padded baseline:

* how samples are generated (sampled and greedy),
* the training layout (packed exact-length rows vs right-padded rows,
  :mod:`jaxrl_sym.rl.step.layout`),
* the forward that turns a layout's inputs into logits (reference, value and training passes),
* optional capabilities — here, scoring the reference while generation still runs (sym only).

Everything else — rewards, advantages, the loss, micro-batching, the optimiser, commit — is shared
and lives in :mod:`jaxrl_sym.rl.step.stages`. Why objects rather than ``if system ==`` branches: the
branches were spread over half a dozen trainer methods, so adding a system (or changing one) meant
editing all of them in step; now a system is one class.

There is one list of systems, :mod:`jaxrl_sym.systems`: a spec that trains names its class here
(``SystemSpec.trainer``) and :func:`trainable` builds it from the spec, so
:class:`~jaxrl_sym.rl.step.trainer.RLTrainer` takes any registered name that trains. A
:class:`System` is a frozen value (its class and spec): it tags the layouts it builds, and equal
systems share the step's compiled programs while a subclass registered under another name gets its
own. ``bind`` makes a :class:`Bound` system for one policy — the model's structure, its current
weights (``set_params``, called by the step's commit) and, for sym, the traced runtime. A bound
system never reads the trainer: what it needs is given when it is bound, or passed to the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import jax
import numpy as np
from flax import nnx

from jaxrl_sym import systems
from jaxrl_sym.baselines.padded import padded_forward, padded_generate
from jaxrl_sym.baselines.padded_speculative import padded_speculative_generate
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult
from jaxrl_sym.models.contract import check_features
from jaxrl_sym.rl.step.layout import Layout, packed_layout, padded_layout, shared_prefix_layout
from jaxrl_sym.rl.step.logprobs import (
    FeaturesFn,
    LogitsFn,
    LogitsOnly,
    SplitForward,
    head_leaf_indices,
)
from jaxrl_sym.rl.step.overlap import OVERLAP_ROWS, ReferenceOverlap
from jaxrl_sym.runtime.engine import SymbolicLM, length_bucket
from jaxrl_sym.runtime.evaluate import constant_values, evaluate
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.runtime.speculative import SpeculativeLM
from jaxrl_sym.systems.spec import SystemSpec
from jaxrl_sym.tracer.trace import SeqInput, trace_function

ScoreFn = Callable[[Layout], Any]
"""``score(packed_layout) -> device array [rows, L]`` of reference log-probs, dispatched without
blocking (the step runs the reference program; the system decides when and on what)."""

ChunkRows = Callable[[int], "int | None"]
"""``rows_per_chunk(row_len)``: rows of that length one forward may hold (None: no limit)."""


@dataclass(frozen=True)
class BindArgs:
    """What binding a system to one trainer's policy takes.

    model: the policy as given (the runtime traces it; its weights are replaced by
      ``set_params``). engine / speculation: how the symbolic runtime generates
      (:class:`~jaxrl_sym.runtime.options.EngineOptions`; a
      :class:`~jaxrl_sym.runtime.options.Speculation` or None: plain decoding). mesh / budget:
      the trainer's device mesh and :class:`~jaxrl_sym.sharding.MemoryBudget` (None: one device,
      no check). logprob_chunk: the forward's logits chunk (None: whole logits; the
      trainer passes ``RLConfig.logprob_chunk``, the knob's one default).
    """

    model: nnx.Module
    engine: EngineOptions
    speculation: Speculation | None = None
    mesh: Any = None
    budget: Any = None
    logprob_chunk: int | None = None


@dataclass(frozen=True)
class System:
    """The RL half of a registered system (its :class:`SystemSpec` names the class:
    ``trainer="module:Class"``); subclasses implement ``bind`` and ``build_layout``.

    A frozen value of its class and spec: it is the key the step's programs are cached under
    (a :class:`~jaxrl_sym.rl.step.layout.Layout` carries the system that built it), and its name,
    the spec's, names those programs in stats and logs.
    """

    spec: SystemSpec
    input_fill: ClassVar[tuple[int, ...]] = ()  # value of each layout input in an empty row

    @property
    def name(self) -> str:
        return self.spec.name

    def bind(self, args: BindArgs) -> Bound:
        """This system for one policy (fails here on a model the system cannot run)."""
        raise NotImplementedError

    def layout(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
               row_len: int | None, share_prompts: bool = False) -> Layout:
        """The training batch in this system's layout, tagged with this system so the trainer
        runs it through this system's forward and programs (a subclass registered under a new
        name reuses its parent's layout code but gets its own). ``share_prompts``: the
        config's wish to compute a group's prompt once (a system may not be able to)."""
        lay = self.build_layout(prompts, responses, row_len=row_len, share_prompts=share_prompts)
        return replace(lay, system=self)

    def build_layout(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
                     row_len: int | None, share_prompts: bool = False) -> Layout:
        raise NotImplementedError

    def pad_rows(self, layout: Layout, multiple: int) -> Layout:
        """``layout`` with empty rows appended until its row count is a multiple of
        ``multiple`` (a mesh's data axes split rows evenly or not at all). An empty row holds
        no span, so the loss arrays scattered onto it are zero — mask off, weight 0 — and its
        inputs are this system's ``input_fill`` (all slots padding): it adds nothing to the
        loss, its gradient or any reported mean."""
        rows = layout.shape[0]
        extra = -rows % multiple
        if extra == 0:
            return layout
        if len(self.input_fill) != len(layout.inputs):
            raise InputError(f"system {self.name!r} does not say how to fill an empty row "
                             "(set input_fill), so its batches cannot be split over a mesh")
        pad = lambda a, v: np.concatenate([a, np.full((extra, *a.shape[1:]), v, a.dtype)])
        return replace(layout, inputs=tuple(pad(a, v) for a, v in
                                            zip(layout.inputs, self.input_fill, strict=True)),
                       targets=pad(layout.targets, 0))


class Bound:
    """A system bound to one policy: generates with its current weights, lays batches out and
    gives the forward the step's programs differentiate."""

    def __init__(self, system: System, args: BindArgs) -> None:
        self.system = system
        self.graphdef, state = nnx.split(args.model)
        self.leaves, self.treedef = jax.tree_util.tree_flatten(state)
        self.logprob_chunk = args.logprob_chunk
        self.speculation = args.speculation

    @property
    def name(self) -> str:
        return self.system.name

    def model(self) -> nnx.Module:
        """An NNX model holding the current policy weights."""
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, self.leaves))

    def set_params(self, leaves: list[jax.Array]) -> None:
        """The policy's new weights (the step's commit calls this after every update)."""
        self.leaves = leaves

    def release_params(self) -> None:
        """Hold only the weights' shapes until the next :meth:`set_params`: the step calls this
        before its update when the forward's weights are a copy (bf16 cast, LoRA adapters) that
        the update never reads and the commit replaces, so the copy is freed for the update's
        peak instead of living beside it. Programs built later still see the model's shapes."""
        self.leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self.leaves]

    def layout(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
               row_len: int | None, share_prompts: bool = False) -> Layout:
        return self.system.layout(prompts, responses, row_len=row_len,
                                  share_prompts=share_prompts)

    def pad_rows(self, layout: Layout, multiple: int) -> Layout:
        return self.system.pad_rows(layout, multiple)

    def generate(self, prompts: list[np.ndarray], gcfg: GenerationConfig) -> GenerationResult:
        """Sample a response for each (already validated, G-fold expanded) prompt."""
        raise NotImplementedError

    def estimate(self, prompt_lens: Sequence[int], gcfg: GenerationConfig) -> Any:
        """The bytes :meth:`generate` will hold for these prompts, compiling nothing (an
        :class:`~jaxrl_sym.runtime.estimate.Estimate`): the registered system's estimate on the
        current policy; a system whose generation has options of its own prices those."""
        return self.system.spec.bind(self.model()).estimate(prompt_lens, gcfg)

    def ledger(self, prompts: list[np.ndarray], gcfg: GenerationConfig, *,
               compiler: Callable[[Any], Any] | None = None) -> Any:
        """:meth:`generate`'s memory walked dispatch by dispatch over these prompts and limits,
        its programs compiled by ``compiler(build)`` (a
        :class:`~jaxrl_sym.runtime.ledger_generation.GenerationLedger`; None: not modelled):
        the registered system's ledger on the current policy (None when it speculates)."""
        if self.speculation is not None:
            return None
        return self.system.spec.bind(self.model()).ledger(prompts, gcfg, compiler=compiler)

    def generate_until(self, prompts: list[np.ndarray], gcfg: GenerationConfig,
                       stop_when: Callable[[np.ndarray], bool], stop_live: int | None = None
                       ) -> GenerationResult | None:
        """Generate, ending early once ``stop_when(finished rows)`` says so (``stop_live``: it
        cannot hold while more rows are unfinished; see ``SymbolicLM.generate``); None when
        this system cannot stop mid-generation (one program runs every row to its end) —
        partial rollouts then generate in segments."""
        return None

    def generate_scoring(self, prompts: list[np.ndarray], gcfg: GenerationConfig,
                         score: ScoreFn, *, row_len: int | None, rows_per_chunk: ChunkRows
                         ) -> tuple[GenerationResult, ReferenceOverlap | None]:
        """Generate, and score the reference *during* generation where the system can.

        Returns the generation result and the overlap whose ``collect`` yields the reference
        log-probs, or None when this system cannot overlap — then the step runs one reference
        pass after generation (the default, and what a padded RL library does). ``row_len``:
        the config's packed row length (None: from the batch); ``rows_per_chunk``: the rows one
        scoring forward may hold.
        """
        return self.generate(prompts, gcfg), None

    def greedy(self, prompts: list[np.ndarray], gcfg: GenerationConfig) -> list[np.ndarray]:
        """Greedy responses (``gcfg.temperature == 0``) for evaluation."""
        return list(self.generate(prompts, gcfg).tokens)

    def logits_fn(self) -> LogitsFn:
        """``(lm_leaves, layout.inputs) -> logits``: traceable, differentiable in the leaves.

        The built-in systems return a :class:`~jaxrl_sym.rl.step.logprobs.SplitForward` (see
        :meth:`split_forward`) when the model has the contract's ``features``/``head`` split, so
        the step can apply the head a chunk of tokens at a time; a plain function runs unchunked.
        """
        raise NotImplementedError

    def split_forward(self, logits: LogitsFn,
                      features: Callable[[], FeaturesFn]) -> SplitForward | LogitsOnly:
        """``logits`` with, where the model allows it and ``logprob_chunk`` asks for it, the
        system's ``features()`` forward and the model's head beside it.

        ``features`` is a thunk, built (the sym system traces it) on the first call, so a
        trainer whose batches all fit in one chunk (run unchunked) never traces it.
        """
        if self.logprob_chunk is None:
            return LogitsOnly(logits, "RLConfig.logprob_chunk=None")
        model = self.model()
        reason = check_features(model)
        if reason is not None:
            return LogitsOnly(logits, reason)
        graphdef, treedef = self.graphdef, self.treedef

        def head(leaves: list[jax.Array], feats: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves)).head(feats)

        spec = jax.ShapeDtypeStruct((1, 2), np.int32)
        feat = jax.eval_shape(lambda t: model.features(t, t, t), spec)
        leaves = jax.tree_util.tree_leaves(nnx.state(model))
        used = head_leaf_indices(head, leaves, int(feat.shape[-1]), feat.dtype)
        built: list[FeaturesFn] = []

        def lazy_features(leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> jax.Array:
            if not built:
                built.append(features())
            return built[0](leaves, inputs)

        return SplitForward(logits, lazy_features, head, used)


class SymSystem(System):
    """The symbolic runtime: exact-size stores for generation, bin-packed exact-length rows for
    every forward (``SymbolicLM.forward_fn``)."""

    input_fill: ClassVar[tuple[int, ...]] = (0, -1, -1)  # tokens, positions, segment ids

    def bind(self, args: BindArgs) -> SymBound:
        return SymBound(self, args)

    def build_layout(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
                     row_len: int | None, share_prompts: bool = False) -> Layout:
        """Packed exact-length rows; with ``share_prompts`` a group's prompt is placed once per
        row and its responses attend to it (the masked primitive sees parent segments)."""
        build = shared_prefix_layout if share_prompts else packed_layout
        return build(prompts, responses, row_len=row_len)


class SymBound(Bound):
    """The symbolic runtime for one policy: traced when bound (a model the runtime rejects fails
    there), its weights replaced in place by ``set_params`` (no re-trace)."""

    def __init__(self, system: System, args: BindArgs) -> None:
        super().__init__(system, args)
        knobs = set(EngineOptions.knobs())  # a variant's fixed option (sym-triton: backend)
        options = args.engine.replace(**{k: v for k, v in system.spec.fixed if k in knobs})
        if args.speculation is not None:
            self.engine: SymbolicLM = SpeculativeLM(args.model, options,
                                                    speculation=args.speculation, mesh=args.mesh)
        else:
            self.engine = SymbolicLM(args.model, options, mesh=args.mesh)
        self.engine.cache.budget = args.budget  # generation programs are checked too

    def set_params(self, leaves: list[jax.Array]) -> None:
        super().set_params(leaves)
        self.engine.set_params(leaves)

    def release_params(self) -> None:
        super().release_params()
        self.engine.release_params()

    def generate(self, prompts: list[np.ndarray], gcfg: GenerationConfig) -> GenerationResult:
        return self.engine.generate(prompts, gcfg, on_finished=None)

    def estimate(self, prompt_lens: Sequence[int], gcfg: GenerationConfig) -> Any:
        """The trainer's engine prices its own options (refill, microbatch rows, capacities)."""
        return self.engine.estimate(prompt_lens, gcfg)

    def ledger(self, prompts: list[np.ndarray], gcfg: GenerationConfig, *,
               compiler: Callable[[Any], Any] | None = None) -> Any:
        """The trainer's engine walks its own options (None with speculation)."""
        if self.speculation is not None:
            return None
        return self.engine.ledger(prompts, gcfg, compiler=compiler)

    def generate_until(self, prompts: list[np.ndarray], gcfg: GenerationConfig,
                       stop_when: Callable[[np.ndarray], bool], stop_live: int | None = None
                       ) -> GenerationResult:
        """The host loop asks ``stop_when`` after every read-back (a tile of steps), in one
        decode loop for all rows: with the step's own microbatch policy, the rows carried from
        the last step (prompt + tokens so far: longer prompts, shorter limits) became a second
        loop that ran after the new rows had all finished (measured: 13 dispatches and 5.3-6.4 s
        per carried step against 1.3 s), and the stop rule could not end the first loop
        while carried rows it waits for had not started."""
        return self.engine.generate(prompts, gcfg, stop_when=stop_when, stop_live=stop_live,
                                    max_pad_fraction=1.0)

    def generate_scoring(self, prompts: list[np.ndarray], gcfg: GenerationConfig,
                         score: ScoreFn, *, row_len: int | None, rows_per_chunk: ChunkRows
                         ) -> tuple[GenerationResult, ReferenceOverlap | None]:
        """Finished rows are packed into chunks whose reference forward is dispatched while the
        remaining rows still decode (see :mod:`jaxrl_sym.rl.step.overlap`): a row's reference
        log-probs depend only on its own tokens, which exact-length stores make available the
        moment it ends."""
        # One row length for the whole step (the longest possible prompt + response), so the
        # chunks reuse a handful of compiled programs.
        limits = gcfg.max_new_tokens
        longest = max(len(p) for p in prompts) + (max(limits) if isinstance(limits, tuple)
                                                  else int(limits))
        row_len = row_len or length_bucket(max(longest, 64))
        # full chunks of one row (at most the forward's budget) as rows finish: min_rows unused
        overlap = ReferenceOverlap(prompts, row_len, score, min_rows=1,
                                   max_rows=min(OVERLAP_ROWS, rows_per_chunk(row_len) or
                                                OVERLAP_ROWS))
        return self.engine.generate(prompts, gcfg, on_finished=overlap.on_finished), overlap

    def logits_fn(self) -> LogitsFn:
        fwd = self.engine.forward_fn()
        return self.split_forward(lambda leaves, inputs: fwd(leaves, *inputs),
                                  lambda: traced_features(self))


class PaddedSystem(System):
    """The padded/masked baseline: ``padded_generate`` over MAX_LEN caches (with speculation,
    ``padded_speculative_generate``: the same draft and acceptance rule at a fixed k), one
    right-padded row per sample for every forward (``padded_forward``). It ignores
    ``pack_row_len``."""

    input_fill: ClassVar[tuple[int, ...]] = (0, 0)  # tokens, lengths (0: every slot padding)

    def bind(self, args: BindArgs) -> PaddedBound:
        if args.speculation is not None and args.speculation.adaptive:
            raise InputError(f"speculate_adaptive (--speculate-adaptive) picks k per verify on "
                             f"the symbolic runtime; system {self.name!r} verifies a fixed k "
                             "(--speculate K): drop --speculate-adaptive")
        return PaddedBound(self, args)

    def build_layout(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
                     row_len: int | None, share_prompts: bool = False) -> Layout:
        """One row per sample (a padded library repeats every prompt G times)."""
        return padded_layout(prompts, responses)


class PaddedBound(Bound):
    """The padded baseline for one policy: a model merged from the current weights per call."""

    def generate(self, prompts: list[np.ndarray], gcfg: GenerationConfig) -> GenerationResult:
        if self.speculation is not None:
            return padded_speculative_generate(self.model(), prompts, gcfg,
                                               speculate=self.speculation.k)
        return padded_generate(self.model(), prompts, gcfg)

    def logits_fn(self) -> LogitsFn:
        graphdef, treedef = self.graphdef, self.treedef

        def padded_logits(leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> jax.Array:
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
            return padded_forward(model, inputs[0], inputs[1])

        def padded_features(leaves: list[jax.Array], inputs: tuple[jax.Array, ...]
                            ) -> jax.Array:
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
            # padded_forward calls its model with (tokens, positions, segment ids) only
            return padded_forward(model.features, inputs[0], inputs[1])

        return self.split_forward(padded_logits, lambda: padded_features)


def traced_features(host: Bound) -> FeaturesFn:
    """The sym system's ``features`` forward: ``model.features`` traced into its own PDG (as
    the runtime traces ``model``) and evaluated on packed rows by the runtime's one evaluator
    (:func:`jaxrl_sym.runtime.evaluate.evaluate`), as ``StepBuilder.forward`` is — the masked
    attention primitive, differentiable in the leaves.

    Traced once per trainer (when its programs are built); the weights are the same leaves, in
    the same order, as the whole-logits program's.
    """
    graphdef, state = nnx.split(host.model())
    role = ("tokens", "positions", "segment_ids")
    prog = trace_function(
        lambda st, t, p, s: nnx.merge(graphdef, st).features(t, p, s), state,
        [SeqInput(r, "B, T") for r in role])
    pdg, consts = prog.pdg, constant_values(prog.consts)
    weight_ids = [nid for r, nid in pdg.inputs if r.startswith("weight:")]

    def features(leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> jax.Array:
        weights = {nid: (x,) for nid, x in zip(weight_ids, leaves, strict=True)}
        out = evaluate(pdg, {**weights, **consts}, *inputs)
        return out[pdg.outputs[0]][0]

    return features


def trainable(name: str) -> System:
    """The RL half of the registered system ``name`` (:meth:`SystemSpec.trainable`); an
    :class:`InputError` for a name that is not registered or a system that only generates,
    naming the systems that train (:func:`jaxrl_sym.systems.names`)."""
    spec = None
    if isinstance(name, str):
        with contextlib.suppress(InputError):  # refused below, naming the systems that train
            spec = systems.get(name)
    if spec is None or not spec.capabilities.trains:
        why = "unknown system" if spec is None else "system that only generates (no RL half):"
        raise InputError(f"{why} {name!r}; choose one of "
                         f"{', '.join(systems.names(trains=True))} (the systems that train)")
    return spec.trainable()
