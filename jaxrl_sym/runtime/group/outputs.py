"""What a generation emitted so far, per request row, on the host: the one object a decode group
(:mod:`jaxrl_sym.runtime.group.loop`), its refills (:mod:`jaxrl_sym.runtime.group.refills`) and the
speculative loop append to, and the engine turns into a result."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

OnFinished = Callable[[list[int], list[np.ndarray]], None]


@dataclass
class Outputs:
    """Per request row, what generation emitted so far (host lists)."""

    toks: list[list[int]]
    lps: list[list[float]]
    logits: list[list[np.ndarray]] | None
    progress: Callable[[int], None] | None = None  # after each read-back: tokens emitted so far
    stop_when: Callable[[np.ndarray], bool] | None = None  # see SymbolicLM.generate
    stop_live: int | None = None  # the running group's bound (SymbolicLM.generate's stop_live)
    finished: np.ndarray | None = None  # bool per request row: ended at EOS or its limit
    stopped: bool = False  # stop_when asked to end generation; no group decodes further

    def __post_init__(self) -> None:
        if self.finished is None:
            self.finished = np.zeros((len(self.toks),), bool)

    def should_stop(self) -> bool:
        """Ask ``stop_when`` (after a read-back); once it said yes, the answer stays yes."""
        if not self.stopped and self.stop_when is not None:
            self.stopped = bool(self.stop_when(self.finished.copy()))
        return self.stopped

    def append_steps(self, ids: np.ndarray, tok: np.ndarray, lp: np.ndarray,
                     lg: np.ndarray | None, room: np.ndarray, eos: Sequence[int]
                     ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Append one tile's read-back, ``tok [steps, rows]`` (and log-probs, logits) of the
        request rows ``ids``: each keeps its tokens through its first EOS or until it holds
        ``room`` more (:func:`kept_steps`); later steps are overrun. Returns (tokens kept per
        row, whether it ended, the request rows that ended in the order a step-by-step loop
        finds them: by step, then by row).

        Why per row and not per token: the host's turn between two tiles is time the GPU
        waits, and a loop over every (step, row) of a 64-step tile at 128 rows was most of it
        (``bench/results/projection/dispatch/README.md``)."""
        n, ended = kept_steps(tok, room, eos)
        for c, i in enumerate(ids.tolist()):
            k = int(n[c])
            self.toks[i].extend(tok[:k, c].tolist())
            self.lps[i].extend(lp[:k, c].tolist())
            if self.logits is not None and lg is not None:
                self.logits[i].extend(lg[:k, c])
        done = np.nonzero(ended)[0]
        done = done[np.argsort(n[done], kind="stable")]
        finished = [int(ids[c]) for c in done]
        self.finished[finished] = True
        return n, ended, finished


def kept_steps(tok: np.ndarray, room: np.ndarray, eos: Sequence[int]
               ) -> tuple[np.ndarray, np.ndarray]:
    """Per column of ``tok [steps, rows]``, how many of its steps a row keeps and whether it
    ended in them: through its first EOS, at most ``room`` (its limit less what it holds) and
    at least one (a live row always emits its step's token)."""
    steps = tok.shape[0]
    hit = np.isin(tok, np.asarray(eos, tok.dtype)) if len(eos) else np.zeros(tok.shape, bool)
    through_eos = np.where(hit.any(axis=0), hit.argmax(axis=0) + 1, steps + 1)
    end = np.maximum(np.minimum(through_eos, room), 1)
    return np.minimum(end, steps), end <= steps
