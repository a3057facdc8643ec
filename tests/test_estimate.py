"""Memory estimates from shapes (issue 11, item 3): every system's bytes are known before it runs,
and ``decode`` refuses a system that cannot fit instead of dying with ``RESOURCE_EXHAUSTED``.

The estimate is checked against the CPU accounting every system reports (``accounted_bytes`` /
``accounted_peak_bytes``: buffer sizes plus XLA's temporaries of the running executable) on zoo
models that are not ``DecoderLM``: within a factor of 2 either way (measured: 0.6-1.0 at these
sizes, where fixed XLA temporaries weigh most).
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import GemmaishConfig, GemmaishLM, GPT2Like, GPTConfig, ScanLM, StackedConfig

from jaxrl_sym import systems
from jaxrl_sym.cli import main, parse_bytes
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.runtime.memory.estimate import (
    AttendCall,
    Estimate,
    _kv_cache_bytes,
    attend_calls,
    gb,
)

ROOT = Path(__file__).resolve().parents[1]
FACTOR = 2.0  # estimate / measured within [1/FACTOR, FACTOR]


@cache
def _model(name: str) -> nnx.Module:
    if name == "gemma":  # interleaved window (ring) and full (growing) layers, GQA 4:1
        return GemmaishLM(GemmaishConfig(), rngs=nnx.Rngs(3))
    if name == "scan-window":  # lax.scan over stacked layers, window 5 everywhere
        return ScanLM(StackedConfig(window=5), rngs=nnx.Rngs(1))
    return GPT2Like(GPTConfig(), rngs=nnx.Rngs(0))


def _estimate(model: nnx.Module, system: str, b: int, p: int, n: int,
              cfg: GenerationConfig | None = None) -> Estimate:
    """The bound system's estimate for ``b`` prompts of ``p`` tokens generating ``n``."""
    cfg = cfg if cfg is not None else GenerationConfig(max_new_tokens=n)
    return systems.get(system).bind(model).estimate([p] * b, cfg)


def _measured(model: nnx.Module, system: str, b: int, p: int, n: int, logits: bool) -> int:
    prompts = [(np.arange(p, dtype=np.int32) * (i + 3)) % 40 + 1 for i in range(b)]
    cfg = GenerationConfig(max_new_tokens=n, return_logits=logits)
    stats = systems.get(system).bind(model).generate(prompts, cfg).stats
    return int(stats.get("accounted_bytes", stats.get("accounted_peak_bytes")))


@pytest.mark.parametrize(("name", "system", "b", "p", "n", "logits"), [
    ("gemma", "sym", 4, 12, 150, False),
    ("gemma", "padded", 4, 12, 150, True),
    ("scan-window", "sym", 2, 9, 40, True),
    ("scan-window", "padded", 2, 9, 40, False),
    ("gpt2", "pershape", 2, 5, 12, True),
])
def test_estimate_is_within_a_factor_of_the_measured_peak(name, system, b, p, n, logits) -> None:
    model = _model(name)
    cfg = GenerationConfig(max_new_tokens=n, return_logits=logits)
    est = _estimate(model, system, b, p, n, cfg)
    measured = _measured(model, system, b, p, n, logits)
    assert 1 / FACTOR <= est.total / measured <= FACTOR, (est.breakdown(), measured)


def test_attend_calls_read_each_layer_from_the_trace() -> None:
    """Gemma-ish: 4 layers (window, full, window, full), 4 query heads over 1 KV head of 8."""
    calls, vocab = attend_calls(_model("gemma"))
    assert vocab == GemmaishConfig().num_embed
    assert [(c.hq, c.hkv, c.d, c.dv) for c in calls] == [(4, 1, 8, 8)] * 4
    assert ["Window" in c.pattern for c in calls] == [True, False, True, False]
    scan, _ = attend_calls(_model("scan-window"))  # one traced scan body, three layers
    assert len(scan) == StackedConfig().depth and {c.hkv for c in scan} == {2}


def test_padded_grows_linearly_with_tokens_sym_window_does_not() -> None:
    model = _model("scan-window")
    calls, _ = attend_calls(model)
    per_slot = sum(_kv_cache_bytes(c, 1, 1) for c in calls)
    for n in (16, 64, 256, 1024):
        pad = _estimate(model, "padded", 2, 9, n)
        assert pad.caches == 2 * (9 + n) * per_slot  # MAX_LEN = P + N slots per call
    sym = {n: _estimate(model, "sym", 2, 9, n).caches for n in (16, 256, 1024)}
    assert len(set(sym.values())) == 1, sym  # rings of w slots, whatever N
    gem = {n: _estimate(_model("gemma"), "sym", 2, 9, n).caches for n in (64, 1024)}
    assert gem[1024] > gem[64]  # the full layers' growing stores do grow


def test_sym_growing_store_reaches_the_policy_capacity() -> None:
    """Full attention: the final capacity holds every slot the group writes (bucketed prompt
    block + the N decode slots: the last tile is cut at the rows' limit, so none past it) and
    is the policy's doubling of its initial capacity, capped at that total."""
    est = _estimate(_model("gpt2"), "sym", 3, 20, 300)
    assert "growing capacity 320" in est.caches_what  # 128 → 256 → min(512, 20 + 300)
    assert est.growth > 0  # one store at 256 slots alive while it is copied to 320


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 64), slots=st.integers(1, 1 << 16), hkv=st.integers(1, 16),
       d=st.sampled_from([8, 64, 128]), dv=st.sampled_from([8, 64, 256]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]))
def test_cache_bytes_arithmetic(b, slots, hkv, d, dv, dtype) -> None:
    """k + v in their dtype plus int32 positions and segment ids, per row and slot."""
    item = np.dtype(dtype).itemsize if dtype != "bfloat16" else 2
    call = AttendCall(hq=hkv, hkv=hkv, d=d, dv=dv, k_dtype=dtype, v_dtype=dtype, pattern="c")
    assert _kv_cache_bytes(call, b, slots) == b * slots * (hkv * (d + dv) * item + 8)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 1 << 40), min_size=5, max_size=5))
def test_total_is_the_sum_of_the_breakdown(terms) -> None:
    est = Estimate("x", *terms, "t", "c")
    assert est.total == sum(terms) == est.to_dict()["total"]
    for t in terms:
        assert gb(t) in est.breakdown() or t == 0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 1 << 50), st.sampled_from([("", 1), ("G", 10**9), ("GB", 10**9),
                                                  ("GiB", 2**30), ("k", 10**3)]))
def test_parse_bytes(n, unit) -> None:
    suffix, scale = unit
    assert parse_bytes(f"{n}{suffix}") == n * scale


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxrl_sym.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


@pytest.mark.parametrize("bad", ["0", "x", "-5", "inf"])
def test_bad_memory_limit_fails_fast(bad: str) -> None:
    """Refused by the CLI's JAX-free checks: nothing compiled, no traceback (the CLI's
    import-free check path is asserted in tests/test_faults_inputs.py)."""
    proc = _cli("decode", "--memory-limit", bad)
    assert proc.returncode == 2 and "--memory-limit must be" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_decode_refuses_when_nothing_fits(capsys) -> None:
    """Every system over the limit: exit 2 before any system runs, each refusal with its
    breakdown and what to lower."""
    code = main(["decode", "--tokens", "16", "--batch", "2", "--memory-limit", "100k",
                 "--systems", "sym,padded"])
    err = capsys.readouterr().err
    assert code == 2
    for system in ("sym", "padded"):
        assert f"{system}: estimated" in err
    for part in ("> --memory-limit 100 kB", "weights", "caches", "largest temporary",
                 "Lower --batch or --tokens", "--no-memory-check"):
        assert part in err


def test_decode_skips_only_what_does_not_fit(tmp_path: Path) -> None:
    """Window 16 over 256 tokens: padded's MAX_LEN caches exceed a 2 MB limit, sym's rings do
    not. Padded is reported as skipped (with its estimate), sym runs."""
    out = tmp_path / "r.json"
    proc = _cli("decode", "--attention", "window", "--window", "16", "--tokens", "256",
               "--batch", "2", "--prompt-len", "8", "--memory-limit", "2e6", "--no-warm",
               "--out", str(out))
    report = json.loads(out.read_text())
    pad, sym = report["systems"]["padded"], report["systems"]["sym"]
    assert proc.returncode == 1, proc.stderr  # not everything asked for ran
    assert "estimated" in pad["skipped"] and pad["estimated_bytes"] > 2e6
    assert "peak_bytes" in sym and 0 < sym["estimated_bytes"] <= 2e6
    assert "skipped (memory)" in proc.stdout
    assert any(line.startswith("padded was not run") for line in report["verdict"])
    assert report["memory_check"]["limit"] == 2_000_000


def test_suite_skips_a_configuration_that_cannot_fit(tmp_path: Path) -> None:
    """Window attention at N = 12 and 4096 (tiny preset): padded's 4096-token MAX_LEN caches
    are over a limit that every other job fits, so that one job becomes a ``skipped`` row and
    is never started; the others run (a stand-in child: no JAX work)."""
    from bench.experiments.suite import grid
    from bench.lib.suite import suite_jobs as suite

    preset = {**grid("full"), "preset": "tiny", "batch": 2, "prompt_len": (3, 6), "window": 8,
              "block": 8, "kinds": ("window",), "tokens": (12, 4096), "pershape_tokens": (),
              "pershape_kinds": ()}
    jobs = suite.plan(preset, systems=("sym-xla", "padded"), scenarios=("decode",))
    est = suite.estimate_jobs(jobs, None)
    totals = {(j.system, j.config["tokens"]): est[j.key]["total"] for j in jobs}
    big = totals[("padded", 4096)]
    limit = (big + max(v for v in totals.values() if v != big)) // 2
    assert totals[("sym-xla", 4096)] == totals[("sym-xla", 12)] < limit < big
    child = tmp_path / "child.py"
    child.write_text("import json, sys\nspec = json.load(open(sys.argv[1]))\n"
                     "json.dump({'s_per_token': 1e-3, 'peak_bytes': 1, 'xla_compiles': 1,"
                     " 'tokens_sha': 'x'}, open(sys.argv[2], 'w'))\n")
    rows = suite.run_jobs(jobs, tmp_path / "out", {"device": "cpu"}, progress=False, echo=None,
                          memory_check=True, memory_limit=limit,
                          command=lambda spec, out: [sys.executable, str(child), spec, out])
    status = {(r["system"], r["tokens"]): r["status"] for r in rows.values()}
    assert status.pop(("padded", 4096)) == (f"skipped: estimated {big / 1e9:.3g} GB > limit "
                                            f"{limit / 1e9:.3g} GB")
    assert set(status.values()) == {"ok"}
