"""What a generation emitted so far, per request row, on the host: the one object a decode group
(:mod:`jaxrl_sym.runtime.group.loop`), its refills (:mod:`jaxrl_sym.runtime.group.refills`) and the
speculative loop append to, and the engine turns into a result."""

from __future__ import annotations

from collections.abc import Callable
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
