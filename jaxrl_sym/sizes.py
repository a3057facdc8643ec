"""Byte sizes as users type them (``--memory-limit``, ``--device-memory``): one parser, one
printer. JAX-free, so command lines are checked before JAX starts."""

from __future__ import annotations

import math
import re

from jaxrl_sym.errors import InputError

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20,
          "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str | int, flag: str = "--memory-limit") -> int:
    """``40e9``, ``16G``/``16GB`` (10**9), ``8GiB`` (2**30), ``123`` → bytes (>= 1), else an
    InputError naming ``flag``. Integers stay exact: ``4611686019G`` is not rounded through a
    float."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgt]i?)?b?\s*", str(text).lower())
    num = m.group(1) if m else "nan"
    try:
        value = (int(num) if num.isdigit() else float(num)) * _UNITS[m.group(2) or ""] if m \
            else math.nan
    except ValueError:  # "1.2.3"
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise InputError(f"{flag} must be a byte count >= 1 like 40e9, 16G or 8GiB, got "
                         f"{text!r}")
    return int(value)


def human_bytes(n: int) -> str:
    """``1.5 GiB``, ``12.0 MiB``, ``300 B``: for messages."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"
