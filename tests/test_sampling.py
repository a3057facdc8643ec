"""``select_tokens`` at temperature > 0 against the distribution it must sample: a chi-square
test on many rows (each row its own random stream), written against a numpy softmax."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.generation import select_tokens

CHI2_DF3_P001 = 16.27  # chi-square 0.999 quantile, 3 degrees of freedom


def _draw(logits: np.ndarray, temperature: float, n: int, seed: int = 0):
    rows = jnp.asarray(np.tile(logits, (n, 1)), jnp.float32)
    return select_tokens(rows, seed=jnp.uint32(seed), steps=jnp.zeros((n,), jnp.int32),
                         row_ids=jnp.arange(n, dtype=jnp.int32), temperature=temperature)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_sampled_tokens_follow_the_tempered_softmax(temperature: float) -> None:
    logits = np.array([1.0, -np.inf, 0.2, 2.5, -1.0], np.float32)  # token 1 impossible
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    n = 40_000
    tok, lp = _draw(logits, temperature, n)
    tok, lp = np.asarray(tok), np.asarray(lp)
    counts = np.bincount(tok, minlength=5)
    assert counts[1] == 0
    live = p > 0
    chi2 = float((((counts - n * p) ** 2)[live] / (n * p[live])).sum())
    assert chi2 < CHI2_DF3_P001, (counts, n * p)
    np.testing.assert_allclose(lp, np.log(p[tok]), atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(1, 300), hot=st.integers(0, 299), seed=st.integers(0, 2**16))
def test_a_token_with_all_the_mass_is_always_picked(vocab: int, hot: int, seed: int) -> None:
    """Rounding never lands on a neighbour: with every other logit -inf, the hot token wins for
    every row, wherever it sits (first, last, alone)."""
    hot %= vocab
    logits = np.full((vocab,), -np.inf, np.float32)
    logits[hot] = 0.0
    tok, lp = _draw(logits, 1.0, 64, seed)
    assert (np.asarray(tok) == hot).all()
    np.testing.assert_allclose(np.asarray(lp), 0.0, atol=1e-6)
