"""The decode comparison's child side: the shared model and prompts, one system's run, and
the token/logit check between two systems.

Why apart from :mod:`jaxrl_sym.cli`: the CLI must parse and check flags without importing JAX;
everything here runs inside the per-system child processes (and
``bench/lib/suite/suite_child.py``), where JAX is imported anyway.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxrl_sym import systems

if TYPE_CHECKING:
    from jaxrl_sym.systems.bound import BoundSystem

# The ``decode-cpu`` preset: GPT-2-like multi-head shape scaled down for a CPU. Like real
# long-context decoding, the KV state (not the weights) dominates memory at a few thousand tokens,
# which is the regime the padding-vs-symbolic comparison is about (paper Fig. 3: GPT-2 small at
# batch 64).
DECODE_CPU = {"d_model": 64, "n_layers": 6, "n_heads": 4, "n_kv_heads": 4, "head_dim": 16,
              "ffn_dim": 128, "vocab_size": 128}


def user_model(ref: str, seed: int) -> Any:
    """``MODULE:FUNCTION`` → ``FUNCTION(seed)``, checked against the model contract."""
    import importlib

    from jaxrl_sym.errors import InputError
    from jaxrl_sym.models.contract import check_model

    mod_name, _, fn_name = ref.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as err:
        raise InputError(f"--model {ref}: cannot import {fn_name!r} from {mod_name!r} ({err}); "
                         "is the module on PYTHONPATH?") from err
    model = fn(seed)
    check_model(model)
    return model


def build_model(spec: dict[str, Any]) -> tuple[Any, list[np.ndarray]]:
    """The model and prompts every system shares (same seed → same weights and prompts)."""
    from dataclasses import replace

    from jaxrl_sym.models.contract import check_model

    if spec.get("model"):
        model = user_model(spec["model"], spec["seed"])
        return model, prompts_for(spec, check_model(model).vocab_size)

    from flax import nnx

    from jaxrl_sym.models.lm import DecoderLM, LMConfig, preset
    from jaxrl_sym.ops.attention import Block, Causal, Linear, Window

    cfg = (preset("small", **DECODE_CPU) if spec["preset"] == "decode-cpu"
           else preset(spec["preset"]))
    n = cfg.n_layers
    att = spec["attention"]
    if att == "mixed":
        cfg = replace(cfg, patterns=LMConfig.mixed(spec["window"], n_layers=n).patterns)
    else:
        pat = {"full": Causal(), "window": Window(spec["window"]), "block": Block(spec["block"]),
               "linear": Linear()}[att]
        cfg = replace(cfg, patterns=(pat,) * n)
    return DecoderLM(cfg, rngs=nnx.Rngs(spec["seed"])), prompts_for(spec, cfg.vocab_size)


def check_vocab(model: Any) -> int:
    from jaxrl_sym.models.contract import check_model

    return check_model(model).vocab_size


def draft_model(name: str, vocab: int, seed: int) -> Any:
    """``--draft PRESET``: a DecoderLM of that preset with the target's vocabulary (full
    attention), its weights seeded apart from the target's (``seed + 1``)."""
    from dataclasses import replace

    from flax import nnx

    from jaxrl_sym.models.lm import DecoderLM, preset

    cfg = preset("small", **DECODE_CPU) if name == "decode-cpu" else preset(name)
    return DecoderLM(replace(cfg, vocab_size=vocab), rngs=nnx.Rngs(seed + 1))


def prompts_for(spec: dict[str, Any], vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(spec["seed"])
    lo, hi = spec["prompt_len"]
    return [rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1)), dtype=np.int32)
            for _ in range(spec["batch"])]


PROGRESS_PREFIX = "  progress "


def _progress_printer(system: str, total: int, every: float = 10.0) -> Callable[[int], None]:
    """A progress callback that prints to stderr at most every ``every`` seconds, so a run that
    takes hours is not silent (stdout stays the child's JSON)."""
    state = {"t0": time.perf_counter(), "last": time.perf_counter()}

    def report(done: int) -> None:
        now = time.perf_counter()
        if now - state["last"] >= every:
            state["last"] = now
            pct = 100 * done / max(total, 1)
            print(f"{PROGRESS_PREFIX}{system}: {done:,}/{total:,} tokens ({pct:.0f}%), "
                  f"{now - state['t0']:.0f} s", file=sys.stderr, flush=True)

    return report


def bind_system(spec: dict[str, Any], model: Any) -> BoundSystem:
    """The spec's system (:mod:`jaxrl_sym.systems`) bound to ``model`` with the run's options:
    backend, mesh (systems that shard), ``--speculate K [--draft ngram|PRESET]`` (sym and padded
    with the same draft and acceptance rule) and a progress printer."""
    name = spec["system"]
    draft = spec.get("draft", "ngram")
    if spec.get("speculate") and draft != "ngram":
        draft = draft_model(draft, check_vocab(model), spec["seed"])
    engine = spec.get("engine")
    if engine is not None and systems.get(name).capabilities.engine:
        from jaxrl_sym.runtime.options import EngineOptions

        engine = EngineOptions(**engine)
    else:
        engine = None  # the systems without a runtime to set run as they are
    options = systems.BindOptions(
        backend=spec.get("backend", "xla"), mesh=spec.get("mesh"), engine=engine,
        speculate=spec.get("speculate", 0), draft=draft,
        progress=_progress_printer(name, spec["batch"] * spec["tokens"]))
    return systems.get(name).bind(model, options)


def run_system(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Run one system cold (compiles, logits) then warm (timing). Returns (metrics, arrays)."""
    from dataclasses import replace

    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.runtime.metrics import peak_rss_bytes

    model, prompts = build_model(spec)
    gcfg = GenerationConfig(max_new_tokens=spec["tokens"], return_logits=True)
    gen = bind_system(spec, model)
    t0 = time.perf_counter()
    cold = gen(prompts, gcfg)
    cold_wall = time.perf_counter() - t0  # the whole call: every system's compiles included
    steps = max(len(t) for t in cold.tokens)
    metrics: dict[str, Any] = {
        "xla_compiles": int(cold.stats["xla_compiles"]),
        "s_per_token_with_compile": cold_wall / steps,
        "peak_bytes": int(cold.stats["peak_bytes"]),
        "generated_tokens": int(sum(len(t) for t in cold.tokens)),
        "dispatches": int(cold.stats.get("dispatches", -1)),
    }
    if spec.get("mesh"):
        metrics["mesh"] = spec["mesh"]
    # sym: the engine's own log of the token positions it computed, by cause of waste
    metrics.update({k: cold.stats[k] for k in ("waste_fraction", "waste_by_cause", "groups",
                                               "acceptance_rate", "acceptance_per_row",
                                               "draft_seconds", "verify_steps", "draft")
                    if k in cold.stats})
    # A peer's version and cache geometry (Tunix: jaxrl_sym.baselines.tunix), kept with its row.
    metrics.update({k: cold.stats[k] for k in ("tunix_version", "cache_size", "prompt_len")
                    if k in cold.stats and gen.spec.capabilities.peer})
    if spec.get("warm", True):
        nolog = replace(gcfg, return_logits=False)
        if gen.spec.name == systems.REFERENCE:
            # The no-logits step programs are other executables than the cold run's: compile
            # them in an untimed call, so ``s_per_token`` is steady state (the padded baseline
            # reports its run time without its compile already).
            gen(prompts, nolog)
        warm = gen(prompts, nolog)
        metrics["s_per_token"] = warm.stats["run_seconds"] / steps
        metrics["peak_bytes"] = int(warm.stats["peak_bytes"])
        metrics["warm_xla_compiles"] = int(warm.stats["xla_compiles"])
    else:
        metrics["s_per_token"] = metrics["s_per_token_with_compile"]
    metrics["peak_rss_bytes"] = peak_rss_bytes()
    arrays = {f"tok{i}": t for i, t in enumerate(cold.tokens)}
    arrays.update({f"logit{i}": lg for i, lg in enumerate(cold.logits or [])})
    arrays.update({f"lp{i}": lp for i, lp in enumerate(cold.logprobs)})
    return metrics, arrays


def compare_outputs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, Any]:
    """Tokens, logits and log-probs of two systems' cold runs: equal?, rows that differ, max
    |Δlogit| (None when either system returns no logits: Tunix), max |Δlog-prob| over the
    positions both report (Tunix does not return an EOS token's log-prob)."""
    rows = sum(1 for k in a if k.startswith("tok"))
    differ = sum(1 for i in range(rows) if not np.array_equal(a[f"tok{i}"], b.get(f"tok{i}")))
    out: dict[str, Any] = {"tokens_equal": differ == 0, "rows": rows, "rows_differ": differ}
    for key, name in (("logit", "max_abs_logit_diff"), ("lp", "max_abs_logprob_diff")):
        diff, seen = 0.0, False
        for i in range(rows):
            la, lb = a.get(f"{key}{i}"), b.get(f"{key}{i}")
            if la is not None and lb is not None:
                seen = True
                n = min(len(la), len(lb))
                if n:
                    diff = max(diff, float(np.max(np.abs(la[:n] - lb[:n]))))
        out[name] = diff if seen else None
    return out


def estimate_child(argv: list[str]) -> int:
    """``_estimate SPEC OUT``: every system's memory estimate for the decode request (the
    child of :func:`jaxrl_sym.cli.memory_check`). The model is built on the host CPU, so this
    process allocates no device memory; only the device's limit is read."""
    import jax

    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.runtime.memory.estimate import check_request

    spec_path, out = argv
    with open(spec_path) as f:
        spec = json.load(f)
    specs = spec if isinstance(spec, list) else [spec]  # a list: the benchmark suite's jobs
    models: dict[str, Any] = {}
    results = []
    with jax.default_device(jax.devices("cpu")[0]):
        for s in specs:
            key = json.dumps([s.get(k) for k in ("model", "preset", "attention", "window",
                                                  "block", "seed")])
            if key not in models:
                models[key] = build_model(s)[0]
            # The prompts build_model draws (same seed, same vocabulary: same lengths).
            lens = [len(x) for x in prompts_for(s, check_vocab(models[key]))]
            # The decode CLI's cold run keeps logits: the larger of its two runs.
            gcfg = GenerationConfig(max_new_tokens=s["tokens"],
                                    return_logits=s.get("return_logits", True))
            bound = [systems.get(n).bind(models[key]) for n in s["systems"]]
            estimates = [e for e in (b.estimate(lens, gcfg) for b in bound) if e is not None]
            results.append(check_request(estimates, s["memory_limit"]))
    with open(out, "w") as f:
        json.dump(results if isinstance(spec, list) else results[0], f)
    return 0


def checks(arrays: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """Every system's tokens and logits against the reference system's (``checks``; ``check``:
    the baseline's, the field earlier reports carried) and the peers' also against the
    baseline's. A system that computes another function (``same_function=False``) is not
    compared."""
    ref, base = systems.REFERENCE, systems.BASELINE
    same = {s: a for s, a in arrays.items() if systems.get(s).same_function}
    out: dict[str, Any] = {}
    if ref in same:
        out["checks"] = {s: compare_outputs(same[ref], same[s]) if s in same else
                         {"not_compared": "it computes another function (its own weights)"}
                         for s in arrays if s != ref}
        if base in out["checks"]:
            out["check"] = out["checks"][base]
    peers = [s for s in same if systems.get(s).capabilities.peer]
    if base in same and peers:
        out["checks_vs_padded"] = {s: compare_outputs(same[base], same[s]) for s in peers}
    return out
