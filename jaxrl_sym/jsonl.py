"""JSON lines in and out: a record parsed with an error that names the file and line, and
strict JSON written (:func:`dumps`).

Why a module: user files of JSON lines come in through several doors (length traces for the
suite, prompt/answer records for RL text tasks); each reports a bad line the same way —
``path:line: what is wrong`` — so users fix their file instead of reading a traceback. Out:
Python's ``json`` writes NaN and Infinity bare, which is not JSON (jq, JavaScript and most
parsers refuse the line); every record this package prints or logs goes through :func:`dumps`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jaxrl_sym.errors import InputError


def read_lines(path: Path, what: str) -> list[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line of a JSON-lines file.

    Lines end at ``\\n`` only (``\\r\\n`` too): ``str.splitlines`` also splits at U+2028,
    U+2029 and U+0085, which JSON allows unescaped inside strings, so a valid file
    was refused as invalid. Each line is decoded on its own, so bytes that are not UTF-8 are
    reported with their line; ``what`` names the file's role (``--trace``, ``task file``)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InputError(f"cannot read {what} {path}: {err.strerror or err}") from None
    out = []
    for n, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"{path}:{n}: bytes that are not UTF-8 at column {err.start + 1} "
                             f"({raw[err.start:err.end]!r}); save the {what} as UTF-8") from None
        if line.strip():
            out.append((n, line))
    return out


def parse_object(line: str, where: str, expected: str) -> dict[str, Any]:
    """The JSON object on ``line``; ``where`` is ``path:line``, ``expected`` says what object
    the file should hold (shown when the line is not an object)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(rec, dict):
        raise InputError(f"{where}: expected {expected}, got {type(rec).__name__}")
    return rec


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON null)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON: a non-finite number is written as null (a bare NaN is not JSON)."""
    return json.dumps(finite(obj), allow_nan=False, **kw)
