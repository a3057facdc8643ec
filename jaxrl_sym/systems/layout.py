"""Where each response token's numbers live in a training batch: packed (symbolic) or padded.

Both layouts put prompt+response of each sample into a [rows, L] token array and describe each
sample's response by a *span* ``(row, first, n)``: slots ``first .. first+n-1`` are the slots whose
logits predict the n response tokens (slot of the token minus one, so ``first = start + len(prompt)
- 1`` ≥ start because prompts are non-empty). Per-token quantities (old / reference log-probs,
advantages, weights) are scattered to those slots, so :func:`jaxrl_sym.rl.algorithms.losses.rl_loss`
sees the same numbers in either layout and only the forward differs:

* ``sym``: sequences bin-packed into rows by :class:`~jaxrl_sym.runtime.engine.PackedBatch`
  (positions restart per sequence, segment ids keep them apart), forward through
  ``SymbolicLM.forward_fn``. The row count is rounded up to a fine geometric bucket (16 steps
  per octave, < 1/16 empty rows) instead of the next power of two, which would waste up to half
  the slots. The RL step then fits the rows to whole micro-batches of a row count fixed by the
  row length (:meth:`~jaxrl_sym.systems.trainable.TrainableSystem.fit_rows`), so its compiled
  update and reference programs depend on the row length only.
* ``sym`` with shared prompts (:func:`shared_prefix_layout`, the default on the symbolic
  runtime): a GRPO group's G samples share one prompt, so the prompt is placed once per row
  as a *parent* segment and each response follows it as a child segment that also sees the
  parent's keys (:func:`jaxrl_sym.ops.attention.segments_visible`). The forward then computes
  each prompt token once per row instead of G times — about 40% of the slots on the
  realistic workload, where half of every sample is its prompt.
* ``padded``: one row per sample, width ``max prompt + max response`` (what a padded RL library
  allocates), right-padded and masked, forward through ``padded_forward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.ops.attention import child_segment
from jaxrl_sym.runtime.engine import PackedBatch, length_bucket
from jaxrl_sym.runtime.policy import packed_row_len


@dataclass(frozen=True)
class Layout:
    """A training batch in one system's layout.

    system: the trainable system that laid it out (a
      :class:`jaxrl_sym.systems.trainable.TrainableSystem`, typed ``Any`` because that module
      builds layouts from this one); its forward and compiled programs run the batch. The
      functions here leave it None: which layout a system uses is its own choice, and
      ``TrainableSystem.layout`` tags what it builds.
    inputs: ``(tokens, positions, segment_ids)`` for ``sym``; ``(tokens, lengths)`` for ``padded``.
    targets: [rows, L] the token each slot predicts (only meaningful on response spans).
    spans: per sample ``(row, first, n)`` as described in the module docstring.
    useful_tokens: prompt + response tokens actually needed (the rest of the rows is padding).
    """

    system: Any
    inputs: tuple[np.ndarray, ...]
    targets: np.ndarray
    spans: tuple[tuple[int, int, int], ...]
    useful_tokens: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.targets.shape  # type: ignore[return-value]

    @property
    def filled_rows(self) -> int:
        """Rows up to the last one that holds a response span: the rows after it are empty
        (a bucket's or a micro-batch's filler) and add nothing to any forward's result."""
        return 1 + max(r for r, _, _ in self.spans)

    @property
    def padding_fraction(self) -> float:
        """Share of slots in the [rows, L] batch that hold no real token."""
        return 1.0 - self.useful_tokens / float(self.targets.size)

    def mask(self) -> np.ndarray:
        m = np.zeros(self.shape, bool)
        for r, s, n in self.spans:
            m[r, s:s + n] = True
        return m

    def scatter(self, per_sample: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
        """[rows, L] float32: per-token arrays (or one scalar per sample, broadcast over its
        response) written to each sample's span; zeros elsewhere."""
        out = np.zeros(self.shape, np.float32)
        for i, (r, s, n) in enumerate(self.spans):
            out[r, s:s + n] = per_sample[i]
        return out

    def gather(self, per_slot: np.ndarray) -> list[np.ndarray]:
        """Per-sample arrays (response length each) read from a [rows, L] array."""
        a = np.asarray(per_slot)
        return [a[r, s:s + n].copy() for r, s, n in self.spans]


def _check(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]) -> None:
    if len(prompts) != len(responses):
        raise InputError(f"{len(prompts)} prompts but {len(responses)} responses; pair them 1:1")
    if not prompts:
        raise InputError("no samples: a training batch needs at least one prompt/response pair")
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if len(p) == 0:
            raise InputError(f"sample {i} has an empty prompt; every prompt needs a token")
        if len(r) == 0:
            raise InputError(f"sample {i} has an empty response; generation always emits >= 1 "
                             "token, so this batch was not produced by generate()")


def _row_len(longest: int, row_len: int | None) -> int:
    """``row_len`` checked against the longest sequence, or (None) the packed-row grid's length
    above it (:func:`~jaxrl_sym.runtime.policy.packed_row_len`: at least 64, finer above 4k)."""
    if row_len is None:
        return packed_row_len(longest)
    if row_len < longest:
        raise InputError(f"pack_row_len={row_len} is shorter than the longest sequence "
                         f"({longest} tokens); raise it or leave it None")
    return row_len


def packed_layout(
    prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
    row_len: int | None = None,
) -> Layout:
    """Bin-pack prompt+response sequences (exact lengths) into rows of ``row_len`` slots."""
    _check(prompts, responses)
    seqs = [np.concatenate([p, r]).astype(np.int32)
            for p, r in zip(prompts, responses, strict=True)]
    longest = max(len(s) for s in seqs)
    row_len = _row_len(longest, row_len)
    pb = PackedBatch.build(seqs, row_len=row_len)
    used = 1 + max(r for r, _, _ in pb.where)
    rows = length_bucket(used, per_octave=16, minimum=1)
    pb = PackedBatch(pb.tokens[:rows], pb.positions[:rows], pb.segment_ids[:rows], pb.where)
    targets = np.zeros_like(pb.tokens)
    spans = []
    for (r, s, n), p, resp in zip(pb.where, prompts, responses, strict=True):
        targets[r, s:s + n - 1] = pb.tokens[r, s + 1:s + n]
        spans.append((r, s + len(p) - 1, len(resp)))
    return Layout(None, (pb.tokens, pb.positions, pb.segment_ids), targets, tuple(spans),
                  sum(len(s) for s in seqs))


MAX_SHARED_SEGMENTS = (1 << 15) - 1
"""Most sequences (parents and members) one shared-prompt row may hold: a row numbers its
segments from 0 and :func:`~jaxrl_sym.ops.attention.child_segment` takes parents below
2**15 - 1. The row's length is not bounded: a reasoning-length row of 34,816 slots holds a
handful of segments (it was refused while the bound was on the length, issue 47)."""


def shared_prefix_layout(
    prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
    row_len: int | None = None,
) -> Layout:
    """Packed rows in which samples with the same prompt share one copy of it.

    A *unit* is ``prompt[:-1]`` (the parent segment, positions ``0 .. P-2``) followed by
    members ``[prompt[-1], *response]`` (child segments, positions ``P-1 ..``). A child's
    queries see its own keys and its parent's, by position, so every slot computes what it
    computes in the unshared sequence — the same keys at the same positions — and the
    prompt's last token is repeated in each member so that the slot predicting a response's
    first token belongs to that member: spans stay ``(row, first, n)`` and the loss code is
    unchanged. A group that does not fit one row is split over several units (each with its
    own parent copy); a unit of one member is the plain sequence. Units are bin-packed
    first-fit decreasing, like :func:`packed_layout`, with the same row length and row bucket.

    Why the prompt minus its last token is the parent: keeping ``prompt[-1]`` in the parent
    would leave the first response token predicted from a slot every member shares, which a
    span cannot express; repeating one token per member costs G - 1 slots per unit.
    """
    _check(prompts, responses)
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    row_len = _row_len(longest, row_len)
    units = sorted(_units(prompts, responses, row_len),
                   key=lambda u: -_unit_len(u, prompts, responses))
    fill: list[int] = []  # first-fit decreasing, as PackedBatch.build
    where: list[int] = []
    for u in units:
        n = _unit_len(u, prompts, responses)
        r = next((r for r, used in enumerate(fill) if used + n <= row_len), len(fill))
        fill.extend([0] * (r == len(fill)))
        where.append(r)
        fill[r] += n
    _check_segments(units, where, row_len)
    rows = length_bucket(len(fill), per_octave=16, minimum=1)
    tokens, positions, segs, spans = _write_units(units, where, (rows, row_len), prompts,
                                                  responses)
    targets = np.zeros_like(tokens)
    for (r, s, n), resp in zip(spans, responses, strict=True):
        targets[r, s:s + n] = resp
    return Layout(None, (tokens, positions, segs), targets, tuple(spans), sum(fill))


def _check_segments(units: list[list[int]], where: list[int], row_len: int) -> None:
    """Refuse a packing whose row holds more segments than a segment id encodes."""
    count = [0] * (max(where, default=0) + 1)
    for members, r in zip(units, where, strict=True):
        count[r] += len(members) + (len(members) > 1)  # its members, and their parent
    if max(count) > MAX_SHARED_SEGMENTS:
        raise InputError(f"pack_row_len={row_len}: a shared-prompt row would hold {max(count)} "
                         f"sequences, and its segment ids encode at most {MAX_SHARED_SEGMENTS} "
                         "(each encodes its parent's); lower it or set "
                         "ExecutionConfig.share_prompts=False (--no-share-prompts)")


def _write_units(units: list[list[int]], where: list[int], shape: tuple[int, int],
                 prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """Tokens, positions, segment ids and spans of units placed in rows ``where``."""
    tokens = np.zeros(shape, np.int32)
    positions = np.full(shape, -1, np.int32)
    segs = np.full(shape, -1, np.int32)
    spans: list[tuple[int, int, int]] = [(0, 0, 0)] * len(prompts)
    used, next_seg = [0] * shape[0], [0] * shape[0]

    def put(r: int, seq: np.ndarray, first_pos: int, seg: int) -> int:
        s = used[r]
        tokens[r, s:s + len(seq)] = seq
        positions[r, s:s + len(seq)] = np.arange(first_pos, first_pos + len(seq))
        segs[r, s:s + len(seq)] = seg
        used[r] += len(seq)
        return s

    for members, r in zip(units, where, strict=True):
        p = np.asarray(prompts[members[0]], np.int32)
        parent = None
        if len(members) > 1:  # the shared part, prompt[:-1], once per unit
            parent, next_seg[r] = next_seg[r], next_seg[r] + 1
            put(r, p[:-1], 0, parent)
        for i in members:
            own, next_seg[r] = next_seg[r], next_seg[r] + 1
            if parent is None:
                s = put(r, np.concatenate([p, responses[i]]), 0, own)
                spans[i] = (r, s + len(p) - 1, len(responses[i]))
            else:
                s = put(r, np.concatenate([p[-1:], responses[i]]), len(p) - 1,
                        child_segment(parent, own))
                spans[i] = (r, s, len(responses[i]))
    return tokens, positions, segs, spans


def _units(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], row_len: int
           ) -> list[list[int]]:
    """Sample indices per unit: samples with equal prompts (of >= 2 tokens), longest response
    first, each put in the first unit of its group with room (``P - 1`` parent slots plus
    ``1 + len(response)`` per member), else a new unit."""
    groups: dict[bytes, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(np.asarray(p, np.int32).tobytes(), []).append(i)
    units: list[list[int]] = []
    for members in groups.values():
        plen = len(prompts[members[0]])
        if plen < 2 or len(members) < 2:
            units.extend([i] for i in members)
            continue
        mine: list[list[int]] = []
        room: list[int] = []
        for i in sorted(members, key=lambda i: -len(responses[i])):
            need = 1 + len(responses[i])
            u = next((u for u, left in enumerate(room) if left >= need), None)
            if u is None:
                mine.append([])
                room.append(row_len - (plen - 1))
                u = len(mine) - 1
            mine[u].append(i)
            room[u] -= need
        units.extend(mine)
    return units


def _unit_len(members: list[int], prompts: Sequence[np.ndarray],
              responses: Sequence[np.ndarray]) -> int:
    plen = len(prompts[members[0]])
    if len(members) == 1:
        return plen + len(responses[members[0]])
    return plen - 1 + sum(1 + len(responses[i]) for i in members)


def padded_layout(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]) -> Layout:
    """One right-padded row per sample, ``max(prompt) + max(response)`` wide, masked by length."""
    _check(prompts, responses)
    pmax = max(len(p) for p in prompts)
    rmax = max(len(r) for r in responses)
    tokens = np.zeros((len(prompts), pmax + rmax), np.int32)
    lengths = np.zeros(len(prompts), np.int32)
    targets = np.zeros_like(tokens)
    spans = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(p) + len(r)
        tokens[i, :n] = np.concatenate([p, r])
        lengths[i] = n
        targets[i, :n - 1] = tokens[i, 1:n]
        spans.append((i, len(p) - 1, len(r)))
    return Layout(None, (tokens, lengths), targets, tuple(spans), int(lengths.sum()))

