"""Numerical garbage in never becomes numbers out with rc 0 (issue 29, 'numerical garbage').

Each case either refuses early, naming the user's thing (reward, temperature, tensor), or gives
the correct result checked against numpy: rewards that overflow the advantages, sampling
temperatures whose logits/temperature overflow, words a model rules out (-inf logits: 0·log 0),
and exports that would write NaN or float16 overflow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, select_tokens
from jaxrl_sym.rl import RewardError, RLConfig
from jaxrl_sym.rl.algorithms.advantages import sample_advantages
from jaxrl_sym.rl.algorithms.losses import slot_terms

# ------------------------------------------------------------------ rewards that overflow


@pytest.mark.parametrize(("algo", "norm"), [("grpo", "group_std"), ("grpo", "batch_std"),
                                            ("grpo", "none"), ("rloo", "group_std")])
@pytest.mark.parametrize("rewards", [[1e308, -1e308, 0.0, 1.0], [1e308, 1e308, 1e308, -1e308],
                                     [1e200, 0.0, 0.0, 0.0], [-1e300, 5.0, 5.0, 5.0]])
def test_rewards_that_overflow_the_advantages_are_refused(algo: str, norm: str,
                                                          rewards: list[float]) -> None:
    """±1e308 used to give a group std of inf, every advantage 0, and a step that 'succeeded'
    without learning; now the reward is named with its sample."""
    with pytest.raises(RewardError, match=r"rewards of this batch reach .*sample \d+.*scale"):
        sample_advantages(np.array(rewards), 4, algo, 1e-6, norm)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=4, max_size=4),
       st.sampled_from(["group_std", "batch_std", "none"]))
def test_moderate_rewards_give_numpys_advantages(rewards: list[float], norm: str) -> None:
    """The guard changes nothing below overflow: GRPO's advantages as numpy computes them."""
    r = np.array(rewards)
    got = sample_advantages(r, 4, "grpo", 1e-6, norm)
    c = r - r.mean()
    scale = {"group_std": r.std() + 1e-6, "batch_std": c.std() + 1e-6, "none": 1.0}[norm]
    want = np.zeros(4) if r.max() == r.min() else c / scale
    np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ temperatures


@pytest.mark.parametrize("t", [1e-30, 1e-6, 0.0099])
def test_temperatures_that_overflow_the_logits_are_refused(t: float) -> None:
    with pytest.raises(InputError, match=r"temperature=.*use 0 for greedy"):
        GenerationConfig(max_new_tokens=4, temperature=t)
    with pytest.raises(InputError, match=r"AlgorithmConfig\.temperature=.*use 0 for greedy"):
        RLConfig.of(temperature=t)


def test_generate_cli_names_the_temperature_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from jaxrl_sym.cli import main

    try:
        rc = main(["generate", "--model", "m", "--prompt", "hi", "--temperature", "1e-30"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    assert "--temperature: temperature=1e-30" in capsys.readouterr().err


def test_the_lowest_temperature_samples_with_finite_logprobs() -> None:
    """At 0.01 with logits of ±1e4 (logits/T = 1e6) the sampled words and their log-probs are
    those of numpy's softmax, finite."""
    rng = np.random.default_rng(0)
    logits = rng.uniform(-1e4, 1e4, (6, 50)).astype(np.float32)
    tok, lp = select_tokens(jnp.asarray(logits), seed=jnp.uint32(1),
                            steps=jnp.zeros(6, jnp.int32), row_ids=jnp.arange(6, dtype=jnp.int32),
                            temperature=0.01)
    x = logits.astype(np.float64) / 0.01
    want_lp = x - x.max(-1, keepdims=True)
    want_lp -= np.log(np.exp(want_lp).sum(-1, keepdims=True))
    tok, lp = np.asarray(tok), np.asarray(lp)
    assert np.all(np.isfinite(lp))
    np.testing.assert_array_equal(tok, logits.argmax(-1))  # the rest has probability e^-1e4
    np.testing.assert_allclose(lp, want_lp[np.arange(6), tok], atol=1e-5)


# ------------------------------------------------------------------ words the model rules out


def test_entropy_and_its_gradient_with_ruled_out_words_are_finite() -> None:
    """A model with -inf logits on unused vocabulary entries: the entropy is numpy's over the
    live words, and its gradient is finite (it was NaN: exp(-inf)·(-inf))."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 5, 40)).astype(np.float32)
    logits[..., 30:] = -np.inf
    targets = jnp.asarray(rng.integers(0, 30, (3, 5)), jnp.int32)

    def ent(x):
        return slot_terms(x, targets, 1.0)["ent"]

    got = np.asarray(ent(jnp.asarray(logits)))
    live = logits[..., :30].astype(np.float64)
    p = np.exp(live - live.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, -(p * np.log(p)).sum(-1), rtol=1e-5)
    g = np.asarray(jax.grad(lambda x: ent(x).sum())(jnp.asarray(logits)))
    assert np.all(np.isfinite(g)) and np.all(g[..., 30:] == 0)
    # on the live words, the gradient autodiff gives the plain formula restricted to them
    w = rng.normal(size=(3, 5)).astype(np.float32)
    naive = lambda x: -(jax.nn.softmax(x) * jax.nn.log_softmax(x)).sum(-1)
    want = jax.grad(lambda x: (naive(x) * w).sum())(jnp.asarray(logits[..., :30]))
    got_g = jax.grad(lambda x: (ent(x) * w).sum())(jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(got_g)[..., :30], np.asarray(want), atol=1e-6)


def test_entropy_gradient_equals_autodiff_of_the_formula_at_any_temperature() -> None:
    """The entropy's hand-written backward (it keeps no [slots × vocab] buffer but the logits)
    against jax.grad of ``-sum softmax · log_softmax`` of ``logits / T``, finite logits."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(4, 7, 50)) * 3, jnp.float32)
    targets = jnp.zeros((4, 7), jnp.int32)
    w = jnp.asarray(rng.normal(size=(4, 7)), jnp.float32)
    for t in (1.0, 0.7, 1.3):
        naive = lambda x, t=t: -(jax.nn.softmax(x / t) * jax.nn.log_softmax(x / t)).sum(-1)
        got = jax.grad(lambda x, t=t: (slot_terms(x, targets, t)["ent"] * w).sum())(logits)
        want = jax.grad(lambda x, n=naive: (n(x) * w).sum())(logits)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ exports of garbage


@pytest.mark.parametrize(("value", "dtype", "match"), [
    (np.nan, None, r"NaN or infinite values.*diverged"),
    (np.inf, None, r"NaN or infinite values"),
    (1e5, "float16", r"float16 overflows beyond ±65504"),
])
def test_an_export_that_would_write_nan_or_overflow_is_refused(tmp_path, value, dtype,
                                                               match) -> None:
    from pathlib import Path

    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.models.hf.export import export_pretrained

    src = Path(__file__).parent / "fixtures" / "hf" / "qwen2_tied"
    model, _, _ = load_pretrained(src)
    emb = model.model.embed_tokens.embedding
    emb[...] = emb[...].at[3, 2].set(value)
    if dtype is not None:
        model, _, _ = _cast(model, dtype, src)
    out = tmp_path / "out"
    with pytest.raises(InputError, match=rf"tensor 'model\.embed_tokens\.weight'.*{match}"):
        export_pretrained(model, out, source_dir=src)
    assert not out.exists() and not list(tmp_path.iterdir())  # no partial output, no temp left


def _cast(model, dtype, src):
    """The model with every floating parameter cast to ``dtype`` (what ``--dtype`` does)."""
    from flax import nnx

    from jaxrl_sym.models.hf import load_pretrained

    cast, tok, cfg = load_pretrained(src, dtype=dtype)
    state = nnx.state(model)
    nnx.update(cast, jax.tree_util.tree_map(lambda a: a.astype(dtype), state))
    return cast, tok, cfg
