"""``jaxrl-sym decode --engine JSON``: the runtime options training takes, reachable from the
decode command (issue 49 item 1) — refill through resident rows gives the baseline's tokens, and
every mistake is refused by name before any system runs."""

from __future__ import annotations

import json

import pytest

from jaxrl_sym.cli import main

SMALL = ["--tokens", "12", "--batch", "10", "--prompt-len", "4:12", "--no-warm"]


def test_decode_with_refill_through_resident_rows_matches_padded(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["decode", "--systems", "sym,padded", "--engine",
               '{"refill": true, "microbatch_rows": 4}', *SMALL, "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert report["check"]["tokens_equal"], report["check"]
    assert report["config"]["engine"] == {"refill": True, "microbatch_rows": 4}


@pytest.mark.parametrize("systems, engine, message", [
    ("sym", '{"refil": true}', "--engine: EngineOptions has no field refil"),
    ("sym", '{"refill": true, "microbatch_rows": -1}', "--engine: EngineOptions.microbatch_rows"),
    ("sym", "[8]", "--engine must be a JSON object"),
    ("sym", "{refill: true}", "--engine: not JSON"),
    ("sym", '{"backend": "triton"}', "give the backend with --backend"),
    ("padded", '{"refill": true}', "--engine sets the runtime of sym; --systems 'padded' has "
                                   "none"),
])
def test_bad_engine_options_are_refused_by_name(systems: str, engine: str, message: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["decode", "--systems", systems, "--engine", engine, *SMALL]) == 2
    assert message in capsys.readouterr().err
