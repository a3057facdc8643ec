"""What every result file carries: device, package versions, date and the command that made it;
and what a comparison report concludes (one verdict line per baseline, a legend for its memory
figures).

One function so every benchmark and CLI report stamps results the same way (results without
their provenance cannot be compared across machines or sessions). JAX is imported only inside
:func:`run_metadata`, so the CLI can load this module before it has checked its flags.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata as md
import math
import sys
from typing import Any

from jaxrl_sym import systems

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


# Which memory figure is which: the two columns of the decode table measure different things,
# and the verdict compares only the first.
MEMORY_LEGEND = (
    "peak_bytes: device memory at the generation's peak (GPU: allocator peak; CPU: live arrays "
    "+ XLA temps); the verdict uses it.\n"
    "peak_rss_bytes: the whole process's peak resident memory (Python, JAX, compiler included)."
)


def write_peer_report(report: dict[str, Any], script: str, out: str | None) -> None:
    """Finish a peer benchmark's report: run metadata with google-tunix's version, written to
    ``out`` (if given) and printed."""
    import json
    from pathlib import Path

    report.update(run_metadata(f"python {script} " + " ".join(sys.argv[1:])))
    report["versions"]["google-tunix"] = md.version("google-tunix")
    text = json.dumps(report, indent=1)
    if out:
        Path(out).write_text(text)
    print(text)


def _times(ratio: float, verb: str, better: str, worse: str, missing: str) -> str:
    """``is 3.3× faster`` / ``is 1.5× slower`` from a ratio baseline/sym (> 1: sym is better)."""
    if not math.isfinite(ratio) or ratio <= 0:
        return missing
    return f"{verb} {ratio:.1f}× {better}" if ratio >= 1 else f"{verb} {1 / ratio:.1f}× {worse}"


def _tokens_phrase(check: dict[str, Any] | None) -> str:
    if check is None:
        return "tokens not compared (no arrays from one of the runs)"
    if "not_compared" in check:
        return f"tokens not compared: {check['not_compared']}"
    if check.get("tokens_equal"):
        return "tokens identical"
    n, rows = check.get("rows_differ"), check.get("rows")
    return (f"tokens differ: {n} of {rows} rows" if n is not None and rows is not None
            else "tokens differ")


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """One sentence per baseline (every system other than ``sym``) from the measured numbers:
    speed per token (warm ``s_per_token``), device memory (``peak_bytes``) and whether the tokens
    matched sym's — so nobody has to divide table cells to learn the result.

    ``report`` is the decode report: ``systems`` maps a name to its metrics (or ``{"error":
    ...}``); ``checks`` maps a baseline to its token comparison with sym (older reports carry
    only ``check``, for padded).
    """
    ran: dict[str, dict[str, Any]] = report.get("systems", {})
    checks: dict[str, Any] = dict(report.get("checks") or {})
    ref, base = systems.REFERENCE, systems.BASELINE
    if "check" in report and base not in checks:
        checks[base] = report["check"]
    baselines = [s for s in ran if s != ref]
    sym = ran.get(ref)
    if sym is None:
        return [f"no verdict: {ref} was not run (add it to --systems)"]
    if "error" in sym:
        return [f"no verdict: {ref} failed (see the error above)"]
    if not baselines:
        return [f"no verdict: no baseline was run (add {base} to --systems)"]
    cold = not report.get("config", {}).get("warm", True)
    lines = []
    for name in baselines:
        m = ran[name]
        if "error" in m:
            lines.append(f"{name} failed, so there is no verdict against it (see the error above)")
            continue
        speed = _ratio(m.get("s_per_token"), sym.get("s_per_token"))
        memory = _ratio(m.get("peak_bytes"), sym.get("peak_bytes"))
        lines.append(
            f"{ref} " + _times(speed, "is", "faster per token", "slower per token",
                            "has no per-token time")
            + (" (cold run, compiles included)" if cold else "")
            + " and " + _times(memory, "uses", "less memory", "more memory", "no memory figure")
            + f" than {name}; " + _tokens_phrase(checks.get(name))
        )
    return lines


def _ratio(baseline: Any, sym: Any) -> float:
    """baseline / sym, NaN where either is missing or sym's is not positive."""
    try:
        b, s = float(baseline), float(sym)
    except (TypeError, ValueError):
        return math.nan
    return b / s if s > 0 else math.nan


def decode_table(report: dict[str, Any]) -> str:
    """The decode report as the table the CLI prints: one row per system, the memory legend,
    failures, the verdict lines and speculation's acceptance rates."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="jaxrl-sym decode " + " ".join(f"{k}={v}" for k, v in report["config"].items()))
    cols = ("s_per_token", "s_per_token_with_compile", "peak_bytes", "peak_rss_bytes",
            "xla_compiles", "dispatches")
    t.add_column("system")
    for c in cols:
        t.add_column(c, justify="right")
    for name, m in report["systems"].items():
        if "error" in m or "skipped" in m:
            t.add_row(name, *(["error" if "error" in m else "skipped (memory)"]
                              + [""] * (len(cols) - 1)))
            continue
        t.add_row(name, *(f"{m[c]:.4g}" if isinstance(m[c], float) else f"{m[c]:,}"
                          for c in cols))
    console = Console(record=True, width=140)
    with console.capture() as cap:
        console.print(t)
        console.print(MEMORY_LEGEND, highlight=False)
        for name, m in report["systems"].items():
            if "error" in m:
                console.print(f"[red]{name} failed:[/red] {m['error']}")
        for line in report.get("verdict", []):
            console.print(f"[bold]{line}[/bold]", highlight=False)
        for name, m in report["systems"].items():  # --speculate: drafts the model kept
            if m.get("acceptance_rate") is not None:
                console.print(f"{name}: acceptance rate {m['acceptance_rate']:.3f}",
                              highlight=False)
    return cap.get()
