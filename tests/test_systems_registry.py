"""The systems registry (:mod:`jaxrl_sym.systems`): one list of systems, capabilities callers
filter on, JAX-free specs, and a system added from outside the package in one file's worth of
code plus one ``register`` line — run through the decode comparison's own path.

The grep at the end holds the registry to its purpose: no module of the package outside
``jaxrl_sym/systems/`` decides anything by comparing a system's name.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_sym import systems
from jaxrl_sym.decode_run import build_model, compare_outputs, run_system
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult, row_limits
from jaxrl_sym.systems import registry
from jaxrl_sym.systems.bound import BoundSystem

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- the toy system
# What docs/extending.md shows: a system is a BoundSystem subclass and a bind function (in a
# package: jaxrl_sym/systems/naive.py) plus one register line.


class NaiveBound(BoundSystem):
    """Greedy decoding that re-runs the whole model on every prefix: no cache, no padding, no
    compiled loop — slow, and an oracle independent of every store and mask of the library."""

    def generate(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> GenerationResult:
        if cfg.temperature:
            raise InputError("system 'naive' decodes greedily; use temperature 0")
        t0 = time.perf_counter()
        toks, lps, lgs = [], [], []
        for prompt, limit in zip(prompts, row_limits(cfg, len(prompts)), strict=True):
            seq, row_lg = [int(t) for t in prompt], []
            for _ in range(int(limit)):
                x = jnp.asarray([seq], jnp.int32)
                row_lg.append(np.asarray(self.model(x, jnp.arange(len(seq))[None],
                                                    jnp.zeros_like(x))[0, -1], np.float32))
                seq.append(int(np.argmax(row_lg[-1])))
                if seq[-1] in cfg.eos_ids:
                    break
            row = np.asarray(seq[len(prompt):], np.int32)
            lg = np.stack(row_lg)
            top = lg.max(-1, keepdims=True)
            logp = lg - top - np.log(np.exp(lg - top).sum(-1, keepdims=True))
            toks.append(row)
            lps.append(logp[np.arange(row.size), row])
            lgs.append(lg)
        stats = {"xla_compiles": 0, "peak_bytes": 0, "run_seconds": time.perf_counter() - t0}
        return GenerationResult(toks, lps, lgs if cfg.return_logits else None, stats)


def bind(spec: systems.SystemSpec, model: object, options: systems.BindOptions) -> NaiveBound:
    return NaiveBound(spec, model, options)


NAIVE = systems.SystemSpec("naive", "greedy decoding re-running the model on every prefix",
                           systems.Capabilities(), f"{__name__}:bind")


@pytest.fixture
def naive(monkeypatch) -> systems.SystemSpec:
    """The toy system registered for one test (the registry is restored after it)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return systems.register(NAIVE)


# --------------------------------------------------------------------------- registry


def test_names_and_capabilities() -> None:
    assert systems.names() == ("sym", "padded", "pershape", "tunix", "tunix-defaults",
                               "tunix-gemma4")
    assert systems.names(trains=True) == ("sym", "padded")
    assert systems.names(speculates=True) == ("sym", "padded")
    assert systems.names(shards=True) == systems.names(draft_models=True) == ("sym",)
    assert systems.names(peer=True) == ("tunix", "tunix-defaults", "tunix-gemma4")
    assert systems.names(peer=False, trains=False) == ("pershape",)
    assert systems.get("tunix").capabilities.patterns == frozenset({"full"})
    assert systems.get("sym").capabilities.patterns is None
    assert not systems.get("tunix-gemma4").same_function
    with pytest.raises(InputError, match="unknown capabilities"):
        systems.names(flies=True)


def test_unknown_names_list_the_choices() -> None:
    with pytest.raises(InputError, match=r"unknown system 'nope'; choose from sym, padded.*"
                                         r"sym-triton"):
        systems.get("nope")
    with pytest.raises(InputError, match="sym-cuda"):
        systems.get("sym-cuda")
    with pytest.raises(InputError, match="already registered"):
        systems.register(systems.get("sym"))


def test_a_variant_is_its_base_with_an_option_fixed() -> None:
    spec = systems.get("sym-triton")
    assert spec.name == "sym-triton" and spec.capabilities == systems.get("sym").capabilities
    assert spec.options(systems.BindOptions(backend="xla", speculate=2)) == systems.BindOptions(
        backend="triton", speculate=2)


def test_a_system_trains_exactly_when_it_names_its_rl_half() -> None:
    """``trainer="module:Class"`` is the RL half ``RLTrainer(system=name)`` runs; the RL package
    sits above this one, so the registry names it by string and never imports it itself."""
    with pytest.raises(InputError, match="trains exactly when"):
        systems.SystemSpec("x", "", systems.Capabilities(trains=True), "m")
    with pytest.raises(InputError, match="trains exactly when"):
        systems.SystemSpec("x", "", systems.Capabilities(), "m", trainer="m:Class")
    assert [systems.get(n).trainer for n in systems.names(trains=True)] == [
        "jaxrl_sym.systems.sym:SymSystem", "jaxrl_sym.systems.padded:PaddedSystem"]
    for path in (ROOT / "jaxrl_sym" / "systems").glob("*.py"):
        assert not re.search(r"^\s*(from|import) jaxrl_sym\.rl\b", path.read_text(), re.M), path


def test_importing_the_registry_does_not_import_jax() -> None:
    code = ("import sys; from jaxrl_sym import systems; systems.get('tunix').unavailable(); "
            "systems.get('padded').refusals(systems.BindOptions(), attention='full', "
            "user_model=False); print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_refusals_name_the_flag_to_change() -> None:
    spec, opts = systems.get("tunix"), systems.BindOptions()
    assert spec.refusals(opts, attention="full", user_model=False) == []
    assert spec.refusals(opts, attention="window", user_model=False) == [
        "--systems tunix: Tunix's Qwen2 has full causal attention only; use --attention full "
        "(got window)"]
    assert "it cannot take --model" in spec.refusals(opts, attention="full", user_model=True)[0]
    gemma = systems.get("tunix-gemma4").refusals(opts, attention="full", user_model=False)
    assert "use --attention mixed or window (got full)" in gemma[0]
    linear = systems.get("padded").refusals(systems.BindOptions(speculate=2), attention="linear",
                                            user_model=False)
    assert "cannot roll back rejected drafts" in linear[0]


def test_binding_refuses_options_the_system_does_not_take() -> None:
    with pytest.raises(InputError, match="mesh='data=2' applies to systems that shard"):
        systems.get("padded").bind(None, systems.BindOptions(mesh="data=2"))
    with pytest.raises(InputError, match="speculate=2 applies to systems that speculate"):
        systems.get("pershape").bind(None, systems.BindOptions(speculate=2))
    with pytest.raises(InputError, match="--draft medusa"):
        systems.get("sym").bind(None, systems.BindOptions(speculate=2, draft="medusa"))


def test_unavailable_names_the_package_and_the_install(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "tunix", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tunix" else real(name, *a))
    why = systems.get("tunix-defaults").unavailable()
    assert why.startswith("needs the google-tunix package") and "jaxrl_sym[peers]" in why
    assert systems.get("padded").unavailable() is None


# --------------------------------------------------------------------------- bound systems


def _request() -> tuple[object, list[np.ndarray]]:
    return build_model({"preset": "decode-cpu", "attention": "full", "window": 8, "block": 8,
                        "seed": 0, "batch": 3, "prompt_len": [4, 9], "model": None})


def test_padded_work_is_its_shape_arithmetic() -> None:
    model, _ = _request()
    cfg = GenerationConfig(max_new_tokens=6)
    w = systems.get("padded").bind(model).work([3, 5], [6, 2], cfg)
    # 2 rows × 5 prompt slots + 2 rows × 5 decode steps; needed 3 + 5 + 5 + 1
    assert (w["token_positions"], w["needed_positions"]) == (20, 14)
    assert w["waste_by_cause"]["prompt_alignment"] == pytest.approx(2 / 20)
    assert w["waste_by_cause"]["finished_rows"] == pytest.approx(4 / 20)


def test_sym_work_is_the_engines_own_log() -> None:
    """The policy's replay, booked by cause, equals what the decode groups booked running the
    same request (rows to their limits, no EOS)."""
    model, prompts = _request()
    cfg = GenerationConfig(max_new_tokens=(5, 19, 3))
    bound = systems.get("sym").bind(model)
    res = bound.generate(prompts, cfg)
    work = bound.work([p.size for p in prompts], [t.size for t in res.tokens], cfg)
    assert work == {k: res.stats[k] for k in work}


def test_a_toy_system_runs_through_the_decode_path(naive) -> None:
    """Registered from outside the package, it is a ``--systems`` choice and the decode child
    runs it; its tokens and logits match the padded baseline's."""
    from jaxrl_sym.cli import _parser, check_decode

    assert "naive" in systems.names() and systems.get("naive") is naive
    args = _parser(with_train=False).parse_args(["decode", "--systems", "padded,naive"])
    assert check_decode(args) == []
    spec = {"system": "naive", "attention": "full", "tokens": 4, "batch": 2,
            "prompt_len": [3, 6], "window": 8, "block": 8, "seed": 1, "preset": "decode-cpu",
            "model": None, "backend": "xla", "warm": False}
    metrics, arrays = run_system(spec)
    _, padded = run_system({**spec, "system": "padded"})
    check = compare_outputs(padded, arrays)
    assert metrics["generated_tokens"] == 8 and check["tokens_equal"], check
    assert check["max_abs_logit_diff"] < 1e-4


# --------------------------------------------------------------------------- one home


def _name_compares(root: Path) -> list[str]:
    """Lines under ``root`` that compare a string literal naming a system (``== "sym"``,
    ``in ("padded", ...)``, ``.startswith("sym")``, ``.partition("-")[0] ==``)."""
    names = set(systems.names()) | {f"{n}-{v}" for n in systems.names()
                                    for v in systems.get(n).variants}
    alt = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    lit = rf"""["'](?:{alt})["']"""
    rx = re.compile("|".join([
        rf"(?:==|!=)\s*{lit}", rf"{lit}\s*(?:==|!=|not\s+in\b|in\b)",
        rf"\bin\s*[(\[{{][^)\]}}]*{lit}", rf"""startswith\(\s*["'](?:{alt})""",
        r"""partition\(\s*["']-["']\s*\)\[0\]"""]))
    hits = []
    for path in sorted(root.rglob("*.py")):
        if "systems" in path.relative_to(root).parts[:1]:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if rx.search(line) and "sys.modules" not in line:  # "tunix" is also a module
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    return hits


def test_no_module_outside_the_registry_compares_system_names() -> None:
    assert _name_compares(ROOT / "jaxrl_sym") == []


def test_a_choice_of_systems_is_checked_from_the_specs() -> None:
    opts = systems.BindOptions()
    assert systems.refusals("sym, padded", opts, attention="full", user_model=False) == []
    assert "unknown: nope" in systems.refusals("sym,nope", opts, attention="full",
                                               user_model=False)[0]
    assert systems.refusals("sym,sym", opts, attention="full", user_model=False) == [
        "--systems names a system twice: 'sym,sym'"]
    spec = systems.BindOptions(mesh="data=2", speculate=2, draft="tiny")
    assert systems.refusals("pershape", spec, attention="full", user_model=False) == [
        "--mesh shards the sym systems; --systems 'pershape' has none",
        "--speculate applies to sym and padded; --systems names ['pershape']",
        "--draft tiny: a draft model runs on the sym systems; --systems 'pershape' has none"]


def test_a_system_computing_another_function_is_not_compared() -> None:
    """Tunix's Gemma 4 runs its own weights: the decode report says so instead of 'tokens
    differ'; the peers that run our weights are also checked against the padded baseline."""
    from jaxrl_sym.decode_run import checks as _checks
    from jaxrl_sym.report import verdict_lines

    same, other = {"tok0": np.array([1, 2])}, {"tok0": np.array([3, 3])}
    checks = _checks({"sym": same, "padded": same, "tunix": same, "tunix-gemma4": other})
    assert checks["checks"]["padded"]["tokens_equal"] and checks["check"]["tokens_equal"]
    assert "not_compared" in checks["checks"]["tunix-gemma4"]
    assert list(checks["checks_vs_padded"]) == ["tunix"]
    m = {"s_per_token": 1.0, "peak_bytes": 1}
    lines = verdict_lines({"systems": {"sym": m, "tunix-gemma4": m}, **checks})
    assert lines[0].endswith("tokens not compared: it computes another function (its own "
                             "weights)")
