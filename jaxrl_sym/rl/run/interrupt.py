"""SIGTERM, SIGINT, SIGHUP and SIGUSR1 during training: finish (or abandon) the step, save,
say where, exit.

Why: a scheduler ends a job with SIGTERM (then SIGKILL after a grace period) and a person with
Ctrl-C. Python's defaults end the process at once — SIGTERM silently, SIGINT with a traceback,
possibly inside a checkpoint save — and with the default ``--checkpoint-every 0`` the whole run
was lost. Here, inside :func:`graceful`:

* the first signal is a request: the step under way finishes, its metrics line is written, and
  the loop stops;
* a second signal abandons the step under way at once (a step commits nothing until it
  succeeds, so the state is the last finished step's); it is ignored while a checkpoint or a
  metrics line is being written, so neither is ever half-written by it, and where it lands in
  a garbage-collection callback (Python cannot raise there) the step finishes instead;
* the loop then saves the last finished step where there is a checkpoint directory and raises
  :class:`Interrupted`, which the CLI prints as one line and turns into exit code 128 + signal.

Handlers are installed only in the main thread of a single-process run (signals reach one
process; a multi-process save needs every process). A library call restores the previous ones
after; the CLI owns its process and keeps them until it exits (:func:`install`).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# SIGHUP: the terminal or ssh session that started the run went away; SIGUSR1: the
# pre-emption notice schedulers send ahead of SIGTERM (Slurm's --signal=USR1@SECONDS)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


class Interrupted(KeyboardInterrupt):
    """Training stopped by a signal after ``step`` finished steps; ``saved``: the checkpoint
    directory holding that step (None: none was kept). A ``KeyboardInterrupt``, so a generic
    ``except Exception`` does not swallow it."""

    def __init__(self, signum: int, step: int, saved: str | None) -> None:
        self.signum, self.step, self.saved = signum, step, saved
        super().__init__(self.message)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def message(self) -> str:
        name = signal.Signals(self.signum).name
        if self.step == 0:
            return f"{name}: stopped before the first step finished; there was nothing to save"
        if self.saved is not None:
            return (f"{name}: stopped after step {self.step}; its checkpoint is in {self.saved} "
                    "(continue with --resume)")
        return (f"{name}: stopped after step {self.step}; nothing was saved (no "
                "--checkpoint-dir; pass one to keep an interrupted run)")


class _Abandon(BaseException):
    """Raised by the second signal inside a step: unwinds the step, which commits nothing."""


@dataclass
class StopRequest:
    """What the handlers saw: ``signum`` of the first signal (None: none). ``in_step`` is set
    by the loop around the step itself, the only place a second signal may interrupt."""

    signum: int | None = None
    in_step: bool = False

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around the step itself: a second signal now abandons it (:func:`abandoned`)."""
        self.in_step = True
        try:
            yield
        finally:
            self.in_step = False

    def handle(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            print(f"{signal.Signals(signum).name}: finishing this step, then saving; send it "
                  "again to abandon the step", file=sys.stderr, flush=True)
        elif self.in_step:
            raise _Abandon()


def _quiet_lost_abandon(previous: Any) -> Any:
    """An unraisable hook that drops an abandon raised where Python cannot propagate it (a
    garbage-collection callback, e.g. JAX's): the step then finishes instead, with no stray
    traceback on stderr; every other unraisable exception goes to ``previous``."""
    def hook(info: Any) -> None:
        if not isinstance(info.exc_value, _Abandon):
            previous(info)
    return hook


def abandoned(exc: BaseException) -> bool:
    """Whether ``exc`` is the second signal unwinding a step."""
    return isinstance(exc, _Abandon)


def install() -> StopRequest:
    """Handlers for the rest of this process (the CLI, which owns its process): after a stop,
    a further signal is ignored until the process exits — restored defaults would let a
    second Ctrl-C or SIGTERM kill it while it prints where the checkpoint is. :func:`graceful`
    inside uses this request instead of installing its own."""
    stop = StopRequest()
    for s in SIGNALS:
        signal.signal(s, stop.handle)
    sys.unraisablehook = _quiet_lost_abandon(sys.unraisablehook)
    return stop


def _installed() -> StopRequest | None:
    handler = signal.getsignal(signal.SIGTERM)
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, StopRequest) else None


@contextmanager
def graceful(enabled: bool = True) -> Iterator[StopRequest]:
    """SIGTERM/SIGINT as :class:`StopRequest` for the loop inside (see the module docstring);
    the process's own request where :func:`install` set one, else handlers for this block."""
    outer = _installed()
    if outer is not None:
        yield outer
        return
    stop = StopRequest()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop.handle) for s in SIGNALS}
    hook = sys.unraisablehook
    sys.unraisablehook = _quiet_lost_abandon(hook)
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        sys.unraisablehook = hook
