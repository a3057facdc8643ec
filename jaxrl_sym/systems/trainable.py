"""The RL half every trainable system shares: what an RL step runs on.

A *system* owns exactly what differs between the symbolic runtime and the padded baseline:

* how samples are generated (sampled and greedy),
* the training layout (packed exact-length rows vs right-padded rows,
  :mod:`jaxrl_sym.systems.layout`),
* the forward that turns a layout's inputs into logits (reference, value and training passes),
* optional capabilities — here, scoring the reference while generation still runs (sym only).

Everything else — rewards, advantages, the loss, micro-batching, the optimiser, commit — is shared
and lives in :mod:`jaxrl_sym.rl.step.stages`. Why objects rather than ``if system ==`` branches: the
branches were spread over half a dozen trainer methods, so adding a system (or changing one) meant
editing all of them in step; now a system is one module (``systems/sym.py``, ``systems/padded.py``)
holding its generation half and its RL half.

Two classes per trainable system, both here in their base form:

* :class:`TrainableSystem`, a frozen value of its class and spec (``SystemSpec.trainer`` names
  the class, :func:`trainable` builds it): it tags the layouts it builds, and equal systems share
  the step's compiled programs while a subclass registered under another name gets its own.
* :class:`TrainBound`, the system bound to one policy: the same object the decode command gets
  from ``spec.bind`` (generation, estimate, ledger — one bound system per trainer, reused by all
  of them), plus the policy's weights (``set_params``, called by the step's commit), the layout
  and the forward. A bound system never reads the trainer: what it needs is in its
  :class:`~jaxrl_sym.systems.spec.BindOptions` (the one options object of every binding) or is
  passed to the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import jax
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult
from jaxrl_sym.models.contract import check_features
from jaxrl_sym.systems import registry
from jaxrl_sym.systems.bound import BoundSystem
from jaxrl_sym.systems.forward import (
    FeaturesFn,
    LogitsFn,
    LogitsOnly,
    SplitForward,
    head_leaf_indices,
)
from jaxrl_sym.systems.layout import Layout
from jaxrl_sym.systems.overlap import ReferenceOverlap
from jaxrl_sym.systems.spec import BindOptions, SystemSpec

ScoreFn = Callable[[Layout], Any]
"""``score(packed_layout) -> device array [rows, L]`` of reference log-probs, dispatched without
blocking (the step runs the reference program; the system decides when and on what)."""

ChunkRows = Callable[[int], "int | None"]
"""``rows_per_chunk(row_len)``: rows of that length one forward may hold (None: no limit)."""


@dataclass(frozen=True)
class TrainableSystem:
    """The RL half of a registered system (its :class:`SystemSpec` names the class:
    ``trainer="module:Class"``); subclasses implement ``build_layout`` and may check options in
    ``bind``.

    A frozen value of its class and spec: it is the key the step's programs are cached under
    (a :class:`~jaxrl_sym.systems.layout.Layout` carries the system that built it), and its name,
    the spec's, names those programs in stats and logs.
    """

    spec: SystemSpec
    input_fill: ClassVar[tuple[int, ...]] = ()  # value of each layout input in an empty row
    fixed_micro_batches: ClassVar[bool] = False
    """Whether the step runs this system's batches in micro-batches of one row count per row
    length — ``ExecutionConfig.update_tokens`` slots, or
    :data:`~jaxrl_sym.rl.knobs.DEFAULT_UPDATE_TOKENS` when unset — the last one completed with
    empty rows (:meth:`fit_rows`), so its update and reference programs are compiled once per
    row length class, whatever the batch's sample count. False (padded): micro-batches only
    where ``update_tokens`` is set, the last one a remainder (a padded row is as wide as the
    batch's longest sample, so its shapes follow every batch anyway)."""

    @property
    def name(self) -> str:
        return self.spec.name

    def bind(self, model: nnx.Module, options: BindOptions) -> TrainBound:
        """This system for one policy: the spec's own binding (the bound class is the system's
        generation half too), which fails here on a model the system cannot run."""
        bound = self.spec.bind(model, options)
        if not isinstance(bound, TrainBound):
            raise InputError(f"system {self.name!r}: its binder returned a "
                             f"{type(bound).__name__}, not a TrainBound; a system that trains "
                             "binds to a class with the RL half (jaxrl_sym.systems.trainable)")
        return bound

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
        return self.fit_rows(layout, -(-layout.shape[0] // multiple) * multiple)

    def fit_rows(self, layout: Layout, rows: int) -> Layout:
        """``layout`` with exactly ``rows`` rows: empty rows appended (as :meth:`pad_rows`) or
        trailing empty rows (a bucket's filler) dropped; a row holding a span is never
        dropped."""
        have = layout.shape[0]
        if rows < layout.filled_rows:
            raise InputError(f"cannot fit a layout whose row {layout.filled_rows - 1} holds a "
                             f"sample into {rows} rows")
        if rows <= have:
            return layout if rows == have else replace(
                layout, inputs=tuple(a[:rows] for a in layout.inputs),
                targets=layout.targets[:rows])
        if len(self.input_fill) != len(layout.inputs):
            raise InputError(f"system {self.name!r} does not say how to fill an empty row "
                             "(set input_fill), so its batches cannot be split over a mesh or "
                             "completed to whole micro-batches")
        extra = rows - have
        pad = lambda a, v: np.concatenate([a, np.full((extra, *a.shape[1:]), v, a.dtype)])
        return replace(layout, inputs=tuple(pad(a, v) for a, v in
                                            zip(layout.inputs, self.input_fill, strict=True)),
                       targets=pad(layout.targets, 0))


class TrainBound(BoundSystem):
    """A trainable system bound to one policy: generates with its current weights, lays batches
    out and gives the forward the step's programs differentiate. ``model`` is the policy with
    its current weights (merged once per :meth:`set_params`)."""

    def __init__(self, spec: SystemSpec, model: Any, options: BindOptions) -> None:
        super().__init__(spec, model, options)
        self.system: TrainableSystem = spec.trainable()
        self.graphdef, state = nnx.split(model)
        self.leaves, self.treedef = jax.tree_util.tree_flatten(state)
        self._merged: nnx.Module | None = model

    @property
    def model(self) -> nnx.Module:
        """An NNX model holding the current policy weights."""
        if self._merged is None:
            self._merged = nnx.merge(self.graphdef,
                                     jax.tree_util.tree_unflatten(self.treedef, self.leaves))
        return self._merged

    def set_params(self, leaves: list[jax.Array]) -> None:
        """The policy's new weights (the step's commit calls this after every update)."""
        self.leaves, self._merged = leaves, None

    def release_params(self) -> None:
        """Hold only the weights' shapes until the next :meth:`set_params`: the step calls this
        before its update when the forward's weights are a copy (bf16 cast, LoRA adapters) that
        the update never reads and the commit replaces, so the copy is freed for the update's
        peak instead of living beside it. Programs built later still see the model's shapes."""
        self.set_params([jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self.leaves])

    def layout(self, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
               row_len: int | None, share_prompts: bool = False) -> Layout:
        return self.system.layout(prompts, responses, row_len=row_len,
                                  share_prompts=share_prompts)

    def pad_rows(self, layout: Layout, multiple: int) -> Layout:
        return self.system.pad_rows(layout, multiple)

    def generate_until(self, prompts: list[np.ndarray], gcfg: GenerationConfig,
                       stop_when: Callable[[np.ndarray], bool], stop_live: int | None = None
                       ) -> GenerationResult | None:
        """Generate, ending early once ``stop_when(finished rows)`` says so (``stop_live``: it
        cannot hold while more rows are unfinished; see ``SymbolicLM.generate``); None when
        this system cannot stop mid-generation (one program runs every row to its end) —
        partial rollouts then generate in segments."""
        return None

    def generate_scoring(self, prompts: list[np.ndarray], gcfg: GenerationConfig,
                         score: ScoreFn, *, row_len: int | None, rows_per_chunk: ChunkRows,
                         ahead: Callable[[Layout], None] | None = None
                         ) -> tuple[GenerationResult, ReferenceOverlap | None]:
        """Generate, and score the reference *during* generation where the system can.

        Returns the generation result and the overlap whose ``collect`` yields the reference
        log-probs, or None when this system cannot overlap — then the step runs one reference
        pass after generation (the default, and what a padded RL library does). ``row_len``:
        the config's packed row length (None: from the batch); ``rows_per_chunk``: the rows one
        scoring forward may hold; ``ahead(layout)``: starts compiling, in the background, the
        program ``score`` will run on chunks of ``layout``'s shape (a system that compiles
        ahead calls it before generating).
        """
        return self.generate(prompts, gcfg), None

    def greedy(self, prompts: list[np.ndarray], gcfg: GenerationConfig) -> list[np.ndarray]:
        """Greedy responses (``gcfg.temperature == 0``) for evaluation."""
        return list(self.generate(prompts, gcfg).tokens)

    def logits_fn(self) -> LogitsFn:
        """``(lm_leaves, layout.inputs) -> logits``: traceable, differentiable in the leaves.

        The built-in systems return a :class:`~jaxrl_sym.systems.forward.SplitForward` (see
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
        if self.options.logprob_chunk is None:
            return LogitsOnly(logits, "ExecutionConfig.logprob_chunk=None")
        model = self.model
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


def trainable(name: str) -> TrainableSystem:
    """The RL half of the registered system ``name`` (:meth:`SystemSpec.trainable`); an
    :class:`InputError` for a name that is not registered or a system that only generates,
    naming the systems that train (:func:`jaxrl_sym.systems.names`)."""
    spec = None
    if isinstance(name, str):
        with contextlib.suppress(InputError):  # refused below, naming the systems that train
            spec = registry.get(name)
    if spec is None or not spec.capabilities.trains:
        why = "unknown system" if spec is None else "system that only generates (no RL half):"
        raise InputError(f"{why} {name!r}; choose one of "
                         f"{', '.join(registry.names(trains=True))} (the systems that train)")
    return spec.trainable()
