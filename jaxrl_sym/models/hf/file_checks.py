"""Checks at the loaders' boundary that name the user's file: a weight that would poison every
logit (:func:`check_weight`: NaN/inf, or beyond the dtype the model computes in), a path this
user may not read
(the permission it needs, instead of a ``PermissionError`` traceback from inside a reader), and
a GGUF file cut short (the bytes its header promises and the bytes present, where gguf-py says
"cannot reshape array").

Why a header walk of our own for truncation: gguf-py's reader maps the whole file and fails on a
cut one with a numpy error that names neither the file nor the cause; only after it failed does
:func:`truncation` step over the header (no tensor data is read) to say where the file ends.
JAX-free, like :mod:`jaxrl_sym.models.hf.gguf` (the CLI checks ``--model`` before JAX loads).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal

import ml_dtypes
import numpy as np

from jaxrl_sym.errors import InputError

MAGIC = b"GGUF"


def denied(err: PermissionError, what: str, path: str | Path) -> InputError:
    """The error for a path this user may not read: which path, and the permission it needs
    (a directory: r to list it, x to open what is inside; a file: r, and x on every directory
    above it), instead of a PermissionError traceback from deep inside a reader."""
    target = str(err.filename) if err.filename else str(path)
    need = ("read and execute permission (r-x) on that directory, to list it and open its files"
            if os.path.isdir(target) else "read permission (r) on that file and execute "
            "permission (x) on every directory above it")
    return InputError(f"cannot read {what} {path}: permission denied on {target}; loading it "
                      f"needs {need}. Fix the permissions (e.g. chmod -R u+rX {path}) or run as "
                      "a user who can read it")


@contextlib.contextmanager
def refuse_unreadable(what: str, path: str | Path) -> Iterator[None]:
    """The loader boundary: a PermissionError raised inside becomes :func:`denied`'s error."""
    try:
        yield
    except PermissionError as err:
        raise denied(err, what, path) from None


def check_readable(path: str | Path, what: str) -> None:
    """Open and close ``path``: a permission problem is reported as one (readers that catch
    every OSError, or a Rust reader's error, would call the file missing or damaged)."""
    with refuse_unreadable(what, path), open(path, "rb"):
        pass


# GGUF value type codes (gguf-py's GGUFValueType) → bytes of one scalar; 8 string, 9 array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS: more is garbage, not a cut


class _Cut(Exception):
    """The file ends before byte ``need``, inside ``part``."""

    def __init__(self, need: int, part: str) -> None:
        super().__init__(part)
        self.need, self.part = need, part


class _Damaged(Exception):
    """A value no writer produces: the file is damaged, not cut (the reader's error stands)."""


class _Cursor:
    """A position in a GGUF file's header that knows where the file ends (reads no data)."""

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh, self.size, self.pos = fh, size, 0
        self.order: Literal["little", "big"] = "little"

    def skip(self, n: int, part: str) -> None:
        if not 0 <= n < 1 << 50:
            raise _Damaged(part)
        if self.pos + n > self.size:
            raise _Cut(self.pos + n, part)
        self.pos += n

    def read(self, n: int, part: str) -> bytes:
        start = self.pos
        self.skip(n, part)
        self.fh.seek(start)
        return self.fh.read(n)

    def uint(self, n: int, part: str) -> int:
        return int.from_bytes(self.read(n, part), self.order)


def _skip_value(c: _Cursor, vtype: int, part: str) -> None:
    """Step over one metadata value (a scalar, a string, or an array of either)."""
    if vtype in _SCALAR_BYTES:
        c.skip(_SCALAR_BYTES[vtype], part)
    elif vtype == _STRING:
        c.skip(c.uint(8, part), part)
    elif vtype == _ARRAY:
        itype, n = c.uint(4, part), c.uint(8, part)
        if itype in _SCALAR_BYTES:
            c.skip(n * _SCALAR_BYTES[itype], part)
        else:
            for _ in range(n):
                _skip_value(c, itype, part)
    else:
        raise _Damaged(part)


def _walk(c: _Cursor) -> tuple[int, str] | None:
    """(the byte the file should reach, the tensor whose data is cut) when the header is whole
    but the data is not; None when the file is complete. A cut header raises :class:`_Cut`."""
    import gguf

    if c.read(4, "the header") != MAGIC:
        raise _Damaged("magic")
    if c.uint(4, "the header") & 0xFFFF == 0:
        c.order = "big"  # written on a big-endian machine: gguf-py reads it byte-swapped
    n_tensors, n_kv = c.uint(8, "the header"), c.uint(8, "the header")
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = c.read(c.uint(8, f"metadata entry #{i}"), f"metadata entry #{i}").decode(
            "utf-8", "replace")
        vtype = c.uint(4, f"metadata {key!r}")
        if key == "general.alignment" and vtype == _UINT32:
            align = c.uint(4, f"metadata {key!r}") or 1
        else:
            _skip_value(c, vtype, f"metadata {key!r}")
    ends = []
    for i in range(n_tensors):
        name = c.read(c.uint(8, f"tensor info #{i}"), f"tensor info #{i}").decode(
            "utf-8", "replace")
        part = f"the tensor info of {name!r}"
        n_dims = c.uint(4, part)
        if n_dims > _MAX_DIMS:
            raise _Damaged(part)
        count = int(np.prod([c.uint(8, part) for _ in range(n_dims)], dtype=object))
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(c.uint(4, part))]
        ends.append((c.uint(8, part) + count * size // block, name))
    start = -(-c.pos // align) * align  # the data section begins aligned
    cut = sorted((start + end, name) for end, name in ends if start + end > c.size)
    return (start + max(e for e, _ in ends), cut[0][1]) if cut else None


def truncation(path: Path) -> InputError | None:
    """The error for a GGUF file that ends before its header says it does (an interrupted
    download or copy), with the bytes expected and present; None for a complete or otherwise
    damaged file. gguf-py reports a cut file as a numpy reshape or index error."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            data_cut = _walk(_Cursor(fh, size))
    except _Cut as cut:
        expected, part = f"at least {cut.need}", cut.part
    except (_Damaged, OSError, ValueError, KeyError, RecursionError):
        return None
    else:
        if data_cut is None:
            return None
        expected, part = f"{data_cut[0]}", f"the data of tensor {data_cut[1]!r}"
    return InputError(f"GGUF file {path} is truncated: expected {expected} bytes, the file has "
                      f"{size} (it ends inside {part}); the download or copy was cut short — "
                      "fetch the file again")


DAMAGED = "this checkpoint is damaged — re-download or re-export it"


def check_weight(arr: np.ndarray, name: str, where: str | Path, dtype: Any = None, *,
                 remedy: str = DAMAGED, overflow_fix: str | None = None) -> None:
    """Refuse a weight that would poison every logit: NaN/inf, or (``dtype`` given) a value
    that becomes inf when cast to the dtype the model computes in.

    The one check every loader (safetensors, GGUF, PEFT adapters) and the exporter call, so a
    damaged file is refused the same way whatever its format. One pass over a tensor already in
    memory (two more, allocation-free, only when ``dtype`` is narrower than the stored one): a
    NaN turns every logit NaN (or, in a masked row, goes unnoticed), and a weight past float16's
    ±65504 loads as inf and the model decodes token 0 forever. ``where`` is the file (or what is
    being written); ``overflow_fix`` says what to do when ``arr`` is float16 and holds inf (an
    export cast to float16: the cause is the cast, not damage).
    """
    if not (arr.dtype.kind == "f" or arr.dtype == ml_dtypes.bfloat16) or arr.size == 0:
        return
    finite = np.isfinite(arr)
    if not finite.all():
        bad = int(arr.size - np.count_nonzero(finite))
        first = _index(arr, int(np.argmin(finite)))
        hint = (f" (float16 overflows beyond ±65504: {overflow_fix})"
                if overflow_fix and arr.dtype == np.float16 else "")
        raise InputError(f"{where}: tensor {name!r} holds {bad} NaN or infinite values of "
                         f"{arr.size}, the first at index {first}{hint}; {remedy}")
    if dtype is not None and ml_dtypes.finfo(dtype).max < ml_dtypes.finfo(arr.dtype).max:
        _check_range(arr, name, where, np.dtype(dtype), remedy)


def _check_range(arr: np.ndarray, name: str, where: str | Path, target: np.dtype,
                 remedy: str) -> None:
    """The largest magnitude of ``arr`` must survive the cast to ``target`` (asked of the cast
    itself: float16 rounds values up to 65519.99 to 65504, only beyond that to inf)."""
    hi, lo = arr.max(), arr.min()
    peak, flat = ((hi, int(np.argmax(arr))) if abs(float(hi)) >= abs(float(lo))
                  else (lo, int(np.argmin(arr))))
    with np.errstate(over="ignore"):
        if np.isfinite(np.asarray(peak, arr.dtype).astype(target)):
            return
    limit = float(ml_dtypes.finfo(target).max)
    fix = ("load it in bfloat16 or float32 instead (dtype='bfloat16', --dtype bfloat16)"
           if target == np.float16 else remedy)  # past float32/bfloat16: no dtype holds it
    raise InputError(f"{where}: tensor {name!r} holds a weight of magnitude "
                     f"{abs(float(peak)):.6g} (index {_index(arr, flat)}), beyond the range of "
                     f"{target.name} (±{limit:.6g}), the dtype the model is being loaded in: it "
                     f"would become inf and turn every logit NaN; {fix}")


def _index(arr: np.ndarray, flat: int) -> list[int]:
    """A flat position as the tensor's index (what a user looks up in the file)."""
    return [int(i) for i in np.unravel_index(flat, arr.shape)]
