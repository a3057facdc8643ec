"""What every result file carries: device, package versions, date and the command that made it.

One function so every benchmark and CLI report stamps results the same way (results without
their provenance cannot be compared across machines or sessions).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata as md
import sys
from typing import Any

PACKAGES = ("jax", "jaxlib", "flax", "numpy", "optax", "triton", "jax-triton")


def run_metadata(command: str | None = None) -> dict[str, Any]:
    """``device``, ``versions``, ``date`` (UTC, ISO 8601) and ``command`` (default: argv)."""
    import jax

    versions = {}
    for pkg in PACKAGES:
        with contextlib.suppress(md.PackageNotFoundError):
            versions[pkg] = md.version(pkg)
    return {
        "device": str(jax.devices()[0].device_kind),
        "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(sys.argv),
    }
