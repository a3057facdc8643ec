"""safetensors files read and written one tensor at a time, with plain file I/O.

Why not ``safetensors.numpy`` for the weights themselves:

* **Reading.** ``safe_open`` memory-maps the file; every page a ``get_tensor`` touches stays in
  the process's resident set until the file is closed, so loading a whole file through it showed
  the weights twice in peak RSS, where ``readinto`` into the tensor's own buffer shows them once
  (``bench/results/cpu/export_memory.md``). Reading at the header's offsets also
  serves bfloat16 on safetensors builds whose numpy side refuses it.
* **Writing.** ``save_file`` needs every tensor of a file in memory at once (the dict it is
  given), i.e. a full host copy of the weights next to the model's. :func:`write_safetensors`
  writes the header first (computed from shapes and dtypes alone) and then each tensor as it is
  produced, so only one tensor is on the host at a time.

The bytes are the ones ``safetensors.numpy.save_file`` writes for the same tensors (checked in
``tests/test_hf_export.py``): tensors ordered by dtype (widest first, as safetensors' Rust
``prepare`` sorts) then name, compact JSON header with ``__metadata__`` first, padded with
spaces to a multiple of 8 bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from jaxrl_sym.errors import InputError

# safetensors code → numpy dtype, in safetensors' own order (its Rust Dtype enum's, widest
# float first): that order decides where a tensor sits in a file that mixes dtypes.
ST_DTYPES: dict[str, Any] = {
    "F64": np.float64, "F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16,
}
_CODES = {np.dtype(v): k for k, v in ST_DTYPES.items()}
_RANK = {code: i for i, code in enumerate(ST_DTYPES)}


def st_code(dtype: Any) -> str:
    """The safetensors dtype code of a numpy/ml_dtypes dtype (floating parameters only)."""
    code = _CODES.get(np.dtype(dtype))
    if code is None:
        raise InputError(f"dtype {np.dtype(dtype).name} cannot be written as a parameter; "
                         f"supported: {', '.join(ST_DTYPES)}")
    return code


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, header dict) of one safetensors file."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise InputError(f"safetensors file {path} is truncated (no header length)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(fh.read(n))
        except ValueError as err:
            raise InputError(f"safetensors file {path} has an unreadable header: {err}") from None
    return 8 + n, header


def read_tensor(fh: BinaryIO, data_start: int, entry: dict[str, Any], name: str) -> np.ndarray:
    """One tensor read into a fresh array of its own (no memory map, no intermediate bytes)."""
    begin, end = entry["data_offsets"]
    arr = np.empty(tuple(entry["shape"]), ST_DTYPES[entry["dtype"]])
    if arr.nbytes != end - begin:
        raise InputError(f"tensor {name!r} in {getattr(fh, 'name', '?')}: header says "
                         f"{end - begin} bytes for shape {entry['shape']} {entry['dtype']}")
    fh.seek(data_start + begin)
    if fh.readinto(memoryview(arr.reshape(-1).view(np.uint8))) != arr.nbytes:
        raise InputError(f"tensor {name!r} in {getattr(fh, 'name', '?')}: the file ends "
                         "before its data does (truncated download?)")
    return arr


def file_order(specs: dict[str, tuple[tuple[int, ...], Any]]) -> list[str]:
    """Tensor names in the order safetensors lays them out: dtype (widest first), then name."""
    return sorted(specs, key=lambda n: (_RANK[st_code(specs[n][1])], n))


def header_bytes(specs: dict[str, tuple[tuple[int, ...], Any]],
                 metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length + JSON header for tensors of these shapes and dtypes."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name in file_order(specs):
        shape, dtype = specs[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": st_code(dtype), "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(blob)) + blob


def write_safetensors(path: Path, specs: dict[str, tuple[tuple[int, ...], Any]],
                      tensor: Callable[[str], np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``path`` asking ``tensor(name)`` for each tensor in file order, one at a time.

    ``specs`` maps each name to (shape, dtype): the header is written from it before any data,
    and every produced array is checked against it (a mismatch would corrupt the file).
    """
    with open(path, "wb") as fh:
        fh.write(header_bytes(specs, metadata))
        for name in file_order(specs):
            arr = np.ascontiguousarray(tensor(name))
            shape, dtype = specs[name]
            if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
                raise InputError(f"tensor {name!r}: produced {arr.dtype.name}{list(arr.shape)}, "
                                 f"but {path}'s header says {np.dtype(dtype).name}{list(shape)}")
            fh.write(memoryview(arr.reshape(-1).view(np.uint8)))
            del arr  # one tensor on the host at a time
