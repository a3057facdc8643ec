"""How many bytes a generation request will need, per system, from shapes alone — before any of
it runs.

Why: a padded run at GPT-2-small shape, batch 64 and 16,384 tokens needs ~39 GB of KV cache; it
used to start anyway and die with ``RESOURCE_EXHAUSTED`` minutes later, after its compile. Every
term here is integer arithmetic over shapes the library already knows, read from the model's
traced program (no FLOP, no compile, no device buffer):

- **weights**: the model's parameter leaves (plus, for sym, the hoisted weight values its step
  programs take: casts/transposes/slices the PDG computes once);
- **caches**: one per ``attend`` call, each with that call's own K/V heads, head dims and dtypes
  (read from the traced jaxpr, as :mod:`jaxrl_sym.models.traced` finds them). Padded:
  ``batch × MAX_LEN`` slots (:class:`~jaxrl_sym.models.cache.PaddedKVCache`'s layout).
  Per-shape: the exact final length (and the previous step's caches, alive while the step runs).
  Sym: the runtime's own stores (``StepBuilder.init_stores`` evaluated abstractly) at the row
  bucket and the capacity the policy reaches (:func:`jaxrl_sym.runtime.policy.replay`: the
  same ``GroupShape.plan`` and growth rule the engine runs) — growing stores at their final
  capacity, rings at their window, states at their fixed size — plus one growing store at its
  previous capacity, alive while it is copied;
- **outputs**: tokens, log-probs and (``return_logits``) logits the program holds on device;
- **temporary**: the largest single temporary of a step — the prefill chunk's logits
  (``rows × chunk × vocab × 4``, chunk from :meth:`GenerationConfig.prefill_chunk`), a decode
  step's logits, or one attention call's fp32 scores and probabilities over the keys it reads.

The estimate is a bound of the right size, not a measurement: XLA may keep a few temporaries at
once, and on a GPU the allocator adds fragmentation. ``tests/test_estimate.py`` states the factor
against the measured accounting on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models.cache import PaddedKVCache
from jaxrl_sym.models.traced import trace_forward
from jaxrl_sym.ops.attention import attention_p
from jaxrl_sym.runtime.memory.ledger import Buffer
from jaxrl_sym.runtime.metrics import device_memory_limit
from jaxrl_sym.runtime.plan import GenerationPlan, compile_generation
from jaxrl_sym.runtime.policy import GroupShape, replay
from jaxrl_sym.runtime.prefill import SCORES_BYTES
from jaxrl_sym.runtime.refill import refill_shape
from jaxrl_sym.tracer.flatten import eval_jaxpr
from jaxrl_sym.tracer.trace import trace_model

F32 = 4  # logits and attention scores are computed in float32 by every system


@dataclass(frozen=True)
class AttendCall:
    """One ``attend`` call of the model, as traced: query heads, K/V heads, head dims, dtypes."""

    hq: int
    hkv: int
    d: int
    dv: int
    k_dtype: str
    v_dtype: str
    pattern: str


@dataclass(frozen=True)
class Estimate:
    """Bytes one system needs for one request, term by term (see the module docstring)."""

    system: str
    weights: int
    caches: int
    growth: int  # a second copy alive while caches/stores grow (sym: one store; per-shape: all)
    outputs: int
    temporary: int
    temporary_what: str  # which temporary is the largest, in words
    caches_what: str  # the cache geometry, in words

    @property
    def total(self) -> int:
        return self.weights + self.caches + self.growth + self.outputs + self.temporary

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every term plus ``total``."""
        return {**asdict(self), "total": self.total}

    def buffers(self) -> list[Buffer]:
        """The terms beyond the weights as ledger buffers: what generation adds to a caller
        that holds the weights itself (the RL step's state)."""
        return [Buffer(f"stores/caches ({self.caches_what})", "store", self.caches),
                Buffer("store growth copy", "store", self.growth),
                Buffer("generation outputs", "program_out", self.outputs),
                Buffer(f"largest generation temporary ({self.temporary_what})", "program_temp",
                       self.temporary)]

    def breakdown(self) -> str:
        """``weights 0.5 GB + caches 38.2 GB (…) + …`` — the terms a user can act on."""
        parts = [f"weights {gb(self.weights)}", f"caches {gb(self.caches)} ({self.caches_what})"]
        if self.growth:
            parts.append(f"growth copy {gb(self.growth)}")
        parts.append(f"outputs {gb(self.outputs)}")
        parts.append(f"largest temporary {gb(self.temporary)} ({self.temporary_what})")
        return " + ".join(parts)


def gb(n: int) -> str:
    """Bytes with three significant digits in decimal units (as device specs state them): GB
    from 1e9 bytes, else MB, else kB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1e3:.3g} kB"


def _nbytes(tree: Any) -> int:
    """Bytes of a pytree of arrays or ShapeDtypeStructs."""
    return sum(int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree))


def attend_calls(model: nnx.Module) -> tuple[list[AttendCall], int]:
    """Every ``attend`` call of ``model`` in execution order, and its vocabulary.

    The model is traced at ``[1, 1]`` (:func:`trace_forward`) and its jaxpr evaluated abstractly
    (``jax.eval_shape``) through the same interpreter the baselines use, which unrolls layer
    loops, so a ``lax.scan`` over 24 layers yields 24 calls. Nothing runs on a device.
    """
    traced = trace_forward(model, 1, 1)
    calls: list[AttendCall] = []

    def hook(index: int, eqn: Any, invals: list[Any]) -> Any:
        q, k, v = invals[:3]
        calls.append(AttendCall(int(q.shape[2]), int(k.shape[2]), int(k.shape[3]),
                                int(v.shape[3]), str(k.dtype), str(v.dtype),
                                repr(eqn.params["pattern"])))
        return attention_p.bind(*invals, **eqn.params)

    _, state = nnx.split(model)
    spec = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    jax.eval_shape(lambda st, t, p, s: eval_jaxpr(
        traced.jaxpr, [*jax.tree_util.tree_leaves(st), t, p, s], hook), state, spec, spec, spec)
    return calls, traced.vocab_size


def _kv_cache_bytes(call: AttendCall, batch: int, slots: int) -> int:
    """One call's cache in the baselines' layout (k, v, positions, segments) at ``slots``."""
    k = jax.ShapeDtypeStruct((batch, 1, call.hkv, call.d), call.k_dtype)
    v = jax.ShapeDtypeStruct((batch, 1, call.hkv, call.dv), call.v_dtype)
    return _nbytes(jax.eval_shape(lambda: PaddedKVCache.like(k, v, slots)))


def _largest(named: Sequence[tuple[str, int]]) -> tuple[str, int]:
    return max(named, key=lambda x: x[1])


def _scores(rows: int, hq: int, queries: int, keys: int) -> int:
    """One attention call's fp32 scores and probabilities (both alive in the reference path)."""
    return 2 * rows * hq * queries * keys * F32


def estimate_sym(model: nnx.Module, batch: int, prompt_len: int, new_tokens: int,
                 cfg: GenerationConfig | None = None, *, name: str = "sym") -> Estimate:
    """The symbolic runtime's estimate (the ``sym`` system's :meth:`estimate`) for ``batch``
    prompts of at most ``prompt_len`` tokens generating ``new_tokens`` (the worst case: every
    prompt at the longest length, every row to its limit). ``cfg`` supplies ``return_logits``,
    ``max_len`` and the prefill chunk rule (default: a config with ``max_new_tokens``);
    ``name`` labels the estimate."""
    cfg = cfg if cfg is not None else GenerationConfig(max_new_tokens=new_tokens)
    return _sym(model, name, batch, prompt_len, new_tokens, cfg)


def estimate_padded(model: nnx.Module, batch: int, prompt_len: int, new_tokens: int,
                    cfg: GenerationConfig | None = None, *, name: str = "padded") -> Estimate:
    """The padded baseline's estimate (arguments as :func:`estimate_sym`)."""
    cfg = cfg if cfg is not None else GenerationConfig(max_new_tokens=new_tokens)
    return _baseline(model, True, batch, prompt_len, new_tokens, cfg, name)


def estimate_pershape(model: nnx.Module, batch: int, prompt_len: int, new_tokens: int,
                      cfg: GenerationConfig | None = None, *, name: str = "pershape"
                      ) -> Estimate:
    """The per-shape baseline's estimate (arguments as :func:`estimate_sym`)."""
    cfg = cfg if cfg is not None else GenerationConfig(max_new_tokens=new_tokens)
    return _baseline(model, False, batch, prompt_len, new_tokens, cfg, name)


def _baseline(model: nnx.Module, padded: bool, b: int, p: int, n: int,
              cfg: GenerationConfig, name: str) -> Estimate:
    """Padded: MAX_LEN = max(max_len, P + N) slots per call, one program (prefill in chunks).
    Per-shape: exact final length P + N - 1, previous caches alive during a step, one-shot
    prefill, every step's outputs kept on device."""
    calls, vocab = attend_calls(model)
    _, state = nnx.split(model)
    slots = max(cfg.max_len or 0, p + n) if padded else p + n - 1
    caches = sum(_kv_cache_bytes(c, b, slots) for c in calls)
    growth = 0 if padded else sum(_kv_cache_bytes(c, b, slots - 1) for c in calls)
    chunk = cfg.prefill_chunk(b, p, vocab) if padded else p
    hq = max((c.hq for c in calls), default=0)
    logits_out = n * b * vocab * F32 if cfg.return_logits else 0
    outputs = n * b * 8 + b * p * 8 + logits_out  # tokens + log-probs, prompts, logits
    what, temp = _largest([
        (f"prefill logits {b}×{chunk}×{vocab} fp32", b * chunk * vocab * F32),
        (f"prefill attention scores over {slots if padded else p} keys",
         _scores(b, hq, chunk, slots if padded else p)),
        (f"decode attention scores over {slots} keys", _scores(b, hq, 1, slots)),
        (f"decode logits {b}×{vocab} fp32", b * vocab * F32),
    ])
    return Estimate(name, _nbytes(state), caches, growth, outputs, temp, what,
                    f"{len(calls)} attention calls × {b} rows × {slots} slots")


def _sym(model: nnx.Module, system: str, b: int, p: int, n: int,
         cfg: GenerationConfig) -> Estimate:
    """The symbolic runtime with its default options: the model traced and planned (no
    program compiled), then :func:`plan_estimate`."""
    program, _, state = trace_model(model)
    return plan_estimate(compile_generation(program), _nbytes(state), b, p, n, cfg,
                         system=system)


def plan_estimate(plan: GenerationPlan, weights_bytes: int, b: int, p: int, n: int,
                  cfg: GenerationConfig, *, system: str = "sym") -> Estimate:
    """The symbolic runtime's bytes for ``b`` prompts of ``p`` tokens generating ``n``: the
    stores as the plan and its host policy size them (:func:`replay`), ``weights_bytes`` of
    weights plus the values the plan hoists."""
    shape, final, previous = _capacities(plan, b, p, n)
    rows = shape.rows
    stores = jax.eval_shape(lambda: plan.builder.init_stores(rows, final))
    growth = max((_nbytes(jax.eval_shape(lambda s=s: s.kind.init(s, rows, previous)))
                  for s in plan.specs.values() if s.kind.grows and previous), default=0)
    hoisted = sum(_nbytes(_node_struct(plan.pdg.node(i)))
                  for i in plan.builder.computed_boundary())
    vocab, pcap = plan.vocab_size, shape.prompt_slots
    tile = plan.tile_buffer(cfg)  # the tile's output buffers
    per_token = 8 + (vocab * F32 if cfg.return_logits else 0)
    what, temp = _largest(_sym_temporaries(plan, shape, final, cfg))
    kinds = ", ".join(sorted({s.kind.name for s in plan.specs.values()}))
    geometry = f"{len(plan.specs)} stores ({kinds}) × {rows} rows"
    if plan.growing:
        geometry += (f", growing capacity {final}" if n <= REPLAY_MAX_TOKENS else
                     f", growing capacity at least {final} (a lower bound: not replayed)")
    return Estimate(system, weights_bytes + hoisted, _nbytes(stores), growth,
                    tile * rows * per_token + rows * pcap * 8, temp, what, geometry)


# Above this many new tokens the policy's replay (one dispatch per decode tile) takes seconds
# to minutes (10**9 tokens: ~25 min); the estimate then sizes growing stores at exactly the
# slots every row needs, a lower bound that is enough to refuse what cannot fit.
REPLAY_MAX_TOKENS = 1 << 20


def _capacities(plan: GenerationPlan, b: int, p: int, n: int) -> tuple[GroupShape, int, int]:
    """The group's shape, and the growing stores' final and previous capacity (0: none), as
    the engine's policy reaches them (every row at its limit); past
    :data:`REPLAY_MAX_TOKENS`, the lower bound ``p + n`` and no previous capacity. A refilling
    engine (``refill`` with ``microbatch_rows`` below ``b``) holds one group of R rows at
    :func:`~jaxrl_sym.runtime.refill.refill_shape`."""
    lens, limits = [p] * b, [n] * b
    opts = plan.options
    if opts.refill and opts.microbatch_rows is not None and b > opts.microbatch_rows:
        # one resident group of R rows, its rings fixed at the longest span: it never grows
        shape = refill_shape(lens, limits, opts.microbatch_rows, plan.row_multiple, opts.max_len)
        return shape, shape.capacity, 0
    shape = GroupShape.plan(lens, limits, min_capacity=opts.min_capacity, max_len=opts.max_len)
    if n > REPLAY_MAX_TOKENS:
        return shape, max(shape.capacity, p + n), 0
    (_, dispatches), = replay(lens, limits, min_capacity=opts.min_capacity, tiling=plan.tiling,
                              need=plan.growing_need, max_pad_fraction=opts.max_pad_fraction,
                              microbatch_rows=None, compaction=plan.compaction)
    caps = [shape.capacity, *(d.capacity for d in dispatches)]
    final = max(caps)
    return shape, final, max((c for c in caps if c < final), default=0)


def _sym_temporaries(plan: GenerationPlan, shape: GroupShape, final: int,
                     cfg: GenerationConfig) -> list[tuple[str, int]]:
    """The symbolic runtime's candidate largest temporaries: logits, and per store the
    attention scores of a prefill chunk and of a decode step."""
    rows, vocab, pcap = shape.rows, plan.vocab_size, shape.prompt_slots
    chunk = cfg.prefill_chunk(rows, pcap, vocab)
    # with a position-wise tail (passes.positions) the head runs on the sampled positions only
    per_row = 1 if plan.builder.tail is not None else chunk
    temps = [(f"prefill logits {rows}×{per_row}×{vocab} fp32", rows * per_row * vocab * F32),
             (f"decode logits {rows}×{vocab} fp32", rows * vocab * F32)]
    for nid, spec in plan.specs.items():
        hq = int(_q_node(plan, nid).shape[2])
        if not spec.kind.keeps_keys:
            temps.append(("linear-attention chunk weights", _scores(rows, hq, chunk, chunk)))
            continue
        keys = _prefill_keys(spec, chunk, single=chunk == pcap, initial=shape.capacity)
        decode_keys = spec.capacity or final
        scores = _scores(rows, hq, chunk, keys)
        if plan.options.prefill == "packed":  # a long packed row attends in query blocks
            scores = min(scores, SCORES_BYTES)
        temps += [(f"prefill attention scores over {keys} keys", scores),
                  (f"decode attention scores over {decode_keys} keys",
                   _scores(rows, hq, 1, decode_keys))]
    return temps


def _prefill_keys(spec: Any, chunk: int, *, single: bool, initial: int) -> int:
    """Keys one prefill chunk attends over in ``StoreKind.attend``: the chunk alone when it is
    the only one and fits (a fresh store), else the store (growing: its initial capacity) plus,
    for rings, the chunk joined to it."""
    cap = spec.capacity or initial
    if spec.kind.prefix:
        return chunk if single else cap
    return chunk if single and chunk <= cap else cap + chunk


def _node_struct(node: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(d) for d in node.shape), node.dtype)


def _q_node(plan: GenerationPlan, nid: int) -> Any:
    """The query operand of attention node ``nid`` in the generation PDG (its head count)."""
    return next(plan.pdg.node(e.src) for e in plan.pdg.in_edges(nid) if e.port == 0)


def memory_limit() -> tuple[int | None, str]:
    """The memory a run may use and where the number comes from: the device's limit where the
    backend reports one (GPU), else the host's physical memory (CPU arrays live there)."""
    limit = device_memory_limit()
    if limit is not None:
        return limit, "device memory limit"
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host memory"
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return None, "unknown"


DECODE_KNOBS = "--batch or --tokens (or --prompt-len)"  # what the decode CLI's user lowers


def refusal(est: Estimate, limit: int, source: str, lower: str = DECODE_KNOBS) -> str:
    """Why ``est`` is refused and what to lower (``lower``: the caller's flags), with the
    breakdown."""
    return (f"{est.system}: estimated {gb(est.total)} > {source} {gb(limit)}: "
            f"{est.breakdown()}. Lower {lower}, or pass --no-memory-check to run anyway.")


def check_request(estimates: Sequence[Estimate], limit: int | None = None,
                  lower: str = DECODE_KNOBS) -> dict[str, Any]:
    """Whether each system's estimate for one request fits: the memory check the CLI runs
    before it starts any system (JSON-ready). The estimates come from the bound systems
    (:meth:`jaxrl_sym.systems.bound.BoundSystem.estimate`).

    ``limit``: bytes a run may use (default :func:`memory_limit`). Returns ``limit``,
    ``limit_source`` and per system ``estimate`` (:meth:`Estimate.to_dict`) and ``refused`` (the
    :func:`refusal` message, or None when it fits or no limit is known).
    """
    source = "--memory-limit"
    if limit is None:
        limit, source = memory_limit()
    out: dict[str, Any] = {"limit": limit, "limit_source": source, "systems": {}}
    for est in estimates:
        too_big = limit is not None and est.total > limit
        out["systems"][est.system] = {"estimate": est.to_dict(),
                                      "refused": refusal(est, limit, source, lower)
                                      if too_big else None}
    return out
