"""One system on one generation request, in its own process (the suite's child:
``python -m bench.lib.suite.suite_child``, started by :mod:`bench.lib.suite.suite_jobs` through
:mod:`bench.lib.child`).

Why a process per (configuration, system): peak RSS and the device allocator's peak are then that
system's own, a crash or an out-of-memory kill takes down only this configuration, and XLA's
in-process caches cannot make a later system look cheaper than an earlier one.

Timing, the same rule for every system:

* ``s_per_token_with_compile``: wall-clock seconds of the first ``generate`` call (compiles
  included) / decode steps N.
* ``s_per_token`` (steady state): every system is called a second time on the same request and
  that call's ``run_seconds`` is used, as the decode CLI does: the symbolic runtime and Tunix
  compile inside their first call (per capacity bucket, in the Sampler) and keep their programs;
  the padded and per-shape baselines compile again on every call by design and time their
  execution apart from it.

Both calls generate without logits (a logits run compiles other programs); sym is checked against
padded on tokens and log-probabilities, which the parent compares.

    python -m bench.lib.suite.suite_child SPEC.json OUT.json     # one run
    python -m bench.lib.suite.suite_child --probe OUT.json       # device, versions, backends
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from typing import Any

import numpy as np

from bench.lib.requests import prompt_tokens


def probe() -> dict[str, Any]:
    """Device name, platform, package versions and whether compiled Triton kernels can run."""
    import importlib.metadata as md

    import jax

    from jaxrl_sym.backends.launch import backend_name

    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "numpy", "triton", "jax-triton", "jaxrl_sym",
                "google-tunix"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[pkg] = md.version(pkg)
    dev = jax.devices()[0]
    return {"device": str(dev.device_kind), "platform": dev.platform, "versions": versions,
            "triton_gpu": backend_name() == "gpu", "tunix": "google-tunix" in versions}


def tokens_digest(tokens: list[np.ndarray]) -> str:
    """A short digest of every row's tokens (row boundaries included), to compare systems."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(np.asarray(t, np.int32).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def _calls(system: Any, prompts: list[np.ndarray], cfg: Any, warm: bool
           ) -> tuple[Any, float, float, Any]:
    """(first call's result, its wall seconds, steady seconds, second call's result or None).
    Steady seconds: with ``warm``, the second call's ``run_seconds`` (every system: the symbolic
    runtime and Tunix compile inside their first call and keep their programs, the fixed-shape
    baselines report their execution apart from the compile they repeat per call) — the decode
    CLI's rule; without, the first call's ``run_seconds``."""
    t0 = time.perf_counter()
    cold = system.generate(prompts, cfg)
    wall = time.perf_counter() - t0
    if not warm:
        return cold, wall, float(cold.stats["run_seconds"]), None
    again = system.generate(prompts, cfg)
    return cold, wall, float(again.stats["run_seconds"]), again


def _bind(spec: dict[str, Any]) -> tuple[Any, Any]:
    """The request's model and ``spec["system"]`` bound to it through the registry."""
    from jaxrl_sym import systems
    from jaxrl_sym.decode_run import build_model

    model, _ = build_model({**spec, "batch": 1, "prompt_len": [1, 1]})
    return model, systems.get(spec["system"]).bind(model)


def run(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Generate ``spec``'s request with ``spec["system"]``; returns (metrics, arrays)."""
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models.contract import check_model
    from jaxrl_sym.runtime.metrics import peak_rss_bytes

    model, system = _bind(spec)
    prompts = prompt_tokens(spec["seed"], spec["prompt_lens"], check_model(model).vocab_size)
    # Random weights never choose an EOS on purpose: each row's sampled length is its limit, so
    # the row ends there exactly as if EOS had been sampled (same for every system).
    gcfg = GenerationConfig(max_new_tokens=tuple(int(x) for x in spec["limits"]))
    cold, cold_wall, seconds, warm = _calls(system, prompts, gcfg, spec.get("warm", True))
    steps = max(len(t) for t in cold.tokens)
    peak = int(cold.stats["peak_bytes"])
    metrics: dict[str, Any] = {
        "decode_steps": steps,
        "generated_tokens": int(sum(len(t) for t in cold.tokens)),
        "seconds_with_compile": cold_wall,
        "s_per_token_with_compile": cold_wall / steps,
        "xla_compiles": int(cold.stats["xla_compiles"]),
        "compile_seconds": float(cold.stats.get("compile_seconds", 0.0)),
        "dispatches": int(cold.stats.get("dispatches", -1)),
    }
    if warm is not None:
        metrics["warm_xla_compiles"] = int(warm.stats["xla_compiles"])
        peak = max(peak, int(warm.stats["peak_bytes"]))
    metrics.update(seconds=seconds, s_per_token=seconds / steps, peak_bytes=peak,
                   peak_rss_bytes=peak_rss_bytes(), tokens_sha=tokens_digest(cold.tokens))
    arrays = {f"tok{i}": t for i, t in enumerate(cold.tokens)}
    arrays.update({f"lp{i}": lp for i, lp in enumerate(cold.logprobs)})
    return metrics, arrays


def run_trace(spec: dict[str, Any]) -> dict[str, Any]:
    """Replay a length profile (``spec["steps"]``: one request per step, in order) with one
    system in this one process, as an RL run would generate step after step.

    Timing follows :func:`run` per step. Token positions (needed and computed, summed over the
    steps): a system that books its own (the symbolic runtime's engine log, in its stats)
    reports them; any other is counted from its shapes by the registry (``BoundSystem.work``)."""
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models.contract import check_model
    from jaxrl_sym.runtime.metrics import peak_rss_bytes

    model, system = _bind(spec)
    vocab = check_model(model).vocab_size
    m: dict[str, Any] = {"seconds": 0.0, "seconds_with_compile": 0.0, "xla_compiles": 0,
                         "generated_tokens": 0, "peak_bytes": 0, "step_seconds": [],
                         "needed_positions": 0, "token_positions": 0}
    for k, (prompt_lens, limits) in enumerate(spec["steps"]):
        rng = np.random.default_rng([spec["seed"], k])
        prompts = [rng.integers(0, vocab, size=int(p), dtype=np.int32) for p in prompt_lens]
        gcfg = GenerationConfig(max_new_tokens=tuple(int(x) for x in limits))
        out, cold, seconds, _ = _calls(system, prompts, gcfg, spec.get("warm", True))
        if [len(t) for t in out.tokens] != [int(x) for x in limits]:
            raise RuntimeError(f"step {k}: rows did not end at their limits")
        m["seconds"] += seconds
        m["step_seconds"].append(seconds)
        m["seconds_with_compile"] += cold
        m["xla_compiles"] += int(out.stats["xla_compiles"])
        m["generated_tokens"] += int(sum(len(t) for t in out.tokens))
        m["peak_bytes"] = max(m["peak_bytes"], int(out.stats["peak_bytes"]))
        work = out.stats if "token_positions" in out.stats else system.work(
            prompt_lens, limits, gcfg)
        m["needed_positions"] += int(work["needed_positions"])
        m["token_positions"] += int(work["token_positions"])
    m["peak_rss_bytes"] = peak_rss_bytes()
    return m


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:
        with open(argv[1], "w") as f:
            json.dump(probe(), f)
        return 0
    spec_path, out = argv
    with open(spec_path) as f:
        spec = json.load(f)
    if spec.get("scenario") == "trace":
        with open(out, "w") as f:
            json.dump(run_trace(spec), f)
        return 0
    metrics, arrays = run(spec)
    np.savez(out + ".npz", **arrays)
    with open(out, "w") as f:
        json.dump(metrics, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
