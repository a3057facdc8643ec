"""A model's generation, planned once: :func:`compile_generation` → :class:`GenerationPlan`.

Why one frozen object: everything the host loop needs to know about a model — its generation
PDG, every store's layout, the step programs' builder, the tile and compaction policies, the row
multiple of a mesh, the vocabulary — is decided here, before any request, from the traced
program and :class:`~jaxrl_sym.runtime.options.EngineOptions`. Decode groups, the speculative
group, a draft model and the memory estimate take this plan; none of them reads an engine's
attributes or patches the plan afterwards. Speculation is a planning input (ring and block
stores are planned ``k`` slots larger), not a patch applied after planning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from jaxrl_sym.backends.launch import backend_name
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.passes.generation import add_generation_loop
from jaxrl_sym.passes.positions import position_tail
from jaxrl_sym.passes.storage import StoragePlan, StorePlan, live_count_fn, plan_storage
from jaxrl_sym.passes.stores import StoreSpec
from jaxrl_sym.pdg.ir import PDG
from jaxrl_sym.runtime.evaluate import constant_values
from jaxrl_sym.runtime.metrics import tree_bytes
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.runtime.policy import Compaction, GroupShape, Tiling, microbatches
from jaxrl_sym.runtime.programs import Build, ProgramCache, StepBuilder, slot_specs, store_specs
from jaxrl_sym.sharding import data_size, global_args, make_mesh, platform_of, tree_shardings
from jaxrl_sym.tracer.trace import TracedProgram


def resolve_backend(backend: str) -> str:
    """``xla`` everywhere; ``triton`` = jax-triton on a GPU, Triton's interpreter on CPU (slow,
    for checking); ``pallas`` = the Pallas decode kernel (compiled on a GPU, interpreted on
    CPU); ``auto`` = triton where it runs compiled (a GPU with jax-triton), else xla."""
    if backend == "auto":
        return "triton" if backend_name() == "gpu" else "xla"
    if backend in ("xla", "pallas"):  # pallas: part of jax, on every platform
        return backend
    if backend == "triton":
        if backend_name() is None:
            raise InputError(
                "backend='triton' needs triton (pip install -e '.[interp]' on CPU, '.[gpu]' with "
                "jax-triton on a GPU); use backend='xla' otherwise"
            )
        return backend
    raise InputError(f"backend={backend!r}: choose 'xla', 'triton', 'pallas' or 'auto'")


@dataclass(frozen=True)
class GenerationPlan:
    """Everything decided about a model's generation before any request (module docstring).

    options: the knobs it was planned from. pdg: the generation PDG (the sampling loop closed).
    storage: the symbolic storage plan. specs: each attention node's concrete store layout.
    builder: the step programs' pure functions. backend: ``xla`` or ``triton`` (resolved).
    vocab_size: the logits' last extent. row_multiple: row buckets are multiples of this (the
    mesh's data axes; 1 without one). tiling / compaction: the host policies. growing: the
    growing stores' names; growing_need(t): their live slots after writing slot t (None: none
    grows). speculation: the speculative decoding it was planned for (None: plain decoding).
    compile_threads: threads compiling a call's decode programs ahead (0: none;
    ``EngineOptions.compile_threads``, resolved for the platform).
    """

    options: EngineOptions
    pdg: PDG
    storage: StoragePlan
    specs: Mapping[int, StoreSpec]
    builder: StepBuilder
    backend: str
    vocab_size: int
    row_multiple: int
    tiling: Tiling
    compaction: Compaction
    growing: tuple[str, ...]
    growing_need: Callable[[int], int] | None
    speculation: Speculation | None = None
    compile_threads: int = 0

    @property
    def stores(self) -> tuple[StorePlan, ...]:
        """The storage plan's stores (what a reader of the plan usually wants to see)."""
        return self.storage.stores

    def to_text(self) -> str:
        return self.storage.to_text()

    @property
    def mesh(self) -> Any:
        return self.builder.mesh

    # ------------------------------------------------------------------ groups
    def microbatches(self, lengths: Sequence[int], limits: Sequence[int],
                     max_pad_fraction: float | None = None) -> list[list[int]]:
        """The request's aligned microbatches (``max_pad_fraction``: a call's own policy)."""
        share = self.options.max_pad_fraction if max_pad_fraction is None else max_pad_fraction
        return microbatches(lengths, limits, max_rows=self.options.microbatch_rows,
                            max_pad_fraction=share)

    def group_shape(self, prompt_lens: Sequence[int], limits: Sequence[int]) -> GroupShape:
        """The geometry of a group with these prompt lengths and limits."""
        return GroupShape.plan(prompt_lens, limits, min_capacity=self.options.min_capacity,
                               max_len=self.options.max_len, row_multiple=self.row_multiple)

    def tile_buffer(self, cfg: GenerationConfig) -> int:
        """Steps the decode-tile program's output buffers hold: returned logits fill a tile
        of them, so then ``decode_tile``'s, not ``max_decode_tile``'s. Whole checks of the
        tiling's ``check`` (:meth:`~jaxrl_sym.runtime.policy.Tiling.whole`): a tile runs whole
        checks, so its buffers hold them."""
        return self.tiling.whole(self.tiling.base if cfg.return_logits else self.tiling.max)

    def group_tiling(self, cfg: GenerationConfig) -> Tiling:
        """The tiling a decode group of ``cfg`` runs: tiles grow to :meth:`tile_buffer` (the
        one home of that rule: the engine, the ledgers and the replays take it from here)."""
        return dataclasses.replace(self.tiling, max=self.tile_buffer(cfg))

    # ------------------------------------------------------------------ weights
    def place(self, leaves: list[Any]) -> list[Any]:
        """On a mesh, weights go where the sharding rule puts them (a no-op when a trainer on
        the same mesh already placed them); without one, untouched."""
        if self.mesh is None:
            return leaves
        return jax.device_put(leaves, tree_shardings(leaves, self.mesh))

    def hoist(self, cache: ProgramCache, leaves: list[Any]) -> tuple[tuple[jax.Array, ...], int]:
        """The step programs' static inputs for these weights (computed once per set of
        weights by the caller) and the bytes of the values hoisting computed."""
        build = lambda: jax.jit(self.builder.hoist).lower(leaves).compile()
        computed = cache.run(("hoist",), build, leaves)
        return self.builder.assemble(leaves, computed), tree_bytes(computed)

    # ------------------------------------------------------------------ programs
    def program(self, name: str, cfg: GenerationConfig, *args: Any, **static: Any
                ) -> tuple[tuple, Build]:
        """The cache key of the prefill/decode(-tile) program for these arguments (arrays or
        ``jax.ShapeDtypeStruct``s) and the function that compiles it."""
        stores = args[1]
        caps = tuple(sorted((k, s["pos"].shape[1]) for k, s in stores.items() if "pos" in s))
        # args[2]: the rows (DecodeRows) of a decode program, the prompt block of a prefill
        key = (name, args[2].shape, caps, cfg.temperature, cfg.return_logits,
               *sorted(static.items()))
        jit = {"static_argnames": ("temperature", "want_logits", *static), "donate_argnums": (1,)}
        kwargs = {"temperature": cfg.temperature, "want_logits": cfg.return_logits, **static}
        return key, Build(getattr(self.builder, name), tuple(args), tuple(kwargs.items()),
                          tuple(jit.items()))

    def run(self, cache: ProgramCache, name: str, cfg: GenerationConfig, *args: Any,
            **static: Any) -> tuple[Any, tuple]:
        """Run the prefill/decode(-tile) program for these shapes, compiling it on first use;
        returns (its outputs, its cache key)."""
        if self.mesh is not None:  # a compiled program takes only the shardings it was built for
            args = (args[0], self.builder.place_stores(args[1]), *args[2:])
        key, build = self.program(name, cfg, *args, **static)
        exe = cache.get(key, build)
        cache.dispatches += 1
        return exe(*global_args(exe, args)), key


def compile_generation(program: TracedProgram, options: EngineOptions | None = None, *,
                       mesh: Any = None, speculation: Speculation | None = None,
                       platform: str | None = None) -> GenerationPlan:
    """Plan generation for a traced model: close the sampling loop, plan its stores, size them
    (``speculation``: ``k`` slots more for ring/block stores; a recurrent state is refused),
    and build the step programs' functions. ``mesh``: a ``jax.sharding.Mesh``, ``"data=4"`` or
    a :class:`~jaxrl_sym.sharding.MeshConfig`. ``platform``: where the programs will run
    ("cpu", "gpu", "tpu"; default the mesh's, else JAX's default device's) — the tiling's
    check interval depends on it; a plan compiled for another machine (``bench dispatch``
    compiles for an H100 on a CPU) names that machine's. Nothing is compiled by XLA here."""
    options = options if options is not None else EngineOptions()
    if options.refill and (speculation is not None or mesh is not None):
        raise InputError("refill=True runs plain decoding on one device for now: drop "
                         f"{'speculation' if speculation is not None else 'the mesh'} or refill")
    backend = resolve_backend(options.backend)
    mesh = make_mesh(mesh)
    here = platform if platform is not None else platform_of(mesh)
    tiling, compaction = options.tiling(here), options.compaction(here)
    # a mesh's programs are built for placed stores; speculation runs verify tiles, not decode's
    ahead = options.compile_ahead(here) if mesh is None and speculation is None else 0
    vocab = int(program.pdg.node(program.pdg.outputs[0]).shape[-1])
    pdg = add_generation_loop(program.pdg)
    storage = plan_storage(pdg, max_len=options.max_len)
    bindings = program.binding_dict
    specs = store_specs(pdg, storage, bindings, backend)
    if speculation is not None:
        specs = {n: dataclasses.replace(s, capacity=s.kind.speculative_capacity(s, speculation.k))
                 for n, s in specs.items()}
    builder = StepBuilder(pdg, specs, slot_specs(pdg, storage, bindings),
                          constant_values(program.consts), backend, mesh=mesh,
                          tail=position_tail(pdg))
    growing = tuple(str(n) for n, s in specs.items() if s.kind.grows)
    fns = [live_count_fn(pdg.symbols, storage.for_node(int(g)), bindings) for g in growing]
    # live slots of the growing stores after writing slot t (None: nothing grows)
    need = (lambda t: max(int(f(t)[0]) for f in fns)) if fns else None
    return GenerationPlan(options, pdg, storage, specs, builder, backend, vocab,
                          data_size(builder.mesh), tiling, compaction, growing, need, speculation,
                          ahead)
