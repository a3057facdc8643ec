"""Paths a command will write, checked before any work: a file or a directory whose place exists
and takes a probe file.

Why one module, JAX-free: the decode and train command lines are checked before JAX is imported
(:mod:`jaxrl_sym.cli`), and a training run checks its checkpoint directory and metrics log as it
opens them (:mod:`jaxrl_sym.rl.run.run_files`). Each used to have its own copy — with the flag and
the path in swapped argument order, one returning messages, the other raising, one trusting
permission bits, which say nothing for root or a read-only mount. Now every check writes a probe
and raises :class:`~jaxrl_sym.errors.InputError` naming the flag; :func:`path_errors` turns that
into the list of messages a command-line checker collects.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from jaxrl_sym.errors import InputError

__all__ = ["check_output_dir", "check_output_file", "path_errors"]


def _probe_writable(directory: str, what: str) -> None:
    """Create and delete a file: permission bits alone say nothing for root or read-only mounts."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".jaxrl-sym-write-check-")
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise InputError(f"{what}: cannot write in {directory} ({e.strerror or e}); choose a "
                         "writable location") from e


def check_output_dir(path: str, what: str) -> bool:
    """Raise :class:`InputError` (naming ``what``, the flag) unless ``path`` is a writable
    directory or can be created in an existing, writable parent. Returns whether it exists."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise InputError(f"{what} {path} exists and is not a directory; give a directory")
        _probe_writable(path, f"{what} {path}")
        return True
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise InputError(f"{what} {path}: its parent directory {parent} does not exist; create "
                         "it first or fix the path")
    _probe_writable(parent, f"{what} {path}")
    return False


def check_output_file(path: str, what: str) -> None:
    """Raise :class:`InputError` (naming ``what``) unless ``path`` can be written: its parent
    exists and is writable (files are replaced via a temporary next to them) and an existing
    ``path`` is a file that opens for appending."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        raise InputError(f"{what} {path} is a directory; give a file name")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise InputError(f"{what} {path}: its parent directory {parent} does not exist; create "
                         "it first or fix the path")
    _probe_writable(parent, f"{what} {path}")
    if os.path.exists(path):
        try:
            with open(path, "a"):
                pass
        except OSError as e:
            raise InputError(f"{what} {path} cannot be written ({e.strerror or e})") from e


def path_errors(check: Callable[[str, str], Any], what: str, path: str | None) -> list[str]:
    """``check(path, what)``'s refusal as a list of one message; none when the path is fine or
    not given. Why: a command-line checker reports every bad flag at once, not the first."""
    if path is None:
        return []
    try:
        check(path, what)
    except InputError as e:
        return [str(e)]
    return []
