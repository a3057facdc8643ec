"""The programs a decode group runs, by shape: one definition of each, built from arrays or
``jax.ShapeDtypeStruct``s alike. The group (:mod:`jaxrl_sym.runtime.group.loop`) runs them, and the
generation ledger (:mod:`jaxrl_sym.runtime.memory.ledger_generation`) compiles the same functions at
shapes that never run (``python -m bench project --workload decode``), so a projection cannot
drift from the engine. Each returns the program's cache key and its
:class:`~jaxrl_sym.runtime.programs.Build` (called: compiled here).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import numpy as np

from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.runtime.packing import PackedPrompts
from jaxrl_sym.runtime.plan import GenerationPlan
from jaxrl_sym.runtime.prefill import cache_prompts, packed_prefill, refill_from_cache
from jaxrl_sym.runtime.programs import Build, DecodeRows


def _caps(stores: Any) -> tuple[tuple[str, int], ...]:
    """The stores' slot counts by name (what distinguishes programs over stores of a group)."""
    return tuple(sorted((k, s["pos"].shape[1]) for k, s in stores.items() if "pos" in s))


def decode_kind(plan: GenerationPlan, cfg: GenerationConfig) -> tuple[str, bool, dict[str, Any]]:
    """The decode program a group runs: (name, tiled, static arguments)."""
    buffer = plan.tile_buffer(cfg)
    if buffer == 1:
        return "decode", False, {}
    return "decode_tile", True, {"k": buffer, "check": plan.tiling.check,
                                 "eos": tuple(cfg.eos_ids)}


def decode_program(plan: GenerationPlan, cfg: GenerationConfig, hoisted: tuple[Any, ...],
                   rows: int, capacity: int) -> tuple[tuple, Build]:
    """The decode program of a group at ``rows`` and ``capacity``, from abstract arguments (its
    stores as ``init_stores`` makes them; ``hoisted`` arrays or ShapeDtypeStructs)."""
    stores = jax.eval_shape(lambda: plan.builder.init_stores(rows, capacity))
    i32 = jax.ShapeDtypeStruct((), np.int32)
    args = (hoisted, stores, DecodeRows.abstract(rows), i32, i32,
            jax.ShapeDtypeStruct((), np.uint32))
    name, tiled, static = decode_kind(plan, cfg)
    if tiled:
        args = (*args, i32, i32)
    return plan.program(name, cfg, *args, **static)


def packed_prefill_program(plan: GenerationPlan, cfg: GenerationConfig, pk: PackedPrompts,
                           args: tuple[Any, ...]) -> tuple[tuple, Build]:
    """The packed prefill of ``pk`` over ``args``: (hoisted, stores, pk's tokens, positions,
    rows, slots, last, copies, row ids, seed), arrays or ShapeDtypeStructs."""
    key = ("packed_prefill", pk.tokens.shape, pk.copies.shape, pk.chunk_rows,
           cfg.temperature, cfg.return_logits, _caps(args[1]))
    fn = partial(packed_prefill, plan.builder, temperature=cfg.temperature,
                 want_logits=cfg.return_logits, chunk_rows=pk.chunk_rows)
    return key, Build(jax.jit(fn, donate_argnums=(1,)), tuple(args))


def prompt_cache_program(plan: GenerationPlan, pk: PackedPrompts, args: tuple[Any, ...]
                         ) -> tuple[tuple, Build]:
    """The prompt cache of ``pk`` (one entry per distinct prompt) over ``args``: (hoisted,
    pk's tokens, positions, rows, last), arrays or ShapeDtypeStructs."""
    key = ("prompt_cache", pk.tokens.shape, len(pk.last), pk.chunk_rows)
    fn = partial(cache_prompts, plan.builder, chunk_rows=pk.chunk_rows)
    return key, Build(jax.jit(fn), tuple(args))


def refill_program(plan: GenerationPlan, cfg: GenerationConfig, pcap: int,
                   args: tuple[Any, ...]) -> tuple[tuple, Build]:
    """A refill from the prompt cache over ``args``: (stores, cache, cache logits, start,
    lens, entry, refilled mask, write slot, next step, row ids, seed); one program per group
    and cache shape, whatever rows it refills."""
    key = ("refill", pcap, args[2].shape, cfg.temperature, cfg.return_logits, _caps(args[0]),
           tuple((k, c["pos"].shape[0]) for k, c in sorted(args[1].items())))
    fn = partial(refill_from_cache, plan.builder, pcap=pcap, temperature=cfg.temperature,
                 want_logits=cfg.return_logits)
    return key, Build(jax.jit(fn, donate_argnums=(0,)), tuple(args))


def grow_program(plan: GenerationPlan, name: str, store: Any, rows: int, capacity: int
                 ) -> tuple[tuple, Build]:
    """Growing store ``name`` (arrays or ShapeDtypeStructs) copied into ``capacity`` slots."""
    key = ("grow", rows, capacity,
           tuple((n, a.shape, str(a.dtype)) for n, a in sorted(store.items())))
    grow = plan.specs[int(name)].kind.grow
    return key, Build(jax.jit(grow, static_argnums=1), (store, capacity))


def compact_store_program(plan: GenerationPlan, store: Any, keep: Any) -> tuple[tuple, Build]:
    """One store (arrays or ShapeDtypeStructs) compacted to the rows ``keep`` names; stores of
    equal shapes share one program."""
    key = ("compact", keep.shape[0],
           tuple((n, a.shape, str(a.dtype)) for n, a in sorted(store.items())))
    return key, Build(jax.jit(plan.builder.compact_store), (store, keep))
