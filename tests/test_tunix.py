"""Tunix as a peer system (:mod:`jaxrl_sym.baselines.tunix`).

The peer is only a fair comparison if Tunix computes what we compute: the weight conversion must
be exact (round trip), Tunix's Qwen2 must give our model's logits, and its Sampler's greedy tokens
must equal the padded oracle's — with EOS ending rows early, ragged prompts and per-row limits.
Tests that run Tunix skip where it is not installed (``pip install 'jaxrl_sym[peers]'``); the
missing-package errors are tested everywhere by hiding the package.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_sym import systems
from jaxrl_sym.baselines.padded import padded_generate
from jaxrl_sym.baselines.tunix import (
    PeerMissingError,
    TunixSystem,
    from_tunix,
    geometry,
    load_tunix,
    to_tunix,
    tunix_available,
)
from jaxrl_sym.cli import main as cli_main
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models import LMConfig, init_model, preset

needs_tunix = pytest.mark.skipif(not tunix_available(), reason="google-tunix is not installed")
VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return init_model(preset("tiny"), seed=0)  # GQA (4 query / 2 kv heads), full attention


@pytest.fixture(scope="module")
def tunix_sys(model):
    if not tunix_available():
        pytest.skip("google-tunix is not installed")
    return TunixSystem(model)


def _prompts(lens: tuple[int, ...], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).astype(np.int32) for n in lens]


def _eos_for(rows: list[np.ndarray]) -> int:
    """A token greedy decoding emits early in some row but not in every row, so EOS ends some
    rows before their limit and leaves others running."""
    for tok in np.unique(np.concatenate(rows)):
        hits = [(r == tok).any() for r in rows]
        if any(hits) and not all(hits):
            return int(tok)
    raise AssertionError(f"no token suits as EOS in {rows}; pick another prompt seed")


# --------------------------------------------------------------------------- weights


@needs_tunix
def test_weight_round_trip_is_exact(model):
    back = from_tunix(to_tunix(model), model)
    flat_a = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    flat_b = dict(nnx.to_flat_state(nnx.state(back, nnx.Param)))
    assert flat_a.keys() == flat_b.keys()
    for path, var in flat_a.items():
        np.testing.assert_array_equal(np.asarray(var.get_value()),
                                      np.asarray(flat_b[path].get_value()), err_msg=str(path))


@needs_tunix
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Tunix's own, called directly here
def test_tunix_qwen2_computes_our_function(model):
    """Full forward (no cache) on a ragged, left-padded batch: same logits at every real slot."""
    tm = to_tunix(model)
    rows = _prompts((5, 9), seed=3)
    t = max(r.size for r in rows)
    tokens = np.zeros((2, t), np.int32)
    positions = np.full((2, t), -1, np.int32)
    for i, r in enumerate(rows):
        tokens[i, t - r.size:] = r
        positions[i, t - r.size:] = np.arange(r.size)
    ours = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.zeros_like(positions))
    valid = positions >= 0
    mask = valid[:, None, :] & valid[:, :, None] & np.tril(np.ones((t, t), bool))[None]
    theirs, _ = tm(jnp.asarray(tokens), jnp.asarray(np.maximum(positions, 0)), None,
                   jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(theirs)[valid], np.asarray(ours)[valid], atol=2e-5)


@needs_tunix
def test_from_tunix_refuses_a_bias(model):
    tm = to_tunix(model)
    tm.layers[1].attn.k_bias.set_value(jnp.ones(tm.layers[1].attn.k_bias.shape))
    with pytest.raises(InputError, match="layer 1 has a non-zero k_bias"):
        from_tunix(tm, model)


@needs_tunix
def test_tunix_refuses_other_attention():
    m = init_model(preset("tiny", patterns=LMConfig.mixed(4).layer_patterns()), seed=0)
    with pytest.raises(InputError, match=r"full causal attention only.*--attention full"):
        TunixSystem(m)


# --------------------------------------------------------------------------- generation


@needs_tunix
def test_greedy_tokens_equal_padded_with_eos_and_ragged_prompts(model, tunix_sys):
    prompts = _prompts((3, 11, 6, 17), seed=1)
    limits = (14, 9, 20, 12)
    free = padded_generate(model, prompts, GenerationConfig(max_new_tokens=limits))
    eos = _eos_for(free.tokens)
    cfg = GenerationConfig(max_new_tokens=limits, eos_id=eos)
    pad, tun = padded_generate(model, prompts, cfg), tunix_sys(prompts, cfg)
    assert any(t[-1] == eos and t.size < lim for t, lim in zip(pad.tokens, limits, strict=True))
    assert any(t.size == lim for t, lim in zip(pad.tokens, limits, strict=True))
    for i, (a, b) in enumerate(zip(tun.tokens, pad.tokens, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"row {i}")
        n = len(tun.logprobs[i])  # Tunix returns no log-prob for the EOS token
        assert n == b.size - (b[-1] == eos and b.size < limits[i])
        np.testing.assert_allclose(tun.logprobs[i], pad.logprobs[i][:n], atol=1e-4)
    assert tun.logits is None and tun.stats["cache_size"] == 32 + max(limits)
    assert tun.stats["peak_bytes"] > 0 and tun.stats["xla_compiles"] >= 2


@needs_tunix
def test_second_call_compiles_nothing(model, tunix_sys):
    prompts = _prompts((4, 7), seed=2)
    cfg = GenerationConfig(max_new_tokens=6)
    first = tunix_sys(prompts, cfg)
    again = tunix_sys(prompts, cfg)
    assert again.stats["xla_compiles"] == 0
    for a, b in zip(first.tokens, again.tokens, strict=True):
        np.testing.assert_array_equal(a, b)


@needs_tunix
def test_rollout_defaults_row(model):
    prompts = _prompts((5, 9), seed=4)
    cfg = GenerationConfig(max_new_tokens=8)
    tun = TunixSystem(model, defaults=True)(prompts, cfg)
    pad = padded_generate(model, prompts, cfg)
    assert tun.stats["cache_size"] == 1024 and tun.stats["prompt_len"] == 64
    for a, b in zip(tun.tokens, pad.tokens, strict=True):
        np.testing.assert_array_equal(a, b)


def test_geometry():
    assert geometry([5, 17], 100, defaults=False).cache_size == 32 + 100
    assert geometry([16], 8, defaults=False).prompt_len == 16
    d = geometry([5, 17], 100, defaults=True)
    assert (d.max_prompt_length, d.prompt_len, d.cache_size) == (64, 64, 1024)
    assert geometry([100], 8, defaults=True).prompt_len == 128  # Tunix's own rule past 64


# --------------------------------------------------------------------------- Qwen2 checkpoints

HF = Path(__file__).resolve().parent / "fixtures" / "hf"


@needs_tunix
def test_qwen2_checkpoint_greedy_equals_transformers():
    """A transformers-saved Qwen2 (q/k/v biases, tied head) in Tunix's Qwen2: round trip exact,
    greedy tokens equal transformers' ``generate(do_sample=False)``."""
    from jaxrl_sym.models.hf import load_pretrained

    model, _, _ = load_pretrained(HF / "qwen2_tied")
    back = from_tunix(to_tunix(model), model)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(back, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()),
                                      err_msg=str(path))
    with np.load(HF / "qwen2_tied" / "expected.npz") as z:
        prompts, want = [z["prompt0"], z["prompt1"]], [z["greedy0"], z["greedy1"]]
    out = TunixSystem(model)([p.astype(np.int32) for p in prompts],
                             GenerationConfig(max_new_tokens=int(want[0].size)))
    for got, exp in zip(out.tokens, want, strict=True):
        np.testing.assert_array_equal(got, exp)


@needs_tunix
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Tunix's own, called directly here
def test_untied_qwen2_with_biases_computes_our_function():
    from dataclasses import replace

    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.models.hf.modeling import build_model

    cfg = replace(load_pretrained(HF / "qwen2_tied")[0].cfg, tie_word_embeddings=False)
    model = build_model(cfg)
    rng = np.random.default_rng(0)
    for layer in model.model.layers:  # biases a checkpoint would carry, not zeros
        for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            lin.bias.set_value(jnp.asarray(rng.normal(size=lin.bias.shape), jnp.float32))
    tm = to_tunix(model)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((9, 9), bool)), (2, 9, 9))
    theirs, _ = tm(tokens, positions, None, mask)
    np.testing.assert_allclose(np.asarray(theirs), np.asarray(model(tokens, positions)),
                               atol=2e-5)


@needs_tunix
def test_sliding_window_checkpoint_refused():
    from jaxrl_sym.models.hf import load_pretrained

    model, _, _ = load_pretrained(HF / "qwen2_sliding_sharded")
    with pytest.raises(InputError, match="full causal attention only"):
        TunixSystem(model)


# --------------------------------------------------------------------------- missing package


@pytest.fixture
def no_tunix(monkeypatch):
    """Tunix hidden from this process, installed or not."""
    for name in [m for m in sys.modules if m == "tunix" or m.startswith("tunix.")]:
        monkeypatch.delitem(sys.modules, name)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "tunix" else real(name, *a))


def test_missing_tunix_names_the_extra(no_tunix):
    with pytest.raises(PeerMissingError, match="google-tunix"):
        load_tunix()
    for name in ("tunix", "tunix-defaults", "tunix-gemma4"):  # the spec adds how to install
        with pytest.raises(PeerMissingError, match=r"jaxrl_sym\[peers\]"):
            systems.get(name).bind(None)


def test_cli_refuses_tunix_before_any_work(no_tunix, capsys):
    assert cli_main(["decode", "--systems", "sym,tunix", "--tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "--systems tunix needs the google-tunix package" in err and "jaxrl_sym[peers]" in err


def test_cli_refuses_tunix_on_window_attention(capsys):
    assert cli_main(["decode", "--systems", "sym,tunix", "--attention", "window"]) == 2
    assert "use --attention full (got window)" in capsys.readouterr().err



# --------------------------------------------------------------------------- benchmark suite


def _bench():
    from bench.lib.suite import suite_jobs, suite_padding

    return suite_jobs, suite_padding


def test_suite_runs_tunix_on_full_attention_only():
    from bench.experiments.suite import grid

    suite, _ = _bench()
    jobs = suite.plan(grid("full"), systems=("padded", "tunix"), scenarios=("decode", "realistic"))
    peers = [j for j in jobs if j.system == "tunix"]
    assert peers and all(j.config["attention"] == "full" for j in peers)
    assert {j.config["scenario"] for j in peers} == {"decode", "realistic"}


def test_suite_counts_tunix_geometry():
    """Prompts padded to the next power of two, every row for N = max(limits) steps, each over
    all cache slots: P + N, or 1,024 at the rollout defaults."""
    _, sp = _bench()
    full = [sp.Layer("full")] * 2
    w = sp.tunix_work([5, 17], [10, 4], full)
    assert (w.tokens_needed, w.tokens_computed) == (5 + 9 + 17 + 3, 2 * 32 + 2 * 10)
    assert w.keys_computed == 2 * 10 * (32 + 10) * 2
    d = sp.work_for("tunix-defaults", [5, 17], [10, 4], full)
    assert (d.tokens_computed, d.keys_computed) == (2 * 64 + 2 * 10, 2 * 10 * 1024 * 2)


@needs_tunix
def test_cli_with_only_a_peer_runs_it(capsys):
    """Only peers (no shape estimate) must still run; Tunix's own refusal of a request past its
    1,024-slot rollout cache is that system's error row, exit code 1."""
    assert cli_main(["decode", "--systems", "tunix-defaults", "--tokens", "1000", "--batch", "1",
                     "--json"]) == 1
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    error = report["systems"]["tunix-defaults"]["error"][0]
    assert "must be less than the cache size 1024" in error
