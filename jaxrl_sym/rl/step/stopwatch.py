"""Per-stage wall-clock seconds and peak bytes of one RL step (:class:`Stopwatch`), and the
hook that shows a step's stages as they run (:data:`OnStage`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from jaxrl_sym.runtime.metrics import device_peak_bytes, peak_rss_bytes

OnStage = Callable[[str, "float | None", int], None]
"""Told when a stage starts (seconds None) and ends (its seconds, and the tokens it generated):
the progress shown inside a step that takes minutes."""


class Stopwatch:
    """Per-stage wall-clock seconds, in the order the stages ran (the step's ``seconds``), and
    the peak bytes at each stage's end: the device allocator's where it keeps statistics (GPU),
    else this process's peak RSS (CPU, where the host memory is the device's; it includes the
    interpreter and compiler, so it reads higher than the device ledger). Either peak only
    grows, so the stage where it first jumps is the one that reached it."""

    def __init__(self, on_stage: OnStage | None = None) -> None:
        self.sec: dict[str, float] = {}
        self.peaks: dict[str, int] = {}
        self.peak_source = "device"  # or "host_rss"
        self.on_stage = on_stage
        self.tokens = 0  # set inside a stage that generates: its tokens (for tokens/s)

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if self.on_stage is not None:
            self.on_stage(stage, None, 0)
        t, self.tokens = time.perf_counter(), 0
        yield
        self.sec[stage] = time.perf_counter() - t
        if self.on_stage is not None:
            self.on_stage(stage, self.sec[stage], self.tokens)
        peak = device_peak_bytes()
        if peak is None:
            peak, self.peak_source = peak_rss_bytes(), "host_rss"
        self.peaks[stage] = peak

    def move(self, seconds: float, src: str, dst: str) -> None:
        """Re-attribute ``seconds`` measured inside ``src`` to ``dst``."""
        self.sec[dst] = self.sec[dst] + seconds
        self.sec[src] -= seconds
