"""What a result carries besides its numbers: the commit measured and how it was run.

Why: a figure without its command, machine and commit cannot be compared with a later run.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
from pathlib import Path
from typing import Any

from bench.lib.child import ROOT


def git_commit() -> str:
    """The checkout's short HEAD (empty outside a git checkout): the code a run measured."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return ""


def peer_report(report: dict[str, Any], command: str, out: str | None) -> None:
    """Finish a peer benchmark's report: run metadata with google-tunix's version and the
    commit, written to ``out`` (if given) and printed."""
    from jaxrl_sym.report import run_metadata

    report.update(run_metadata(command))
    report["git"] = git_commit()
    report["versions"]["google-tunix"] = md.version("google-tunix")
    text = json.dumps(report, indent=1)
    if out:
        Path(out).write_text(text)
    print(text)


def write_table(out: str | Path, stem: str, rows: list[dict[str, Any]], md: str) -> None:
    """An experiment's rows as ``out/stem.jsonl`` and its rendered table as ``out/stem.md``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / f"{stem}.md").write_text(md + "\n")
