"""The checks ``jaxrl-sym generate`` and ``export`` share, JAX-free (they run before JAX is
imported): a ``--model`` path (a checkpoint directory with a readable config.json, or a GGUF
file), the dtypes a model is loaded in, and the error a command raises after JAX is imported.
One home, below both commands' modules (:mod:`jaxrl_sym.hf_cli`, :mod:`jaxrl_sym.hf_export_cli`),
so neither imports the other."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from jaxrl_sym.errors import InputError

DTYPES = ("float32", "bfloat16", "float16")


class CliError(Exception):
    """A user error found after JAX was imported (reported as ``error:`` with exit code 2)."""


@contextlib.contextmanager
def _refuse_unreadable(what: str, path: str) -> Iterator[None]:
    """:func:`jaxrl_sym.models.hf.file_checks.refuse_unreadable`, imported only when there is a
    PermissionError to report: its package imports JAX, and these checks run before JAX (a
    directory this user may not list was a PermissionError traceback from ``os.listdir``)."""
    try:
        yield
    except PermissionError as err:
        from jaxrl_sym.models.hf.file_checks import denied

        raise denied(err, what, path) from None


def is_gguf(path: str) -> bool:
    """A ``.gguf`` file, or a directory holding one and no config.json: ``load_pretrained``
    reads it (``models/hf/gguf.py``; the rule repeated here, JAX-free). An unreadable directory
    is an InputError naming the permission it needs."""
    if os.path.isfile(path):
        return path.lower().endswith(".gguf")
    with _refuse_unreadable("--model", path):
        return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))
                and any(f.lower().endswith(".gguf") for f in os.listdir(path)))


def model_errors(flag: str, path: str) -> list[str]:
    """A checkpoint directory (exists, has a readable config.json) or a GGUF file; a path this
    user may not read is named with the permission it needs (``stat`` and ``open`` say so,
    where ``os.path.isfile`` would call the file missing)."""
    try:
        if is_gguf(path):
            return []
        if not os.path.isdir(path):
            return [f"{flag} {path}: no such directory (nor a .gguf file)"]
        with _refuse_unreadable(flag, path):
            try:
                os.stat(os.path.join(path, "config.json"))
            except FileNotFoundError:
                return [f"{flag} {path}: not a Hugging Face checkpoint directory (no "
                        "config.json)"]
            with open(os.path.join(path, "config.json"), "rb"):
                pass
    except InputError as err:
        return [str(err)]
    return []
