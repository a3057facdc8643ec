"""Packed prefill: a group's prompts bin-packed into rows, written into the right-aligned stores.

Why: the block prefill pushes a rectangle ``[row bucket, prompt block]`` through the model, so a
group whose prompts range from 64 to 512 tokens computes every short prompt's left padding and
every filler row of its bucket. On the suite's realistic lengths that was 24% of all token
positions the runtime computed (the engine's own log, ``waste_by_cause``: prompt alignment 9%,
row-bucket filler 15%). Packed, the prefill computes the prompts' tokens and the packing's tail.

How: prompts are packed first-fit-decreasing into rows of the longest prompt's bucketed length
(:data:`PACK_ROW`), about ``total / longest`` of them, as the training forward packs sequences;
the model runs on those rows with segment ids, so the attention primitive masks across prompts;
each attention node's keys and values are then scattered into its store by the store's own
:meth:`StoreKind.fill` at each token's right-aligned slot (the decode steps that follow are
unchanged: every row still writes slot ``pcap + s - 1`` at step s). Row ``r``'s first token is
sampled from the logits at its last prompt token. A prompt that repeats (RL samples G responses
per prompt) is packed once and its rows copied into the repeats' store rows, so a GRPO rollout's
prefill computes 1/G of the prompt tokens that padded and Tunix compute.
Large vocabularies: the packed rows run in chunks whose logits fit the generation config's
budget, scanned through the stores.

Attention inside the prefill is the masked primitive over each packed row (``L^2`` scores per
row), on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_sym.ops.sampling import sample
from jaxrl_sym.passes.stores import take_rows
from jaxrl_sym.runtime.evaluate import bind, evaluate
from jaxrl_sym.runtime.policy import length_bucket

PACK_ROW: int | None = None
"""Target packed row length; None: the longest prompt's (on the length grid). Why that short:
attention inside the prefill is the masked primitive over each packed row, ``L^2`` scores per
row, so a request's attention work is about ``total * L`` — rows of 1,024 made the prefill of
``bench/rlft_step.py``'s rollout (128 prompts of 8–64 tokens, CPU preset) 4–5× slower than the
whole padded generation; rows of the longest prompt cut that request's generation from 12–14 s
to 2–3 s (same machine, same run). Short prompts still share rows (first-fit-decreasing)."""

PACK_PER_OCTAVE = 16
"""Packed row lengths lie on a geometric grid of 16 steps per octave (tail ≤ 1/16 of a row).
Why this grid: the prefill program is compiled per (rows, length), so the grid bounds the
programs an RL run meets as prompt totals drift (about 16 per doubling of the total), while 4
per octave left 5.1% of the suite's realistic request's positions as packing tail."""

PACK_MIN = 32
"""Shortest packed row; with the default rows, a request whose prompts total at most this many
tokens packs into one row of it, so such requests share one program instead of compiling one
per total or per row count (both grids are 1 apart there; ``tests/test_policy.py``'s RL steps
with drifting lengths). Above it, the row length follows
the total on the 16-per-octave grid: an RL run whose prompt totals drift meets a bounded set of
prefill programs, about 16 per doubling of the total, each compiled once."""

PACK_TRIES = 4
"""Grid steps a row may lengthen so the prompts fit ``ceil(total / row)`` rows before
one more row is taken: first-fit-decreasing needs some slack, and an extra row left most of a
row empty (the old packing wasted up to 54% of a prefill that way)."""


def _ffd(order: Sequence[int], size: Sequence[int], length: int
         ) -> tuple[dict[int, tuple[int, int]], list[int]]:
    """First-fit-decreasing of items ``order`` (longest first) into rows of ``length``."""
    fill: list[int] = []
    place: dict[int, tuple[int, int]] = {}
    for i in order:
        n = size[i]
        r = next((r for r, used in enumerate(fill) if used + n <= length), len(fill))
        if r == len(fill):
            fill.append(0)
        place[i] = (r, fill[r])
        fill[r] += n
    return place, fill


def _pack(order: Sequence[int], size: Sequence[int], lens: Sequence[int], pack_row: int
          ) -> tuple[int, dict[int, tuple[int, int]], list[int]]:
    """Row length and placement: the shortest grid length (within :data:`PACK_TRIES` steps of
    an even split) at which the prompts fit ``ceil(total / pack_row)`` rows; else more rows."""
    n_rows = -(-sum(lens) // pack_row)
    floor = min(PACK_MIN, pack_row)
    first = length = length_bucket(max(max(lens), -(-sum(lens) // n_rows)),
                                   per_octave=PACK_PER_OCTAVE, minimum=floor)
    for _ in range(PACK_TRIES):
        place, fill = _ffd(order, size, length)
        if len(fill) <= n_rows:
            return length, place, fill
        length = length_bucket(length + 1, per_octave=PACK_PER_OCTAVE, minimum=floor)
    place, fill = _ffd(order, size, first)
    return first, place, fill


@dataclass(frozen=True)
class PackedPrompts:
    """Host arrays of one group's packed prompts (rows a multiple of the chunk's rows).

    tokens/positions ``[Rp, L]``; ``rows`` ``[Rp, L]``: the batch slot each token belongs to
    (-1 = packing tail); ``slots``: its right-aligned store slot ``pcap - len + j``; ``last``
    ``[R]``: flat index (into ``Rp * L``) of each batch slot's last prompt token (0 for filler
    slots, whose sample is never read); ``source`` ``[R]``: the batch slot whose store row each
    slot copies after the prefill (itself unless its prompt repeats an earlier slot's).
    """

    tokens: np.ndarray
    positions: np.ndarray
    rows: np.ndarray
    slots: np.ndarray
    last: np.ndarray
    source: np.ndarray
    chunk_rows: int  # packed rows per chunk (divides the row count)

    @property
    def positions_computed(self) -> int:
        return int(self.tokens.size)

    @property
    def shared(self) -> bool:
        """Some slot's prompt repeats another's, so its store row is copied, not computed."""
        return bool((self.source != np.arange(len(self.source))).any())

    @property
    def prompt_tokens(self) -> int:
        """Tokens the model must compute: each distinct prompt once."""
        return int((self.rows >= 0).sum())

    @staticmethod
    def build(prompts: Sequence[np.ndarray | None], pcap: int, *, vocab: int,
              logits_bytes: int, pack_row: int | None = PACK_ROW) -> PackedPrompts:
        """Pack the prompts of batch slots ``0..R-1`` (None: a filler slot); chunks of packed
        rows keep their fp32 logits under ``logits_bytes``. The row count is rounded up on the
        16-per-octave grid (empty rows are packing tail), so requests whose prompt totals drift
        share prefill programs.

        Identical prompts (a GRPO group's G samples of one prompt) are packed once: the copies'
        ``source`` names the first slot holding that prompt, their ``last`` its last token, so
        they sample from the same logits with their own row's random stream."""
        source = _first_copies(prompts)
        prompts = [p if source[i] == i else None for i, p in enumerate(prompts)]
        lens = [len(p) for p in prompts if p is not None]
        order = sorted((i for i, p in enumerate(prompts) if p is not None),
                       key=lambda i: -len(prompts[i]))
        # default rows: the longest prompt's; a request of at most PACK_MIN tokens: one row
        row = pack_row or (PACK_MIN if sum(lens) <= PACK_MIN else max(lens))
        length, place, fill = _pack(order, [len(p) if p is not None else 0 for p in prompts],
                                    lens, row)
        used = length_bucket(len(fill), per_octave=PACK_PER_OCTAVE, minimum=1)
        g = max(1, min(logits_bytes // (4 * length * vocab), used))
        n_rows = -(-used // g) * g
        tokens = np.zeros((n_rows, length), np.int32)
        positions = np.full((n_rows, length), -1, np.int32)
        rows = np.full((n_rows, length), -1, np.int32)
        slots = np.full((n_rows, length), -1, np.int32)
        last = np.zeros((len(prompts),), np.int32)
        for i, (r, s) in place.items():
            p = prompts[i]
            n = len(p)
            tokens[r, s:s + n] = p
            positions[r, s:s + n] = np.arange(n)
            rows[r, s:s + n] = i
            slots[r, s:s + n] = pcap - n + np.arange(n)
            last[i] = r * length + s + n - 1
        last = last[source]
        return PackedPrompts(tokens, positions, rows, slots, last, source, g)


def _first_copies(prompts: Sequence[np.ndarray | None]) -> np.ndarray:
    """For each slot, the first slot whose prompt has the same tokens (itself if none; filler
    slots are their own)."""
    first: dict[bytes, int] = {}
    source = np.arange(len(prompts), dtype=np.int32)
    for i, p in enumerate(prompts):
        if p is not None:
            source[i] = first.setdefault(np.asarray(p, np.int32).tobytes(), i)
    return source


def packed_prefill(builder: Any, hoisted: tuple[jax.Array, ...], stores: dict[str, Any],
                   tokens: jax.Array, positions: jax.Array, rows: jax.Array, slots: jax.Array,
                   last: jax.Array, source: jax.Array, row_ids: jax.Array, seed: jax.Array, *,
                   temperature: float, want_logits: bool, chunk_rows: int, shared: bool
                   ) -> tuple[Any, ...]:
    """Fill empty stores from packed prompts; sample every row's token 0 (a jitted program).

    ``shared``: some rows repeat another row's prompt; their store rows are gathered from
    ``source`` once the distinct prompts have run (the stores' own row gather, as compaction).

    Returns (stores, tokens [R], log-probs [R], last-token logits [R, V] or an empty array).
    """
    pdg = builder.pdg
    n_chunks = tokens.shape[0] // chunk_rows
    split = lambda x: x.reshape(n_chunks, chunk_rows, *x.shape[1:])
    vocab = int(pdg.node(pdg.outputs[0]).shape[-1])
    batch = last.shape[0]

    def body(carry, chunk):
        st, best = carry
        tok_c, pos_c, row_c, slot_c, start = chunk
        st, logits = _evaluate_chunk(builder, hoisted, st, tok_c, pos_c, row_c, slot_c, batch)
        flat = logits.reshape(-1, vocab)
        idx = last - start * tokens.shape[1]
        here = (idx >= 0) & (idx < flat.shape[0])
        picked = jnp.take(flat, jnp.clip(idx, 0, flat.shape[0] - 1), axis=0)
        return (st, jnp.where(here[:, None], picked.astype(jnp.float32), best)), None

    init = (stores, jnp.zeros((batch, vocab), jnp.float32))
    starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk_rows
    (stores, logits), _ = lax.scan(body, init, (split(tokens), split(positions), split(rows),
                                                split(slots), starts))
    if shared:
        stores = {k: take_rows(s, source) for k, s in stores.items()}
    steps = jnp.zeros((batch,), jnp.int32)
    tok, lp = sample(logits, seed=seed, steps=steps, row_ids=row_ids, temperature=temperature)
    zero = jnp.zeros((), jnp.int32)
    for nid, sp in builder.slots.items():
        stores = {**stores, str(nid): sp.kind.write(sp, stores[str(nid)], tok, zero)}
    # with a mesh: the stores leave split over its data axes, as every step program takes them
    return builder.rows(stores), tok, lp, (logits if want_logits else jnp.zeros((0,), jnp.float32))


def _evaluate_chunk(builder: Any, hoisted: tuple[jax.Array, ...], stores: dict[str, Any],
                    tokens: jax.Array, positions: jax.Array, rows: jax.Array, slots: jax.Array,
                    batch: int) -> tuple[dict[str, Any], jax.Array]:
    """The model on packed rows; each attention node attends within them (masked primitive)
    and its store takes the rows' keys/values (``StoreKind.fill``)."""
    new = dict(stores)
    target = jnp.where(rows >= 0, rows, batch).reshape(-1)  # out of range: dropped
    flat_slots = slots.reshape(-1)

    def attn(node: Any, args: list[jax.Array]) -> jax.Array:
        spec = builder.specs[node.id]
        k, v, k_pos = args[1], args[2], args[4]
        new[str(node.id)] = spec.kind.fill(
            spec, stores[str(node.id)], k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            k_pos.reshape(-1), target, flat_slots)
        return bind(node, args)  # attention within the packed rows: the masked primitive

    segments = jnp.where(rows >= 0, rows, batch)
    out = evaluate(builder.pdg, builder.static_values(hoisted), tokens, positions, segments,
                   attention=attn, dynamic_only=True)
    return new, out[builder.pdg.outputs[0]][0]
