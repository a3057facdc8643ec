"""Reference scoring of finished generations while the rest of the batch still decodes.

Why: in a padded RL library the reference model runs as a separate pass after generation ends
(FIELD_NOTES §5), so during the long tail of generation — when most rows have hit EOS and the
decode batch has shrunk — the device does little, and afterwards it does the whole reference pass
alone. On the symbolic runtime a row's reference log-probs depend only on that row's tokens, so
they can be computed as soon as the row finishes. :class:`ReferenceOverlap` receives finished rows
from :meth:`SymbolicLM.generate`'s ``on_finished`` hook, packs them (exact lengths) into chunks,
and *dispatches* the reference forward for each chunk without waiting for it: JAX's asynchronous
dispatch queues the work behind the decode steps, and the host keeps driving generation. Results
are read back only in :meth:`collect`, after generation.

Chunks have a fixed row length for the whole step (prompt + response can never exceed it) and a
bucketed number of rows, so a steady-state run reuses a handful of compiled programs.

At most :data:`MAX_INFLIGHT` chunks are in flight: before dispatching another, the host waits
for the oldest. Why: an XLA:GPU execution holds its temporaries from when it is *enqueued* until
it completes, so when many rows finish in one decode tile (the tail of a batch), every chunk
dispatched back to back held its temporaries at once behind the decode work — each ~0.19 GB at
Qwen2.5-0.5B's shape with 1,280-slot chunks, and on the H100 sym's generation held ~1.9 GB that
no single compiled program explains (``bench/results/projection.md``, 2026-11-27). The wait
only holds the host while the device still has the queued chunks to run.

Why one: the host syncs on every decode tile, and a chunk is dispatched after that sync and
before the next tile, so by the next chunk's dispatch the previous one (queued ahead of the
tile the host just read) has finished — the wait is free. It costs only when several chunks are
dispatched between two tiles (many rows ending in one tile): each then waits for the one before,
which the device runs meanwhile, so the device stays busy. A second chunk in flight held 0.19 GB
more at the GPU preset (Qwen2.5-0.5B, one 1,280-slot row each, compiled for the H100), 6% of
sym's projected generation peak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_sym.sharding import to_host
from jaxrl_sym.systems.layout import Layout, packed_layout

MAX_INFLIGHT = 1  # reference chunks dispatched and not yet finished, at most (module docstring)


OVERLAP_ROWS = 1
"""Packed rows per reference chunk scored during generation (at most; the forward's own row
budget may be lower). Why one: a chunk's temporaries live beside generation's stores, up to
MAX_INFLIGHT of them, from enqueue to end. Compiled for the H100 at Qwen2.5-0.5B's shape, a chunk
of the update's size (3 rows × 1,280 slots) held 0.565 GB of temporaries, and two in flight were
1.13 of sym's projected 3.92 GB generation peak; one row holds 0.19 GB
(``bench/results/projection/``, 2026-11-27c)."""


def chunk_waits_for(max_rows: int) -> int:
    """The fewest finished samples before a chunk of ``max_rows`` full rows can be dispatched
    (the waiting samples must overflow it; each row holds at least one): before then a memory
    ledger counts no chunk in flight."""
    return max_rows + 1


class ReferenceOverlap:
    """Collect finished rows, score them in packed chunks, hand back per-sample log-probs.

    Args:
      prompts: every sample's prompt (sample index = generation row index).
      row_len: packed row length of every chunk (≥ longest possible prompt + response).
      dispatch: ``dispatch(layout) -> device array [rows, L]`` of reference log-probs at each
        slot; must not block (return the un-fetched device array).
      min_rows: without ``max_rows``, dispatch everything waiting once this many finished
        samples wait.
      max_rows: chunks of this many packed rows, each dispatched as soon as the waiting samples
        overflow it (so every chunk during generation is full; the rest at :meth:`collect`) —
        a chunk's temporaries must fit beside generation's stores.
      max_inflight: chunks dispatched and not yet finished, at most (the host waits for the
        oldest before dispatching past it).
    """

    def __init__(self, prompts: Sequence[np.ndarray], row_len: int,
                 dispatch: Callable[[Layout], Any], *, min_rows: int,
                 max_rows: int | None = None, max_inflight: int = MAX_INFLIGHT) -> None:
        self.prompts = list(prompts)
        self.row_len = int(row_len)
        self.dispatch = dispatch
        self.max_rows = None if max_rows is None else max(1, int(max_rows))
        self.min_rows = max(1, int(min_rows))
        self.max_inflight = max(1, int(max_inflight))
        self._pending: list[tuple[int, np.ndarray]] = []
        self._chunks: list[tuple[list[int], Layout, Any]] = []
        self.overlapped_samples = 0

    def chunk_layout(self, rows: int) -> Layout:
        """A layout of the shape every full chunk during generation has: ``rows`` packed rows
        of ``row_len`` slots (what to compile the scoring program at before any row ends)."""
        n = max(1, self.row_len - len(self.prompts[0]))
        lay = packed_layout([self.prompts[0]] * rows, [np.zeros(n, np.int32)] * rows,
                            row_len=self.row_len)
        assert lay.shape[0] == rows, (lay.shape, rows)  # each sample fills its own row
        return lay

    def on_finished(self, ids: list[int], responses: list[np.ndarray]) -> None:
        """The engine's hook: queue finished rows; dispatch the chunks they fill."""
        self._pending.extend(zip(ids, responses, strict=True))
        if self.max_rows is not None or len(self._pending) >= self.min_rows:
            before = len(self._pending)
            self._flush(final=False)
            self.overlapped_samples += before - len(self._pending)

    def _flush(self, final: bool) -> None:
        """Dispatch what waits: everything (``final``, or no ``max_rows``), else only chunks
        of ``max_rows`` full rows, keeping the samples that do not fill one."""
        while self._pending:
            ids = [i for i, _ in self._pending]
            lay = packed_layout([self.prompts[i] for i in ids], [r for _, r in self._pending],
                                row_len=self.row_len)
            if self.max_rows is None or lay.shape[0] <= self.max_rows:
                if not final and self.max_rows is not None:
                    return  # not a full chunk yet: wait for more finished rows
                self._chunks.append((ids, lay, self._dispatch(lay)))
                self._pending = []
                return
            # Too many rows for one program: dispatch the samples packed into the first
            # max_rows rows as they are, and pack the rest again.
            keep = [k for k, (r, _, _) in enumerate(lay.spans) if r < self.max_rows]
            head = Layout(lay.system, tuple(x[:self.max_rows] for x in lay.inputs),
                          lay.targets[:self.max_rows], tuple(lay.spans[k] for k in keep),
                          sum(len(self.prompts[ids[k]]) + len(self._pending[k][1]) for k in keep))
            self._chunks.append(([ids[k] for k in keep], head, self._dispatch(head)))
            kept = set(keep)
            self._pending = [x for k, x in enumerate(self._pending) if k not in kept]

    def _dispatch(self, lay: Layout) -> Any:
        """Dispatch ``lay``'s chunk once fewer than ``max_inflight`` earlier ones may still run:
        the host waits for the one ``max_inflight`` back (and so for all before it)."""
        if len(self._chunks) >= self.max_inflight:
            jax.block_until_ready(self._chunks[-self.max_inflight][2])
        return self.dispatch(lay)

    def collect(self, n: int, responses: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Score what is still waiting, then return the reference log-probs of all ``n``
        samples (one array per sample, its response length), checking each chunk scored the
        tokens generation finally returned."""
        self._flush(final=True)
        out: list[np.ndarray | None] = [None] * n
        for ids, lay, dev in self._chunks:
            per = lay.gather(to_host(dev))
            for i, lp in zip(ids, per, strict=True):
                if len(lp) != len(responses[i]):
                    raise AssertionError(f"sample {i}: reference scored {len(lp)} tokens but "
                                         f"generation returned {len(responses[i])}")
                out[i] = lp
        missing = [i for i, x in enumerate(out) if x is None]
        if missing:
            raise AssertionError(f"samples {missing[:8]} never reported finished by generation")
        return out  # type: ignore[return-value]

    @property
    def chunks(self) -> int:
        return len(self._chunks)
