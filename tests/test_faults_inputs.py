"""Nothing silent (issue 11): every generation input is checked where it is given, the CLI fails
before the work and names the flag the user typed, and the decode report ends with a verdict.

Each fault here used to be silent or late: NaN/inf temperature gave all-zero tokens with NaN
log-probs; ``np.int64`` limits gave a misleading message; seeds >= 2**32 or < 0 crashed the
symbolic runtime while the padded baseline accepted them; ``decode --tokens 0`` failed 17-47 s
later inside a child process with internal names.
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.cli import PRESETS, main, parse_prompt_len
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, seed32
from jaxrl_sym.output_paths import check_output_dir, check_output_file, path_errors
from jaxrl_sym.report import MEMORY_LEGEND, verdict_lines

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- GenerationConfig: every field


@pytest.mark.parametrize("t", [math.nan, math.inf, -math.inf, -1.0, -1e-9, np.float32("nan")])
def test_non_finite_or_negative_temperature_is_refused(t: float) -> None:
    with pytest.raises(InputError, match=r"temperature=.*finite and >= 0"):
        GenerationConfig(max_new_tokens=4, temperature=t)


def test_replace_revalidates() -> None:
    """``dataclasses.replace`` builds a new config, so it cannot smuggle a NaN past the check."""
    cfg = GenerationConfig(max_new_tokens=4, temperature=1.0)
    with pytest.raises(InputError, match="temperature=nan"):
        dataclasses.replace(cfg, temperature=math.nan)


@pytest.mark.parametrize(("field", "value"), [
    ("max_new_tokens", True), ("temperature", True), ("seed", False), ("eos_id", True),
    ("max_len", True), ("prefill_logits_bytes", True), ("max_new_tokens", np.True_),
])
def test_bools_are_not_ints(field: str, value: object) -> None:
    kw = {"max_new_tokens": 4, field: value}
    with pytest.raises(InputError, match=field):
        GenerationConfig(**kw)


@pytest.mark.parametrize(("kw", "match"), [
    ({"max_new_tokens": 0}, r"max_new_tokens=0: must be >= 1"),
    ({"max_new_tokens": 2.0}, r"max_new_tokens=2.0 \(float\)"),
    ({"max_new_tokens": "5"}, r"max_new_tokens='5'"),
    ({"max_new_tokens": ()}, r"max_new_tokens=\(\)"),
    ({"max_new_tokens": np.ones((2, 2), np.int64)}, r"max_new_tokens="),
    ({"max_new_tokens": (3, np.int64(0))}, r"max_new_tokens\[1\]=0: must be >= 1"),
    ({"max_new_tokens": 4, "eos_id": -1}, r"eos_id=-1: must be >= 0"),
    ({"max_new_tokens": 4, "eos_id": 1.0}, r"eos_id=1.0"),
    ({"max_new_tokens": 4, "seed": 1.5}, r"seed=1.5"),
    ({"max_new_tokens": 4, "max_len": 0}, r"max_len=0"),
    ({"max_new_tokens": 4, "prefill_logits_bytes": 0}, r"prefill_logits_bytes=0"),
    ({"max_new_tokens": 4, "return_logits": 1}, r"return_logits=1"),
    ({"max_new_tokens": 4, "temperature": "1"}, r"temperature='1'"),
])
def test_bad_fields_name_field_and_value(kw: dict, match: str) -> None:
    with pytest.raises(InputError, match=match):
        GenerationConfig(**kw)


_NP_INTS = st.sampled_from([int, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 120), _NP_INTS), min_size=1, max_size=8),
       st.integers(0, 120), _NP_INTS, st.sampled_from([tuple, list, np.array]))
def test_numpy_integers_become_python_ints(limits, eos, eos_type, container) -> None:
    """NumPy scalars (what array arithmetic hands you) work wherever an int does, and come out
    as plain Python ints so that static arguments and hashing behave the same everywhere."""
    values = [t(v) for v, t in limits]
    seq = container(values)
    cfg = GenerationConfig(max_new_tokens=seq, eos_id=eos_type(eos), seed=np.int64(eos))
    assert cfg.max_new_tokens == tuple(v for v, _ in limits)
    assert all(type(v) is int for v in cfg.max_new_tokens)
    assert type(cfg.eos_id) is int and cfg.eos_id == eos and type(cfg.seed) is int
    one = GenerationConfig(max_new_tokens=values[0])
    assert one.max_new_tokens == limits[0][0] and type(one.max_new_tokens) is int
    hash(cfg)  # still usable as a cache key


@settings(max_examples=100, deadline=None)
@given(st.integers(-(2**130), 2**130))
def test_any_integer_seed_maps_mod_2_32(seed: int) -> None:
    cfg = GenerationConfig(max_new_tokens=1, seed=seed)
    assert cfg.seed == seed % 2**32 == seed32(seed)
    assert 0 <= cfg.seed < 2**32 and type(cfg.seed) is int
    if 0 <= seed < 2**32:
        assert cfg.seed == seed  # every seed that already worked is unchanged


@settings(max_examples=60, deadline=None)
@given(st.integers(-(2**40), 2**40))
def test_limits_below_one_are_refused_with_their_index(bad: int) -> None:
    if bad >= 1:
        assert GenerationConfig(max_new_tokens=(1, bad)).max_new_tokens == (1, bad)
    else:
        with pytest.raises(InputError, match=rf"max_new_tokens\[1\]={bad}: must be >= 1"):
            GenerationConfig(max_new_tokens=(1, bad))


# ----------------------------------------------- seeds of any size: sym and padded agree exactly


@cache
def _tiny():
    """One tiny model and one engine for every seed: the runtime's seed is a traced argument, so
    its programs compile once (the padded baseline's seed is static: one compile per seed)."""
    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.runtime.engine import SymbolicLM
    from jaxrl_sym.runtime.options import EngineOptions

    model = init_model(preset("tiny"), 0)
    return model, SymbolicLM(model, EngineOptions(min_capacity=4))


def _sample(system: str, seed: object) -> list[np.ndarray]:
    from jaxrl_sym.baselines.padded import padded_generate

    prompts = [np.array([1, 2, 3], np.int32), np.arange(5, 12, dtype=np.int32)]
    cfg = GenerationConfig(max_new_tokens=(np.int64(6), np.int32(4)), temperature=1.0, seed=seed)
    model, engine = _tiny()
    if system == "sym":
        return engine.generate(prompts, cfg).tokens
    return padded_generate(model, prompts, cfg).tokens


@pytest.mark.parametrize("seed", [-1, 2**64 + 7, np.int64(-3), np.uint64(2**63 + 1)])
def test_huge_and_negative_seeds_give_identical_tokens_in_sym_and_padded(seed: object) -> None:
    """Used to be ``OverflowError`` in the runtime (uint32 cast) and accepted by the baseline."""
    sym, pad = _sample("sym", seed), _sample("padded", seed)
    for i, (a, b) in enumerate(zip(sym, pad, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"seed {seed}, row {i}")


def test_seeds_equal_mod_2_32_sample_the_same() -> None:
    """The documented consequence of the rule, checked on real sampling."""
    for a, b in zip(_sample("sym", 2**32 + 9), _sample("sym", 9), strict=True):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ CLI: fail before the work


_PROBE = """import sys
from jaxrl_sym.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print("\\nJAX IMPORTED" if "jax" in sys.modules else "\\nJAX NOT IMPORTED")
sys.exit(rc)
"""


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, bool]:
    """The CLI in a process of its own, as a user runs it; and whether it answered before
    importing JAX — why a bad flag costs no start-up (a count, not a wall-clock bound that
    a loaded machine can break)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    return proc, proc.stdout.rstrip().endswith("JAX NOT IMPORTED")


@pytest.mark.parametrize(("args", "message"), [
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--batch", "-3"], "--batch must be >= 1, got -3"),
    (["--window", "0"], "--window must be >= 1, got 0"),
    (["--block", "0"], "--block must be >= 1, got 0"),
    (["--prompt-len", "10:3"], "--prompt-len must satisfy 1 <= MIN <= MAX, got '10:3'"),
    (["--prompt-len", "0:3"], "--prompt-len must satisfy 1 <= MIN <= MAX"),
    (["--prompt-len", "a:b"], "--prompt-len must be MIN:MAX"),
    (["--systems", "sym,nope"], "--systems must name systems from"),
    (["--systems", "sym,sym"], "--systems names a system twice"),
    (["--systems", ","], "--systems must name systems from"),
    (["--model", "nocolon"], "--model must be MODULE:FUNCTION"),
    (["--model", "surely_no_such_module_xyz:make"], "--model surely_no_such_module_xyz:make"),
    (["--out", "/nonexistent-dir-xyz/report.json"], "--out /nonexistent-dir-xyz/report.json"),
    (["--preset", "huge"], "--preset"),
    (["--attention", "sparse"], "--attention"),
    (["--tokens", "many"], "--tokens"),
])
def test_decode_bad_flag_fails_fast_naming_the_flag(args: list[str], message: str) -> None:
    proc, before_jax = _cli("decode", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert before_jax, args


def test_decode_reports_every_bad_flag_at_once() -> None:
    proc, _ = _cli("decode", "--tokens", "0", "--batch", "0", "--prompt-len", "10:3")
    assert proc.returncode == 2
    for flag in ("--tokens", "--batch", "--prompt-len"):
        assert f"error: {flag}" in proc.stderr


def test_cli_checks_import_no_jax() -> None:
    """The reason bad flags are fast: the CLI module (and what it imports) stays JAX-free."""
    code = ("import sys, jaxrl_sym.cli, jaxrl_sym.generation, jaxrl_sym.report; "
            "sys.exit('jax' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_help_shows_defaults_and_choices_without_internals() -> None:
    top, before_jax = _cli("--help")
    assert top.returncode == 0 and before_jax
    assert "SUPPRESS" not in top.stdout and "_system" not in top.stdout
    assert "decode" in top.stdout and "train" in top.stdout
    dec, _ = _cli("decode", "--help")
    assert dec.returncode == 0
    out = " ".join(dec.stdout.split())  # argparse wraps lines at the terminal's width
    for text in ("(default: 128)", "(default: 8:24)", "(default: sym,padded)",
                 "{full,window,block,linear,mixed}", "{xla,triton,pallas,auto}",
                 "{" + ",".join(PRESETS) + "}", "(default: decode-cpu)"):
        assert text in out, text
    assert "SUPPRESS" not in out and "default: None" not in out


def test_train_help_shows_defaults(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    # the flag's own help (from RunConfig's field) sits between the flag and its default
    assert re.search(r"--steps STEPS [^-]*\(default: 400\)", out), out
    assert "(default: grpo)" in out


def test_preset_choices_match_the_model_presets() -> None:
    from jaxrl_sym.models.lm import preset_names

    assert set(PRESETS) == {"decode-cpu", *preset_names()}


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--group", "0"], "--group must be >= 1"),
    (["--lr", "nan"], "--lr must be finite and > 0, got nan"),
    (["--lr", "0"], "--lr must be finite and > 0"),
    (["--beta", "-0.1"], "--beta must be finite and >= 0"),
    (["--beta", "inf"], "--beta must be finite and >= 0, got inf"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--metrics", "/nonexistent-dir-xyz/m.jsonl"], "--metrics /nonexistent-dir-xyz/m.jsonl"),
    (["--plot", "/nonexistent-dir-xyz/p.png"], "--plot /nonexistent-dir-xyz/p.png"),
    (["--checkpoint-dir", "/nonexistent-dir-xyz/ckpt"], "--checkpoint-dir"),
])
def test_train_bad_flag_fails_before_any_step(args: list[str], message: str, capsys) -> None:
    import jax.monitoring

    import jaxrl_sym.rl.run.cli  # noqa: F401  (its import is not what is checked)

    compiles: list[str] = []  # XLA compiles while the command runs: none, so no step ran
    listen = lambda event, secs, **kw: compiles.append(event) if "compile" in event else None
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert main(["train", "--no-progress", *args]) == 2
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert compiles == []


# ------------------------------------------------------------- argument helpers (properties)


@settings(max_examples=200, deadline=None)
@given(st.integers(-50, 5000), st.integers(-50, 5000), st.booleans())
def test_prompt_len_accepts_exactly_ordered_positive_pairs(lo: int, hi: int, single: bool) -> None:
    text, want = (str(lo), (lo, lo)) if single else (f"{lo}:{hi}", (lo, hi))
    if 1 <= want[0] <= want[1]:
        assert parse_prompt_len(text) == want
    else:
        with pytest.raises(ValueError, match="--prompt-len"):
            parse_prompt_len(text)


def _file(flag: str, path: Path) -> list[str]:
    return path_errors(check_output_file, flag, str(path))


def _dir(flag: str, path: Path) -> list[str]:
    return path_errors(check_output_dir, flag, str(path))


def test_output_paths(tmp_path: Path) -> None:
    assert _file("--out", tmp_path / "r.json") == []
    assert path_errors(check_output_file, "--out", None) == []
    assert "is a directory" in _file("--out", tmp_path)[0]
    assert "does not exist" in _file("--out", tmp_path / "no" / "r.json")[0]
    assert _dir("--checkpoint-dir", tmp_path / "new") == []
    assert _dir("--checkpoint-dir", tmp_path) == []
    (tmp_path / "f").write_text("x")
    assert "not a directory" in _dir("--checkpoint-dir", tmp_path / "f")[0]
    assert "does not exist" in _dir("--checkpoint-dir", tmp_path / "a" / "b")[0]
    with pytest.raises(InputError, match=r"--rows .* is a directory"):
        check_output_file(str(tmp_path), "--rows")


def test_read_only_output_paths(tmp_path: Path, unwritable_dir: Path) -> None:
    ro = unwritable_dir
    try:
        error = _file("--metrics", ro / "m.jsonl")[0]
        assert "--metrics" in error and "cannot write" in error
        assert "cannot write" in _dir("--checkpoint-dir", ro)[0]
        assert "cannot write" in _dir("--checkpoint-dir", ro / "c")[0]
        proc, before_jax = _cli("decode", "--out", str(ro / "r.json"))
        assert proc.returncode == 2 and "--out" in proc.stderr and "cannot write" in proc.stderr
        assert before_jax
    finally:
        (tmp_path / "ro").chmod(0o755)


# --------------------------------------------------------------------- the verdict line


def _report(sym: dict, **baselines: dict) -> dict:
    return {"config": {"warm": True}, "systems": {"sym": sym, **baselines}}


def test_verdict_from_measured_numbers() -> None:
    rep = _report({"s_per_token": 0.001, "peak_bytes": 100},
                  padded={"s_per_token": 0.0033, "peak_bytes": 350},
                  pershape={"s_per_token": 0.0005, "peak_bytes": 130})
    rep["checks"] = {"padded": {"tokens_equal": True, "rows": 4, "rows_differ": 0},
                     "pershape": {"tokens_equal": False, "rows": 4, "rows_differ": 3}}
    assert verdict_lines(rep) == [
        "sym is 3.3× faster per token and uses 3.5× less memory than padded; tokens identical",
        "sym is 2.0× slower per token and uses 1.3× less memory than pershape; "
        "tokens differ: 3 of 4 rows",
    ]


def test_verdict_more_memory_cold_runs_and_old_reports() -> None:
    rep = _report({"s_per_token": 0.002, "peak_bytes": 300},
                  padded={"s_per_token": 0.002, "peak_bytes": 200})
    rep["config"]["warm"] = False
    rep["check"] = {"tokens_equal": True}  # reports before per-baseline checks
    (line,) = verdict_lines(rep)
    assert line == ("sym is 1.0× faster per token (cold run, compiles included) and uses 1.5× "
                    "more memory than padded; tokens identical")


def test_verdict_is_honest_about_failures_and_gaps() -> None:
    ok = {"s_per_token": 0.001, "peak_bytes": 100}
    assert "sym failed" in verdict_lines(_report({"error": ["boom"]}, padded=ok))[0]
    assert "sym was not run" in verdict_lines({"systems": {"padded": ok}})[0]
    assert "no baseline" in verdict_lines(_report(ok))[0]
    assert verdict_lines(_report(ok, padded={"error": ["OOM"]}))[0].startswith("padded failed")
    line = verdict_lines(_report(ok, padded={"s_per_token": 0.002}))[0]
    assert "no memory figure" in line and "tokens not compared" in line


@settings(max_examples=100, deadline=None)
@given(st.floats(1e-6, 10.0), st.floats(1e-6, 10.0), st.integers(1, 2**40),
       st.integers(1, 2**40))
def test_verdict_ratios_match_the_numbers(s_sym, s_pad, m_sym, m_pad) -> None:
    rep = _report({"s_per_token": s_sym, "peak_bytes": m_sym},
                  padded={"s_per_token": s_pad, "peak_bytes": m_pad})
    rep["checks"] = {"padded": {"tokens_equal": True}}
    (line,) = verdict_lines(rep)
    speed = s_pad / s_sym
    word = "faster" if speed >= 1 else "slower"
    assert f"{max(speed, 1 / speed):.1f}× {word} per token" in line
    mem = m_pad / m_sym
    assert f"{max(mem, 1 / mem):.1f}× {'less' if mem >= 1 else 'more'} memory" in line


def test_legend_names_both_memory_figures() -> None:
    assert "peak_bytes" in MEMORY_LEGEND and "peak_rss_bytes" in MEMORY_LEGEND
