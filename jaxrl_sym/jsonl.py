"""One JSON-lines record, parsed with an error that names the file and line.

Why a module: user files of JSON lines come in through several doors (length traces for the
suite, prompt/answer records for RL text tasks); each reports a bad line the same way —
``path:line: what is wrong`` — so users fix their file instead of reading a traceback.
"""

from __future__ import annotations

import json
from typing import Any

from jaxrl_sym.errors import InputError


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
