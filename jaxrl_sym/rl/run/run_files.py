"""A training run's files: the checkpoint directory (checked, opened and locked before the
slow model set-up) and the metrics log (checked writable; truncated to the resumed step).

Why one module: every path a run writes is checked the same way — by a probe write, since
permission bits say nothing for root or read-only mounts (:mod:`jaxrl_sym.output_paths`, the
checks the command lines use too) — and named by its flag in the error.
The lock: two trainers on one ``--checkpoint-dir`` used to write the same step numbers, one
dying with an orbax traceback, the directory holding steps of two runs. A run now holds an
``fcntl`` lock on ``<dir>/.jaxrl-sym.lock`` (released by the kernel when the process ends, so a
killed run leaves no stale lock); a second run is refused naming the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from typing import IO, Any

import jax

from jaxrl_sym.errors import InputError
from jaxrl_sym.output_paths import check_output_dir
from jaxrl_sym.rl.config import CheckpointConfig
from jaxrl_sym.rl.run.checkpoint import Checkpointer

log = logging.getLogger(__name__)
LOCK_FILE = ".jaxrl-sym.lock"


class RunLock:
    """An exclusive lock on a checkpoint directory for one training run (see the module)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_FILE)
        self._file: IO[str] | None = None

    def acquire(self) -> RunLock:
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the run: the lock lives on it
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise InputError(
                f"--checkpoint-dir {os.path.dirname(self.path)} is in use by a running training "
                f"({holder}); wait for it to end, or give this run another directory") from None
        try:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
            f.flush()
        except OSError as e:  # a full disk: nothing could be saved there either
            with contextlib.suppress(OSError):  # close flushes the unwritten bytes again
                f.close()
            raise InputError(f"--checkpoint-dir {os.path.dirname(self.path)}: cannot write "
                             f"its lock file ({e.strerror or e}); free space there or choose "
                             "another directory") from None
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor releases the lock
            self._file = None


def open_checkpoints(cc: CheckpointConfig
                     ) -> tuple[Checkpointer | None, bool, RunLock | None]:
    """Open and lock ``cc.directory`` for this run — before the (slow) model set-up, so a wrong
    path costs nothing. Returns the checkpointer, whether to resume from it, and the lock the
    caller releases when the run ends."""
    directory, resume, resume_or_start, keep = cc.directory, cc.resume, cc.resume_or_start, cc.keep
    if directory is None:  # CheckpointConfig refuses resuming without a directory
        return None, False, None
    flag = "--checkpoint-dir (checkpoint_dir)"
    exists = check_output_dir(directory, flag)
    full = os.path.abspath(directory)
    if not exists and resume and not resume_or_start:
        raise InputError(f"--resume: {flag} {full} does not exist, so there is nothing to "
                         "resume. Check the path, or pass --resume-or-start to start a new run "
                         "there when it holds no checkpoint.")
    ckpt = Checkpointer(directory, max_to_keep=keep, create=True)
    # the processes of one multi-process run share the directory: process 0 holds the lock
    lock = RunLock(ckpt.directory).acquire() if jax.process_index() == 0 else None
    try:
        latest = ckpt.latest_step()
        return ckpt, _resuming(cc, latest, full), lock
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _resuming(cc: CheckpointConfig, latest: int | None, full: str) -> bool:
    """Whether this run resumes from the directory's newest step ``latest`` (None: it holds
    none); an :class:`InputError` where the flags and the directory disagree."""
    flag = "--checkpoint-dir (checkpoint_dir)"
    resume, resume_or_start = cc.resume, cc.resume_or_start
    if latest is None:
        if resume and not resume_or_start:
            raise InputError(f"--resume: {flag} {full} holds no checkpoint, so there is nothing "
                             "to resume. Check the path, or pass --resume-or-start to start a "
                             "new run there.")
        if resume_or_start:
            log.warning("no checkpoint in %s: starting a new run there", full)
        return False
    if not cc.resuming:
        raise InputError(
            f"checkpoint_dir {full} already holds a checkpoint of step {latest}; pass "
            "resume=True (--resume) to continue that run, or choose an empty directory for a "
            "new one")
    return True


def prepare_metrics(path: str, resumed_from: int | None) -> None:
    """A fresh run starts a fresh log; a resumed one keeps the lines up to its checkpoint."""
    if resumed_from is not None:
        truncate_metrics(path, resumed_from)
    elif os.path.exists(path):
        os.remove(path)


def truncate_metrics(path: str, last_step: int) -> None:
    """Drop lines of steps after the checkpoint being resumed (they will be run again)."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line).get("step", 0) <= last_step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except json.JSONDecodeError:
                break  # a line cut by the interruption: it and anything after are dropped
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def saved_note(trainer: Any, ckpt: Checkpointer | None, meta: dict[str, Any]) -> str:
    """Where the last finished step is saved, for an error that stops a run; saving may fail
    for the same reason (a full disk), which the note says instead of raising over it."""
    if ckpt is None:
        return " (pass --checkpoint-dir to keep a run whose outputs fail to write)"
    try:
        return f", saved in {save_last(trainer, ckpt, meta)} (--resume continues it)"
    except Exception as e:  # orbax wraps OS errors in its own types
        return f"; saving it failed too ({type(e).__name__}: {str(e)[:200]})"


def save_last(trainer: Any, ckpt: Checkpointer | None, meta: dict[str, Any]
               ) -> str | None:
    """The checkpoint directory holding the last finished step, saving it if it is not yet
    (None: no checkpoint directory, or no step finished)."""
    k = trainer.steps_done
    if ckpt is None or k == 0:
        return None
    if ckpt.latest_step() != k:
        ckpt.save(k, trainer, meta)
    return os.path.abspath(ckpt.directory)
