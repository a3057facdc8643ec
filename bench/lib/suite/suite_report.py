"""Markdown tables of the suite's rows: the full table (``results.md``) and a short summary
(``SUITE.md``) to link from the top-level README.

Why a module of its own: the tables are pure functions of the JSONL rows, so they can be
re-rendered (``python -m bench suite --render``) and tested without running anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench.lib.roles import BASELINE, REFERENCE, base_name, rank, reference

Row = dict[str, Any]

FOOTNOTE = """\
**Definitions.** *s/token*: seconds per decode step (one new token for every live row), steady
state; sym: a second call on the same request (no compiles), padded and per-shape: their own
execution timers, compiles excluded. *incl. compile*: wall-clock seconds of the first call / N.
*peak*: on CPU the runtime's accounted peak of live device-buffer bytes (weights, KV caches or
stores, outputs) plus the running executable's XLA temporaries; on GPU the allocator's
`peak_bytes_in_use` with preallocation disabled. *RSS*: the child process's peak resident set.
*compiles*: XLA backend compiles in the first call. *pad (tokens)*: token positions pushed through
the model but not needed / computed (needed: each row's prompt and the generated tokens fed
back; padded and per-shape compute every row for N steps from a left-padded prompt block, sym its
live-row bucket). *pad (keys)*: attention key slots attended in decode steps but not needed by
the pattern / attended (needed S(q): q+1 full, min(q+1, w) window, q mod b + 1 block, 1 linear
state; padded attends over P + N slots for every pattern, sym over its store's slots).
`oom` = out of memory (recorded, not a crash); `error`/`timeout` = failed, retried on the next
run. Each row ends at its limit as if EOS had been sampled there."""


def _f(x: Any, scale: float = 1.0, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int) and scale == 1.0:
        return f"{x:,}"
    return f"{float(x) * scale:.{digits}g}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _by(rows: Sequence[Row], scenario: str) -> list[Row]:
    return [r for r in rows if r.get("scenario") == scenario]


def _system_order(system: str) -> tuple[bool, tuple[int, int]]:
    """Tables list the system under test first, then the baseline and the rest."""
    return (base_name(system) != REFERENCE, rank(system))


_KIND_ORDER = {"full": 0, "window": 1, "block": 2, "linear": 3, "mixed": 4}


def _sort(rows: Sequence[Row], *keys: Callable[[Row], Any]) -> list[Row]:
    return sorted(rows, key=lambda r: (*(k(r) for k in keys), _system_order(r["system"])))


def _status_cells(r: Row, n: int) -> list[str]:
    return [f"**{r['status']}**"] + ["–"] * (n - 1)


def _check_cell(r: Row) -> str:
    c = r.get("check_vs_padded")
    if not c:
        return "–"
    s = "yes" if c["tokens_equal"] else "**no**"
    if "max_abs_logprob_diff" in c:
        s += f" ({c['max_abs_logprob_diff']:.1g})"
    return s


def _gen_cells(r: Row) -> list[str]:
    return [_f(r["s_per_token"], 1e3), _f(r["s_per_token_with_compile"], 1e3),
            _f(r["peak_bytes"], 2**-20), _f(r["peak_rss_bytes"], 2**-20),
            _f(r["xla_compiles"]), _f(r.get("padding_fraction"), 100),
            _f(r.get("key_padding_fraction"), 100), _check_cell(r)]


GEN_HEAD = ("ms/token", "ms/token incl. compile", "peak MB", "RSS MB", "compiles",
            "pad tokens %", "pad keys %", "tokens = padded (max Δ logprob)")


def decode_table(rows: Sequence[Row]) -> str:
    rs = _sort(_by(rows, "decode"), lambda r: _KIND_ORDER.get(r["attention"], 9),
               lambda r: r["tokens"])
    body = []
    for r in rs:
        cells = _gen_cells(r) if r["status"] == "ok" else _status_cells(r, len(GEN_HEAD))
        body.append([r["attention"], _f(r["tokens"]), r["system"], *cells])
    return _table(("attention", "N", "system", *GEN_HEAD), body)


def _pairs(rows: Sequence[Row], scenario: str, group: Callable[[Row], Any]) -> list[tuple]:
    """(group value, sym row, padded row) for every group where both exist."""
    out = []
    groups: dict[Any, dict[str, Row]] = {}
    for r in _by(rows, scenario):
        groups.setdefault(group(r), {})[r["system"]] = r
    for g, by_sys in groups.items():
        ref = reference(sorted(by_sys, key=rank))
        sym = by_sys.get(ref) if ref else None
        if sym is not None and BASELINE in by_sys:
            out.append((g, sym, by_sys[BASELINE]))
    return out


def _ratio(p: Row, s: Row, key: str) -> str:
    if p["status"] == "oom" and s["status"] == "ok":
        return "padded OOM"
    if p["status"] != "ok" or s["status"] != "ok":
        return "–"
    return f"{p[key] / s[key]:.2f}×" if s[key] else "–"


def decode_ratios(rows: Sequence[Row]) -> str:
    pairs = sorted(_pairs(rows, "decode", lambda r: (r["attention"], r["tokens"])),
                   key=lambda t: (_KIND_ORDER.get(t[0][0], 9), t[0][1]))
    body = [[k, _f(n), _ratio(p, s, "s_per_token"), _ratio(p, s, "s_per_token_with_compile"),
             _ratio(p, s, "peak_bytes"), _f(s.get("xla_compiles")),
             _f(p.get("key_padding_fraction"), 100), _f(s.get("key_padding_fraction"), 100)]
            for (k, n), s, p in pairs]
    return _table(("attention", "N", "padded ÷ sym s/token", "… incl. compile",
                   "padded ÷ sym peak bytes", "sym compiles", "padded pad keys %",
                   "sym pad keys %"), body)


def lengths_table(rows: Sequence[Row], scenario: str) -> str:
    rs = _sort(_by(rows, scenario), lambda r: r.get("run", 0))
    head = ("run", "median", "max limit", "useful tokens", "system", "s (steady)",
            "s incl. compile", "useful tokens/s", "peak MB", "RSS MB", "compiles",
            "pad tokens %", "pad keys %", "tokens = padded")
    body = []
    for r in rs:
        lead = [_f(r.get("run", 0)), _f(r["median"]), _f(r.get("max_limit")),
                _f(r.get("useful_tokens")), r["system"]]
        if r["status"] != "ok":
            body.append([*lead, *_status_cells(r, len(head) - len(lead))])
            continue
        body.append([*lead, _f(r["seconds"]), _f(r["seconds_with_compile"]),
                     _f(r["useful_tokens"] / r["seconds"]), _f(r["peak_bytes"], 2**-20),
                     _f(r["peak_rss_bytes"], 2**-20), _f(r["xla_compiles"]),
                     _f(r.get("padding_fraction"), 100), _f(r.get("key_padding_fraction"), 100),
                     _check_cell(r)])
    return _table(head, body)


def rlft_table(rows: Sequence[Row]) -> str:
    rs = _sort(_by(rows, "rlft"), lambda r: 0)
    head = ("system", "step s", "generation s", "reference s", "update s", "useful tokens/s",
            "peak MB", "train pad %", "warm-up s (compiles)")
    body = []
    for r in rs:
        if r["status"] != "ok":
            body.append([r["system"], *_status_cells(r, len(head) - 1)])
            continue
        sec = r["seconds"]
        body.append([r["system"], _f(sec["total"]), _f(sec["generation"]), _f(sec["reference"]),
                     _f(sec["update"]), _f(r["useful_tokens_per_s"]),
                     _f(r["peak_bytes"], 2**-20), _f(r.get("padding_fraction"), 100),
                     f"{_f(r.get('warmup_seconds'))} ({r.get('warmup_compiles', '–')})"])
    text = _table(head, body)
    ratios = next((r.get("ratios") for r in rs if r.get("ratios")), None)
    if ratios:
        text += "\n\nsym vs padded (> 1: sym better): " + ", ".join(
            f"{k} {v:.2f}×" for k, v in ratios.items())
    return text


def trace_table(rows: Sequence[Row]) -> str:
    """Per profile and system: idle fraction and useful tokens/s over the whole replay."""
    rs = _sort(_by(rows, "trace"), lambda r: r["profile"])
    head = ("profile", "steps", "useful tokens", "max response", "system", "idle %",
            "useful tokens/s", "s (steady)", "s incl. compile", "compiles", "peak MB")
    body = []
    for r in rs:
        lead = [r["profile"], _f(r["steps"]), _f(r.get("useful_tokens")),
                _f(r.get("max_limit")), r["system"]]
        if r["status"] != "ok":
            body.append([*lead, *_status_cells(r, len(head) - len(lead))])
            continue
        body.append([*lead, _f(r["idle_fraction"], 100), _f(r["useful_tokens_per_s"]),
                     _f(r["seconds"]), _f(r["seconds_with_compile"]), _f(r["xla_compiles"]),
                     _f(r["peak_bytes"], 2**-20)])
    profiles = sorted({(r["profile"], r.get("description", "")) for r in rs})
    notes = "\n".join(f"- `{name}`: {desc}" for name, desc in profiles)
    return _table(head, body) + "\n\n" + notes + "\n\n" + TRACE_NOTE


TRACE_NOTE = """\
*idle %*: token positions computed on padding or on rows that had already finished / all
positions computed, over every step of the profile (sym: the engine's own log; padded: its fixed
shapes, B × max prompt + B × (max response − 1) per step). *useful tokens/s*: response tokens of
the profile / steady-state seconds (sym: each step's second call; padded: its execution timer)."""


def provenance(rows: Sequence[Row]) -> str:
    """Device, versions, commits, dates and commands that produced these rows."""
    if not rows:
        return "_no results yet_"
    r0 = rows[0]
    dates = sorted(r.get("date", "") for r in rows if r.get("date"))
    commands = sorted({r.get("command", "") for r in rows if r.get("command")})
    gits = sorted({r.get("git", "") for r in rows if r.get("git")})
    versions = ", ".join(f"{k} {v}" for k, v in r0.get("versions", {}).items())
    lines = [f"- device: `{r0.get('device', '?')}` ({r0.get('platform', '?')})",
             f"- versions: {versions}",
             f"- date: {dates[0]} … {dates[-1]}" if dates else "- date: ?",
             f"- git: {', '.join(gits)}",
             "- command: " + "; ".join(f"`{c}`" for c in commands)]
    return "\n".join(lines)


def render_markdown(rows: Sequence[Row]) -> str:
    """Every table, with provenance and definitions."""
    parts = ["# Padding vs symbolic: benchmark suite results", "", provenance(rows), ""]
    if _by(rows, "decode"):
        parts += ["## Decoding (every row runs to N tokens)", "", "### sym vs padded", "",
                  decode_ratios(rows), "", "### All systems", "", decode_table(rows), ""]
    for sc, title in (("realistic", "Realistic lengths (log-normal responses, EOS at sampled "
                                    "lengths)"),
                      ("growing", "Growing lengths (median response length rising 10×)")):
        if _by(rows, sc):
            parts += [f"## {title}", "", lengths_table(rows, sc), ""]
    if _by(rows, "rlft"):
        parts += ["## RL fine-tuning step (GRPO, `python -m bench rlft_step`)", "",
                  rlft_table(rows), ""]
    if _by(rows, "trace"):
        parts += ["## Trace-driven length profiles (`--only trace`)", "", trace_table(rows), ""]
    parts += [FOOTNOTE, ""]
    return "\n".join(parts)


def render_summary(rows: Sequence[Row], suite_dir: str = "suite") -> str:
    """The short form for the README: headline ratios, the plots, links to the full table."""
    parts = ["# Benchmark suite (padding vs symbolic)", "", provenance(rows), "",
             f"Full tables: [{suite_dir}/results.md]({suite_dir}/results.md); raw rows: "
             f"[{suite_dir}/results.jsonl]({suite_dir}/results.jsonl).", ""]
    if _by(rows, "decode"):
        parts += ["## Decoding, sym vs padded", "", decode_ratios(rows), "",
                  f"![time]({suite_dir}/decode_time.png)", "",
                  f"![memory]({suite_dir}/decode_memory.png)", "",
                  f"![compiles and padding]({suite_dir}/decode_compiles_padding.png)", ""]
    if _by(rows, "realistic") or _by(rows, "growing"):
        parts += ["## Realistic and growing lengths", ""]
        for sc in ("realistic", "growing"):
            if _by(rows, sc):
                parts += [lengths_table(rows, sc), ""]
        parts += [f"![lengths]({suite_dir}/lengths.png)", ""]
    if _by(rows, "rlft"):
        parts += ["## RL step", "", rlft_table(rows), ""]
    if _by(rows, "trace"):
        parts += ["## Trace-driven length profiles", "", trace_table(rows), "",
                  f"![idle fraction]({suite_dir}/trace_idle.png)", ""]
    parts += [FOOTNOTE, ""]
    return "\n".join(parts)
