"""The store kinds the storage plan chooses among: exact-size stores for attention keys/values.

Why here, beside the storage pass (:mod:`jaxrl_sym.passes.storage`), and not in the runtime:
the plan names a kind by the object itself (``StorePlan.kind`` is one of the singletons below),
so the pass that chooses and the runtime that runs a store share one table and no kind name is
compared as a string. Each kind owns its device behaviour; the runtime only calls it.

Layouts (per attention node, pytrees of arrays; batch axis first so rows can be compacted):

- growing / fixed: ``k, v [B, Hkv, C, D]`` (heads-major, see below), ``pos [B, C]`` (-1 =
  empty). Chunk written at slot ``write_index``; capacity C grows (geometric, 1.33-1.5x) when
  full — a new XLA program per capacity, not per length.
- ring (window w) / block (b): the same arrays with C = w (resp. b) slots; step ``s`` goes to slot
  ``s mod C``. Slots are out of order; attention masks by stored *position*, so order is
  irrelevant and no contiguous copy (Tempo's 2×window trick) is needed.
- state (linear attention): ``S [B, Hkv, D, Dv]``, ``z [B, Hkv, D]`` — the recurrence of Eq. 2.
- slot (the generation loop's ``t-1`` feedback edge): ``tok [B, lag]``, the sampled tokens the
  next steps read as their input.

Why heads-major keys and values: attention reads a store as a batched matmul over (row, kv head),
and XLA:GPU wants those batch dimensions outermost. With slots outside the heads (``[B, C, Hkv,
D]``, the model's own ``[B, T, H, D]``) it kept a transposed copy of every store as the decode
tile's loop state — compiled for the H100 at Qwen2.5-0.5B's shape, the decode tile's
temporaries were as large as the stores themselves (twice the store memory, and the copy in and
out on every tile; ``bench/results/projection.md``); heads-major, the loop updates the stores in
place (``tests/test_store_layout.py``). Chunks arrive ``[B, c, Hkv, D]`` and are written through
:func:`_heads`; reads see the model's layout through :func:`_keys` (a transpose XLA folds into
the matmul).

Each kind is a :class:`StoreKind` that owns its behaviour (init, chunk read/write, growth, the
slots one step reads); :data:`GROWING`, :data:`FIXED`, :data:`RING`, :data:`BLOCK`, :data:`STATE`
and :data:`SLOT` are the kinds (:data:`STORE_KINDS` lists them). Adding a store kind is one class
here and the planner's rule for it. Everything except ``StoreKind.slots`` runs inside a jitted
step program.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_sym.backends import decode, triton_ops
from jaxrl_sym.errors import InputError
from jaxrl_sym.ops.attention import Pattern, phi, reference_attention

Store = dict[str, jax.Array]


class CannotSpeculate(InputError):
    """A store kind that cannot take back a rejected draft (a recurrent state) was asked to
    speculate; its own type, so that a draft model's refusal can name the draft."""


@dataclass(frozen=True)
class StoreSpec:
    """Concrete store layout for one attention node (static: part of the compile key)."""

    node: int
    kind: StoreKind  # the behaviour: one of STORE_KINDS' values
    capacity: int | None  # slots for ring/block/fixed; None for growing (runtime picks)
    hkv: int
    d: int
    dv: int
    dtype: Any
    pattern: Pattern
    scale: float
    softcap: float = 0.0  # attention-logit soft-capping (0 = none)
    backend: str = "xla"  # "xla" | "triton" | "pallas": who computes single-token decode attention
    live: Callable[[jax.Array], tuple[jax.Array]] | None = None  # the plan's live-slot count

    @property
    def decode_kernel(self) -> Callable[..., jax.Array] | None:
        """The kernel single-token steps run (:func:`jaxrl_sym.backends.decode.kernel_for`), or
        None for the masked XLA path (same result)."""
        return decode.kernel_for(self.backend, self.pattern, self.d, self.dv)

    def scoring(self) -> dict[str, Any]:
        """The attention op's keyword arguments (pattern, scale, softcap) for this store."""
        return {"pattern": self.pattern, "scale": self.scale, "softcap": self.softcap}


def take_rows(store: Store, rows: jax.Array) -> Store:
    """Keep only the given rows (batch compaction when rows finish)."""
    return {k: jnp.take(v, rows, axis=0) for k, v in store.items()}


def _zeros_seg(pos: jax.Array) -> jax.Array:
    return jnp.zeros_like(pos)


def _linear_chunk(
    spec: StoreSpec, store: Store, q: jax.Array, k: jax.Array, v: jax.Array,
    q_pos: jax.Array, k_pos: jax.Array,
) -> tuple[jax.Array, Store]:
    """Linear attention for a chunk: the state covers the past, a masked sum the chunk."""
    b, c, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    pq = phi(q.reshape(b, c, hkv, g, d).astype(jnp.float32))
    kvalid = (k_pos >= 0)[..., None, None]
    pk = jnp.where(kvalid, phi(k.astype(jnp.float32)), 0.0)  # b c h d
    vf = jnp.where(kvalid, v.astype(jnp.float32), 0.0)
    mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)  # b q k
    w = jnp.einsum("bqhgd,bkhd->bhgqk", pq, pk) * mask[:, None, None]
    num = jnp.einsum("bhgqk,bkhe->bqhge", w, vf) + jnp.einsum("bqhgd,bhde->bqhge", pq, store["S"])
    den = jnp.einsum("bhgqk->bqhg", w) + jnp.einsum("bqhgd,bhd->bqhg", pq, store["z"])
    den = den[..., None]
    out = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    out = jnp.where((q_pos >= 0)[:, :, None, None, None], out, 0.0)
    new = {
        "S": store["S"] + jnp.einsum("bkhd,bkhe->bhde", pk, vf),
        "z": store["z"] + jnp.sum(pk, axis=1),
    }
    return out.reshape(b, c, hq, v.shape[-1]).astype(q.dtype), new


def _heads(x: jax.Array) -> jax.Array:
    """A chunk's ``[B, c, Hkv, D]`` keys or values in the store's heads-major ``[B, Hkv, c, D]``."""
    return jnp.swapaxes(x, 1, 2)


def _keys(store: Store) -> tuple[jax.Array, jax.Array]:
    """A store's keys and values as attention reads them, ``[B, C, Hkv, D]`` (a transpose that
    XLA folds into the matmuls: no copy)."""
    return jnp.swapaxes(store["k"], 1, 2), jnp.swapaxes(store["v"], 1, 2)


def _write(store: Store, k: jax.Array, v: jax.Array, pos: jax.Array, slot: jax.Array) -> Store:
    """Write a contiguous run of ``[B, c, Hkv, D]`` entries at ``slot`` (in place when the store
    is donated)."""
    zero = jnp.zeros((), jnp.int32)
    return {
        "k": lax.dynamic_update_slice(store["k"], _heads(k).astype(store["k"].dtype),
                                      (zero, zero, slot, zero)),
        "v": lax.dynamic_update_slice(store["v"], _heads(v).astype(store["v"].dtype),
                                      (zero, zero, slot, zero)),
        "pos": lax.dynamic_update_slice(store["pos"], pos, (zero, slot)),
    }


def _scatter(store: Store, k: jax.Array, v: jax.Array, pos: jax.Array, rows: jax.Array,
             slots: jax.Array) -> Store:
    """Token i (``k, v [N, Hkv, D]``) to row ``rows[i]``, slot ``slots[i]``; rows out of range
    (packing tail) are dropped."""
    rows = jnp.where((rows >= 0) & (slots >= 0), rows, store["pos"].shape[0])
    slots = jnp.maximum(slots, 0)
    # [rows, :, slots] selects [N, Hkv, D]: the indexed axes go first (numpy's rule)
    return {"k": store["k"].at[rows, :, slots].set(k.astype(store["k"].dtype), mode="drop"),
            "v": store["v"].at[rows, :, slots].set(v.astype(store["v"].dtype), mode="drop"),
            "pos": store["pos"].at[rows, slots].set(pos, mode="drop")}


def _kv_arrays(spec: StoreSpec, batch: int, capacity: int) -> Store:
    return {
        "k": jnp.zeros((batch, spec.hkv, capacity, spec.d), spec.dtype),
        "v": jnp.zeros((batch, spec.hkv, capacity, spec.dv), spec.dtype),
        "pos": jnp.full((batch, capacity), -1, jnp.int32),
    }


def _masked(spec: StoreSpec, q: jax.Array, q_pos: jax.Array, store: Store) -> jax.Array:
    """Attention of the chunk's queries over every slot of ``store`` (masked by position)."""
    return reference_attention(q, *_keys(store), q_pos, store["pos"], _zeros_seg(q_pos),
                               _zeros_seg(store["pos"]), **spec.scoring())


def _fresh(spec: StoreSpec, store: Store, args: list[jax.Array]) -> tuple[jax.Array, Store]:
    """The first chunk into an empty store: attention needs only the chunk; its last
    ``min(c, capacity)`` entries are written from slot 0."""
    q, k, v, q_pos, k_pos = args[:5]
    c, cap = q.shape[1], store["pos"].shape[1]
    out = reference_attention(q, k, v, q_pos, k_pos, _zeros_seg(q_pos), _zeros_seg(k_pos),
                              **spec.scoring())
    m = min(c, cap)
    return out, _write(store, k[:, c - m:], v[:, c - m:], k_pos[:, c - m:],
                       jnp.zeros((), jnp.int32))


class StoreKind:
    """A kind of store: owns its arrays' layout, how a chunk reads and writes it, how it grows
    and how many key slots one step reads. One instance per kind in :data:`STORE_KINDS`; the
    storage plan names the kind, the runtime looks its behaviour up here (no string compares).

    Every method runs inside a jitted step program except :meth:`slots` (host integers).
    """

    name: ClassVar[str]
    grows: ClassVar[bool] = False  # whether the host grows it as rows get longer
    prefix: ClassVar[bool] = False  # keeps every key from position 0 (growing, fixed)
    keeps_keys: ClassVar[bool] = True  # False: folds keys into a state, or holds none (slot)

    def init(self, spec: StoreSpec, batch: int, capacity: int) -> Store:
        return _kv_arrays(spec, batch, capacity)

    def attend(self, spec: StoreSpec, store: Store, args: list[jax.Array],
               write_index: jax.Array, *, fresh: bool) -> tuple[jax.Array, Store]:
        """One attention node for a chunk: read the store, add the chunk, return the new store.

        args: the primitive's operands for the chunk (q, k, v, q_pos, k_pos, q_seg, k_seg,
        [B, c, …]); ``write_index``: slot of the chunk's first element (a device scalar, so one
        program serves every step); ``fresh`` (static): the store is empty (first prompt chunk).
        """
        raise NotImplementedError

    def fill(self, spec: StoreSpec, store: Store, k: jax.Array, v: jax.Array, pos: jax.Array,
             rows: jax.Array, slots: jax.Array) -> Store:
        """Write packed prompt tokens (``k, v [N, Hkv, D]``, ``pos [N]``) into an empty store:
        token i goes to row ``rows[i]`` (out of range: dropped) at absolute slot ``slots[i]``
        (the right-aligned prompt block's). Used by the packed prefill
        (:mod:`jaxrl_sym.runtime.prefill`); every (row, slot) is written at most once."""
        return _scatter(store, k, v, pos, rows, slots)

    def reset(self, spec: StoreSpec, store: Store, rows: jax.Array) -> Store:
        """Empty the rows where ``rows`` (``[B]`` bool) is set, so a waiting sample can take
        them (refill, :mod:`jaxrl_sym.runtime.refill`): every slot's position becomes -1, which
        every read masks; the keys and values stay as they are and are never read."""
        return {**store, "pos": jnp.where(rows[:, None], -1, store["pos"])}

    def capacity(self, spec: StoreSpec, group_capacity: int) -> int:
        """Slots to allocate for a group whose growing capacity is ``group_capacity``: the
        planned size where the plan fixed one (ring, block), else the group's."""
        return spec.capacity or group_capacity

    def grow(self, store: Store, capacity: int) -> Store:
        raise TypeError(f"a {self.name} store has a fixed size; only growing stores grow")

    def slots(self, spec: StoreSpec, capacity: int) -> int:
        """Key slots one decode step reads for one row (the cost a benchmark counts)."""
        return capacity

    def speculative_capacity(self, spec: StoreSpec, k: int) -> int | None:
        """The planned size when verify steps write ``k + 1`` entries per row (speculative
        decoding, :mod:`jaxrl_sym.runtime.speculative.lm`): unchanged for stores that keep every
        key; a kind that evicts or folds keys says what it needs, or refuses."""
        return spec.capacity

    def verify(self, spec: StoreSpec, store: Store, args: list[jax.Array], slots: jax.Array
               ) -> tuple[jax.Array, Store]:
        """A speculative verify chunk: row b's ``c`` entries go to its own ``slots[b]`` (``-1``
        or past the end: dropped), then every query attends over the store.

        Why no roll-back: a row's slot is its position plus a per-row constant, so entries of
        rejected drafts sit exactly where the row's next verify writes (it starts at the first
        rejected position and covers at least as many), and they are overwritten before that
        verify attends. Writing first keeps one masked pass per chunk.
        """
        q, k, v, q_pos, k_pos = args[:5]
        b, c = k_pos.shape
        flat = lambda x: x.reshape(b * c, *x.shape[2:])
        rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), c)
        new = _scatter(store, flat(k), flat(v), flat(k_pos), rows, self._slot(store, slots).ravel())
        return _masked(spec, q, q_pos, new), new

    def _slot(self, store: Store, slots: jax.Array) -> jax.Array:
        """Where logical slot ``slots`` lives in this store (identity; a ring wraps)."""
        return slots

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)

    def __eq__(self, other: object) -> bool:
        """Kinds are singletons, equal by class; never equal to a name (compare objects: a
        string compare is how the plan's kinds drifted apart before)."""
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(self.name)


class GrowingStore(StoreKind):
    """Full (prefix) attention: ``k, v [B, Hkv, C, D]``, ``pos [B, C]``; chunk written at slot
    ``write_index``; capacity C grows (geometric, 1.33-1.5x) when full — one program per capacity.

    A single step's slot wraps modulo C, so a group that refills finished rows can keep its
    stores at a fixed C that covers one row's span (prompt + response) however long the group
    lives: a refilled row's slots then wrap over its predecessor's, which the refill reset.
    Without refill the host grows C before a write would wrap, so the wrap never happens."""

    name = "growing"
    grows = True
    prefix = True

    def attend(self, spec, store, args, write_index, *, fresh):
        q, k, v, q_pos, k_pos = args[:5]
        if fresh:
            return _fresh(spec, store, args)
        slot = write_index % store["pos"].shape[1] if q.shape[1] == 1 else write_index
        if q.shape[1] == 1 and decode.writes_entry(spec):
            return decode.write_and_attend(spec, store, q, k, v, q_pos, k_pos, slot, write_index)
        new = _write(store, k, v, k_pos, slot)
        if spec.decode_kernel is not None and q.shape[1] == 1:
            # the live count of the unwrapped index: once wrapped, every slot is live
            return decode.live_slots(spec, new, q, q_pos, write_index), new
        return _masked(spec, q, q_pos, new), new  # write first, then one masked pass

    def grow(self, store, capacity):
        """Pad to a larger capacity (empty slots get position -1)."""
        extra = capacity - store["pos"].shape[1]
        pad4 = ((0, 0), (0, 0), (0, extra), (0, 0))
        return {"k": jnp.pad(store["k"], pad4), "v": jnp.pad(store["v"], pad4),
                "pos": jnp.pad(store["pos"], ((0, 0), (0, extra)), constant_values=-1)}

    def fill(self, spec, store, k, v, pos, rows, slots):
        """As any store, but a slot past the end wraps (a refilled prompt in a ring); a
        speculative verify's slots past the end stay dropped (``_slot`` is the identity)."""
        return _scatter(store, k, v, pos, rows, jnp.where(slots >= 0,
                                                          slots % store["pos"].shape[1], -1))


class FixedStore(GrowingStore):
    """A growing store the user sized (``max_len``): same reads and writes, never grows."""

    name = "fixed"
    grows = False

    def capacity(self, spec, group_capacity):
        # The group's, not the plan's max_len: the group adds its prompt block's left padding
        # (GroupShape.plan), without which the last writes of a row whose prompt is shorter
        # than the block would land past the store's end (and be clamped over older slots).
        return group_capacity

    def grow(self, store, capacity):
        return StoreKind.grow(self, store, capacity)


class RingStore(StoreKind):
    """Window attention: C = w slots; step ``s`` goes to slot ``s mod C``. Slots are out of order;
    attention masks by stored *position*, so no contiguous copy (Tempo's 2×window trick)."""

    name = "ring"

    def attend(self, spec, store, args, write_index, *, fresh):
        q, k, v, q_pos, k_pos = args[:5]
        c, cap = q.shape[1], store["pos"].shape[1]
        if fresh and c <= cap:
            return _fresh(spec, store, args)
        if c == 1:
            if decode.writes_entry(spec):
                return decode.write_and_attend(spec, store, q, k, v, q_pos, k_pos,
                                               write_index % cap, write_index)
            new = _write(store, k, v, k_pos, write_index % cap)
            if spec.decode_kernel is not None:
                return decode.live_slots(spec, new, q, q_pos, write_index), new
            return _masked(spec, q, q_pos, new), new
        # A chunk longer than one step: attend over ring ∪ chunk, then keep the chunk's tail.
        joined = {"k": jnp.concatenate([store["k"], _heads(k).astype(store["k"].dtype)], axis=2),
                  "v": jnp.concatenate([store["v"], _heads(v).astype(store["v"].dtype)], axis=2),
                  "pos": jnp.concatenate([store["pos"], k_pos], axis=1)}
        out = _masked(spec, q, q_pos, joined)
        m = min(c, cap)
        slots = (write_index + (c - m) + jnp.arange(m, dtype=jnp.int32)) % cap
        new = {"k": store["k"].at[:, :, slots].set(_heads(k[:, c - m:]).astype(store["k"].dtype)),
               "v": store["v"].at[:, :, slots].set(_heads(v[:, c - m:]).astype(store["v"].dtype)),
               "pos": store["pos"].at[:, slots].set(k_pos[:, c - m:])}
        return out, new


    def fill(self, spec, store, k, v, pos, rows, slots):
        """Only each row's last C prompt tokens, at ``slot mod C`` (as decode writes them); the
        block's right-aligned slots end at ``pcap - 1`` for every row, so "last C" is
        ``slot >= max slot - C + 1`` with no per-row bookkeeping."""
        cap = store["pos"].shape[1]
        top = jnp.max(slots)
        keep = slots > top - cap
        return _scatter(store, k, v, pos, jnp.where(keep, rows, store["pos"].shape[0]),
                        slots % cap)

    def speculative_capacity(self, spec, k):
        """``size + k``: a verify chunk writes ``k + 1`` entries before attending, so its first
        query (position P) still finds keys back to ``P - size + 1`` after the wrap."""
        return spec.capacity + k

    def _slot(self, store, slots):
        return jnp.where(slots >= 0, slots % store["pos"].shape[1], -1)


class BlockStore(RingStore):
    """Block attention: a ring of b slots; the pattern's mask drops the previous block's keys."""

    name = "block"


class StateStore(StoreKind):
    """Linear attention: ``S [B, Hkv, D, Dv]``, ``z [B, Hkv, D]`` — the recurrence of Eq. 2; the
    prefix read is consumed by a kernelised sum, so no key is kept."""

    name = "state"
    keeps_keys = False

    def init(self, spec, batch, capacity):
        return {"S": jnp.zeros((batch, spec.hkv, spec.d, spec.dv), jnp.float32),
                "z": jnp.zeros((batch, spec.hkv, spec.d), jnp.float32)}

    def attend(self, spec, store, args, write_index, *, fresh):
        q, k, v, q_pos, k_pos = args[:5]
        if spec.backend == "triton" and q.shape[1] == 1 and not fresh:
            out, s_new, z_new = triton_ops.linear_decode(q[:, 0], k[:, 0], v[:, 0], store["S"],
                                                         store["z"])
            return out[:, None], {"S": s_new, "z": z_new}
        return _linear_chunk(spec, store, q, k, v, q_pos, k_pos)

    def fill(self, spec, store, k, v, pos, rows, slots):
        """The recurrence over each row's prompt at once: per-row sums of phi(k) v^T, phi(k)."""
        b = store["S"].shape[0]
        valid = (pos >= 0) & (rows >= 0) & (rows < b)
        pk = jnp.where(valid[:, None, None], phi(k.astype(jnp.float32)), 0.0)
        vf = jnp.where(valid[:, None, None], v.astype(jnp.float32), 0.0)
        seg = jnp.where(valid, rows, b)
        sums = jax.ops.segment_sum(jnp.einsum("nhd,nhe->nhde", pk, vf), seg, num_segments=b + 1)
        zs = jax.ops.segment_sum(pk, seg, num_segments=b + 1)
        return {"S": store["S"] + sums[:b], "z": store["z"] + zs[:b]}

    def reset(self, spec, store, rows):
        return {"S": jnp.where(rows[:, None, None, None], 0.0, store["S"]),
                "z": jnp.where(rows[:, None, None], 0.0, store["z"])}

    def slots(self, spec, capacity):
        return 1

    def speculative_capacity(self, spec, k):
        """Refused: the state folds every key in, so a rejected draft cannot be taken out (a
        roll-back would need a copy of S, z per draft position)."""
        raise CannotSpeculate(
            f"speculate={k}: attention node %{spec.node} uses the {spec.pattern.name!r} pattern, "
            "whose recurrent state cannot roll back rejected draft tokens; use speculate=0 "
            "(plain decoding) for this model")


@dataclass(frozen=True)
class SlotSpec:
    """The feedback edge's store (``tok[t] = sample(logits[t-lag])``): which input it feeds,
    which node's output it keeps and for how many steps. Static: part of the compile key."""

    node: int  # the input node the edge feeds (the tokens)
    source: int  # the node whose output is fed back (sample)
    lag: int
    kind: SlotStore


class SlotStore(StoreKind):
    """The feedback edge: ``tok [B, lag]`` int32, a ring of the last ``lag`` sampled tokens of
    each row. Sample ``s`` is written to slot ``s mod lag``; decode step ``s`` reads sample
    ``s - lag`` from the same slot before the step overwrites it. The generation loop's edge has
    lag 1: the token fed to step ``s`` is the one step ``s - 1`` sampled. A decode group
    compacting rebuilds a lag-1 edge from the tokens the host read back (one program less per
    compaction); other lags keep their rows like any store's."""

    name = "slot"
    keeps_keys = False

    def init(self, spec, batch, capacity):
        return {"tok": jnp.zeros((batch, spec.lag), jnp.int32)}

    def read(self, spec: SlotSpec, store: Store, step: jax.Array) -> jax.Array:
        """The fed-back input for decode step ``step``: ``[B, 1]`` tokens."""
        return lax.dynamic_index_in_dim(store["tok"], step % spec.lag, axis=1, keepdims=True)

    def write(self, spec: SlotSpec, store: Store, value: jax.Array, step: jax.Array) -> Store:
        """Keep sample ``step`` (``[B]``) for the step ``lag`` later."""
        zero = jnp.zeros((), jnp.int32)
        return {"tok": lax.dynamic_update_slice(store["tok"], value[:, None].astype(jnp.int32),
                                                (zero, step % spec.lag))}

    def reset(self, spec, store, rows):
        return store  # the refill program writes the refilled rows' token 0

    def attend(self, spec, store, args, write_index, *, fresh):
        raise TypeError("a slot store feeds a token back; it holds no keys")

    def slots(self, spec, capacity):
        return 0


GROWING, FIXED, RING, BLOCK, STATE, SLOT = (GrowingStore(), FixedStore(), RingStore(),
                                           BlockStore(), StateStore(), SlotStore())
STORE_KINDS: tuple[StoreKind, ...] = (GROWING, FIXED, RING, BLOCK, STATE, SLOT)
"""Every store kind, one instance each: what ``StorePlan.kind`` holds and the runtime runs."""
