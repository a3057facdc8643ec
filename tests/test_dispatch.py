"""The decode tile's loop structure (a host test every ``check`` steps, none inside) and the
dispatch ledger's reading of XLA's thunk sequence.

Oracles: XLA's own optimised HLO (its ``known_trip_count`` annotations, not the runtime's code);
a thunk sequence written out by hand with its counts done by hand; the plain model re-run on the
whole sequence (``naive_generate``) for the tokens of tiles whose checks overrun rows' ends;
XLA:GPU's thunk sequence of the tile compiled for an H100 on this machine (skipped where the
compile-only packages are missing, with the reason).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zoo import naive_generate, zoo

from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.group.programs_by_shape import decode_program
from jaxrl_sym.runtime.options import EngineOptions

ROOT = Path(__file__).resolve().parent.parent


def _tile_build(model, options: EngineOptions, rows: int = 4, capacity: int = 64):
    """The engine's own decode-tile program for ``model`` at (rows, capacity), not compiled."""
    lm = SymbolicLM(model, options)
    leaves = list(lm.leaves)
    plan = lm.plan
    hoisted = plan.builder.assemble(list(leaves), jax.eval_shape(plan.builder.hoist, leaves))
    cfg = GenerationConfig(max_new_tokens=32, eos_id=0)
    _, build = decode_program(plan, cfg, hoisted, rows, capacity)
    return plan, build


_WHILE = re.compile(r"^\s*(?:ROOT )?%(\S+) = .* while\(.*condition=%(\S+), body=%(\S+?)[,\s]")


def _loops(hlo: str) -> dict[str, tuple[int | None, str]]:
    """Every while in XLA's optimised HLO: name -> (known trip count or None, body name)."""
    out = {}
    for line in hlo.splitlines():
        m = _WHILE.match(line)
        if m:
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            out[m.group(1)] = (int(trips.group(1)) if trips else None, m.group(3))
    return out


def _computation(hlo: str, name: str) -> str:
    m = re.search(rf"^%{re.escape(name)} .*?^}}", hlo, re.M | re.S)
    assert m, name
    return m.group(0)


@pytest.mark.parametrize("name,check", [("scan", 8), ("gemmaish", 3)])
def test_the_tile_tests_its_rows_once_per_check(name: str, check: int) -> None:
    """XLA (here for the CPU) proves the inner loop's trip count: the only loop it cannot count
    is the outer one, and every step's matmuls sit inside a loop of ``check`` trips."""
    _, build = _tile_build(zoo(0)[name], EngineOptions(decode_tile=check, decode_check=check))
    assert dict(build.kwargs)["check"] == check
    hlo = build().as_text()
    loops = _loops(hlo)
    untested = [n for n, (t, _) in loops.items() if t is None]
    counted = [n for n, (t, _) in loops.items() if t == check]
    assert len(untested) == 1, loops
    assert counted, loops
    outer_body = _computation(hlo, loops[untested[0]][1])
    assert " dot(" not in outer_body and "dot_general" not in outer_body  # no step outside
    assert any(loops[c][1] in hlo for c in counted)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       limits=st.lists(st.integers(1, 23), min_size=4, max_size=4),
       base=st.sampled_from([3, 4]), top=st.sampled_from([5, 10]))
def test_checks_past_a_rows_end_keep_every_token(lens, limits, base, top) -> None:
    """A tile runs whole checks of ``base`` steps (buffers of ``whole(top)``), so rows end and
    the group's longest row stops inside checks whose remaining steps still write the rows'
    stores (window rings wrap, growing stores grow as the policy sized them): every row's
    tokens must still be the plain model's, greedy, re-run on the whole sequence."""
    lm = _engine(base, top)
    rng = np.random.default_rng(sum(lens) + base)
    prompts = [rng.integers(1, 61, size=n).astype(np.int32) for n in lens]
    lim = tuple(limits[:len(lens)])
    res = lm.generate(prompts, GenerationConfig(max_new_tokens=lim, temperature=0.0))
    for p, n, got in zip(prompts, lim, res.tokens, strict=True):
        want, _ = naive_generate(_MODEL, p, n)
        np.testing.assert_array_equal(got, want)


_MODEL = zoo(0)["gemmaish"]  # window rings and growing stores, soft-caps (not DecoderLM)


@cache
def _engine(base: int, top: int) -> SymbolicLM:
    """One engine per tiling (its programs compile once for every example), with a GPU's
    policy: checks of ``base`` steps and early compaction, so tiles keep growing while rows
    end and stop on device at each compaction (``Tiling.shrink`` off)."""
    return SymbolicLM(_MODEL, EngineOptions(
        decode_tile=base, max_decode_tile=top, decode_check=base, min_capacity=8,
        compact_min_rows=1, compact_early=True))


THUNKS = """\
000: kCommandBuffer [source       | next=006 (1)]
    001: kCopy         [source | sink] kCopy
    002: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [8, 1, 1]
006: kWhile         [prev=000 (1) | next=040 (1)]
condition:
    007: kCustomKernel [source       | next=008 (1)] input_reduce_fusion grid: [1, 1, 1]
    008: kCustomKernel [prev=007 (1) | sink        ] loop_and_fusion grid: [1, 1, 1]
  body:
    009: kCopy         [source       | next=010 (1)] kCopy
    010: kWhile        [prev=009 (1) | next=020 (1)]
condition:
        011: kCustomKernel [source | sink] loop_compare_fusion_1 grid: [1, 1, 1]
      body:
        000: kCommandBuffer [source | sink]
            012: kCustomKernel [source       | next=013 (1) ] gemm_fusion_dot grid: [16, 1, 1]
            013: kCustomKernel [prev=012 (1) | next=014 (1) ] triton_softmax grid: [128, 1, 1]
            014: kCustomKernel [prev=013 (1) | sink         ] loop_add_fusion grid: [1, 1, 1]
    020: kCustomKernel [prev=010 (1) | sink        ] loop_add_fusion_2 grid: [1, 1, 1]
040: kCopy          [source       | sink        ] kCopy
"""


def test_thunk_counts_by_hand() -> None:
    """A tile of ``u`` checks of 8 steps: the outer loop's condition runs u + 1 times, each a
    host round-trip; the inner loop (trip count 8, known) is replayed with no test, its body one
    CUDA graph of 3 kernels per step. By hand: launches = 1 (first graph) + (u + 1) * 2
    (condition kernels) + u * (1 copy + 8 graphs + 1 add) + 1 copy; kernels = 2 + 2 (u + 1) +
    u (1 + 24 + 1) + 1; syncs = u + 1."""
    from bench.lib.projection import thunks

    tree = thunks.parse(THUNKS, trips={10: 8})
    assert [t.kind for t in tree] == ["kCommandBuffer", "kWhile", "kCopy"]
    assert thunks.loops(tree) == [(6, None, False), (10, 8, False)]
    for u in (0, 1, 5):
        c = thunks.count(tree, u)
        assert c.launches == 1 + 2 * (u + 1) + u * 10 + 1
        assert c.kernels == 2 + 2 * (u + 1) + u * 26 + 1
        assert c.captured == 2 + u * 24
        assert c.syncs == u + 1
    # one decode step: the known-trip loop's body, its command buffer opened
    assert thunks.step_kernels(tree) == ["gemm_fusion_dot", "triton_softmax", "loop_add_fusion"]
    assert thunks.step_kernels(tree[:1]) == []  # no step loop: a prefill
    # inside a CUDA graph (+WHILE) the loop test runs on device: no round-trip
    assert thunks.count((thunks.Thunk("kCommandBuffer", 0, "", {"children": tree}),), 5).syncs \
        == 0


def _entry(program: int, stage: str):
    from bench.lib.projection import dispatch_ledger, thunks

    return dispatch_ledger.ProgramCount(stage, f"p{program}", 1, 1, 0.0, 0.0, 0.0,
                                        thunks.Counts(), [], [], [], program)


def test_first_call_by_hand() -> None:
    """A prefill (program 0, 5 s to compile), decode tiles 1 and 2 (10 s and 4 s), a compaction
    (3, 1 s), tile 2 twice; each entry runs 2 s. On first use everything compiles on the host:
    5+2 + 10+2 + 1+2 + 4+2 + 2 = 30. Two threads compile tiles 1 and 2 from t = 0 (ready at 10
    and 4): prefill 5+2 = 7, tile 1 waits to 10, +2 = 12, compaction 12+1+2 = 15, tile 2
    ready: 17, 19. One thread: tile 1 ready at 10, tile 2 at 14: 7 → 12 → 15 → 17 → 19 as
    well. With tile 1 taking 20 s, one thread: 7 → 22 → 25 → tile 2 (ready at 24) 27 → 29;
    two threads the same (tile 2 ready at 4): the first tile is the critical path."""
    from bench.lib.projection.dispatch_ledger import first_call

    progs = [_entry(0, "prefill"), _entry(1, "decode"), _entry(3, "compact"),
             _entry(2, "decode"), _entry(2, "decode")]
    run = [2.0] * 5
    each = [5.0, 10.0, 4.0, 1.0]
    assert first_call(progs, each, run, 0) == 5 + 2 + 10 + 2 + 1 + 2 + 4 + 2 + 2
    assert first_call(progs, each, run, 2) == 10 + 2 + 1 + 2 + 2 + 2
    assert first_call(progs, each, run, 1) == 19
    slow = [5.0, 20.0, 4.0, 1.0]
    assert first_call(progs, slow, run, 1) == 20 + 2 + 1 + 2 + 2 + 2
    assert first_call(progs, slow, run, 2) == 29
    # where the second thread pays: tiles of 6 s, entries of 1 s, a free compaction. One
    # thread: 2 → tile 1 at 6: 7 → 8 → tile 2 at 12: 13 → 14; two: tile 2 at 6: 7 → 8 → 9 → 10
    quick = [1.0, 6.0, 6.0, 0.0]
    assert first_call(progs, quick, [1.0] * 5, 0) == 18
    assert first_call(progs, quick, [1.0] * 5, 1) == 14
    assert first_call(progs, quick, [1.0] * 5, 2) == 10


@cache
def _dispatch_quick(setting: str, engine: str | None = None) -> dict:
    """sym's row of ``python -m bench dispatch --preset quick`` in a fresh process (the CUDA
    plugin must load before JAX starts its backends); skipped without the compile-only
    packages."""
    from bench.lib.projection import xla_gpu

    why = xla_gpu.unavailable()
    if why is not None and "fresh process" not in why:
        pytest.skip(why)
    extra = ["--engine", engine] if engine else []
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "dispatch", "--preset", "quick", "--systems", "sym",
         "--command-buffers", setting, "--json", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["systems"]["sym"]


def test_the_tile_compiled_for_an_h100_has_one_host_test_per_check() -> None:
    """sym's decode tiles compiled for an H100 and read from XLA:GPU's own thunk sequence: one
    loop tested on the host (the checks) around a loop of known trip count (the steps), each
    step's kernels inside a CUDA graph, no custom call; with ``+WHILE`` command buffers the
    whole tile is graphs and waits on the host only to read its tokens back. The Triton
    backend's decode kernel is not compiled here: jax-triton 0.3.1 builds its kernel for the
    device it runs on (none here) and lowers to the legacy custom call XLA does not capture
    (FIELD_NOTES §12); the pallas backend's kernel is (the next test)."""
    for setting in ("default", "while"):
        row = _dispatch_quick(setting)
        tiles = [p for p in row["programs"] if p["stage"] == "decode"]
        assert tiles and row["captured"] > 0.9, setting
        for p in tiles:
            trips = [t for _, t, _ in p["loops"]]
            assert trips.count(None) == 1 and 8 in trips, (setting, p["loops"])
            assert p["custom_calls"] == [], p["custom_calls"]
            host = [t for _, t, graph in p["loops"] if t is None and not graph]
            # the host tests a tile (whole checks of 8) at most once per check, plus its end
            assert p["counts"]["syncs"] <= p["calls"] * (2 + len(host)) + p["steps"] / 8
            if setting == "while":  # inside a graph: only the read-back of each dispatch
                assert host == [] and p["counts"]["syncs"] == p["calls"], p
        assert row["host_syncs_per_token"] <= (0.375 if setting == "default" else 0.125)


def test_the_pallas_decode_kernel_compiled_for_an_h100_runs_inside_the_cuda_graph() -> None:
    """With ``backend="pallas"`` each decode step's attention is one kernel XLA compiled from
    the Pallas call (a ``kCustomKernel`` named ``decode_attention``, no legacy custom call),
    every one inside a CUDA graph, the tile's loops as with the XLA backend, and fewer kernels
    a step than the XLA backend's masked attention (scores, max, sum, divide, P·V)."""
    xla = _dispatch_quick("default")
    row = _dispatch_quick("default", '{"backend": "pallas"}')
    tiles = [p for p in row["programs"] if p["stage"] == "decode"]
    assert tiles and row["captured"] > 0.9
    for p in tiles:
        assert p["custom_calls"] == [], p["custom_calls"]
        assert p["kernels"] and all(graph for _, graph in p["kernels"]), p["kernels"]
        trips = [t for _, t, _ in p["loops"]]
        assert trips.count(None) == 1 and 8 in trips, p["loops"]
    assert all(p["kernels"] == [] for p in xla["programs"])
    assert row["kernels_per_step"] < xla["kernels_per_step"]
