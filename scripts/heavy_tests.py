"""Write ``tests/heavy_tests.json`` (the tests CI rotates through, ``tests/shards.py``) from the
JUnit XML of a whole-suite run on CI's kind of machine.

    PYTEST_ADDOPTS="--junitxml=/tmp/suite.xml" make test-all
    .venv/bin/python scripts/heavy_tests.py /tmp/suite.xml --source "tree 1234abc, clean clone"

A test of ``--min-seconds`` or more is heavy; every test of a ``--pin`` file always runs
(default: the transformers/PEFT oracle files, which issue 49 wants in every CI run).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINNED = ("tests/test_hf_lora.py", "tests/test_hf_export.py")


def node_id(classname: str, name: str) -> str:
    """pytest's id of a JUnit test case: ``tests.test_x`` → ``tests/test_x.py``, and a class
    inside the module (``tests.test_x.TestY``) kept as ``::TestY``."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[cut:], name])
    raise SystemExit(f"{classname}: no such test module under {ROOT} (a JUnit file of this "
                     "repository's suite?)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", type=Path, help="JUnit XML of a whole-suite run")
    p.add_argument("--source", required=True, help="where the times come from (tree, machine)")
    p.add_argument("--min-seconds", type=float, default=10.0)
    p.add_argument("--pin", nargs="*", default=list(PINNED), help="files whose tests always run")
    p.add_argument("--out", type=Path, default=ROOT / "tests" / "heavy_tests.json")
    args = p.parse_args(argv)
    try:
        cases = list(ET.parse(args.junit).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as e:
        sys.exit(f"{args.junit}: cannot read it as JUnit XML ({e})")
    seconds = {node_id(c.get("classname", ""), c.get("name", "")): round(float(c.get("time")), 1)
               for c in cases if float(c.get("time", 0)) >= args.min_seconds}
    table = {"source": args.source, "min_seconds": args.min_seconds, "tests_in_run": len(cases),
             "pinned_files": args.pin, "seconds": dict(sorted(seconds.items()))}
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{args.out}: {len(seconds)} heavy tests of {len(cases)}, "
          f"{sum(seconds.values()):.0f} s of {sum(float(c.get('time')) for c in cases):.0f} s")


if __name__ == "__main__":
    main()
