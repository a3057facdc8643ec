"""A model's learned-position table bounds the requests it can serve: every system refuses a
row that would read past it, naming the row, the table and the model's line, instead of
generating from NaN (``jnp.take``'s fill) or clamped logits without an error.

Oracles outside the library: the limit each test model has by construction (its table's length
minus the offset its own code adds), and the plain model re-run per token (``naive_generate``)
for requests that fit exactly.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import GPT2Like, GPTConfig, naive_generate, zoo

from jaxrl_sym import Causal, attend, systems
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions
from jaxrl_sym.tracer.trace import model_position_limit

TABLE = 32


class OffsetTable(nnx.Module):
    """Learned positions read the way OPT reads them (``table[position + offset]``) with a
    choice of ``jnp.take`` mode, or clamped by the model itself (then nothing overruns)."""

    def __init__(self, table: int, offset: int, mode: str | None, clamp: bool) -> None:
        rngs = nnx.Rngs(0)
        self.tok = nnx.Embed(11, 8, rngs=rngs)
        self.pos = nnx.Param(jnp.ones((table, 8)))
        self.out = nnx.Linear(8, 11, rngs=rngs)
        self.offset, self.mode, self.clamp, self.table = offset, mode, clamp, table

    def __call__(self, tokens, positions, segment_ids):
        idx = jnp.maximum(positions, 0) + self.offset
        if self.clamp:
            idx = jnp.minimum(idx, self.table - 1)
        x = self.tok(tokens) + jnp.take(self.pos[...], idx, axis=0, mode=self.mode)
        b, t, d = x.shape
        q = x.reshape(b, t, 1, d)
        y = attend(q, q, q, Causal(), q_positions=positions, kv_positions=positions,
                   q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
        return self.out(y.reshape(b, t, d))


@settings(max_examples=12, deadline=None)
@given(table=st.integers(2, 4096), offset=st.integers(0, 3),
       mode=st.sampled_from([None, "clip", "fill"]))
def test_the_limit_is_the_table_length_less_the_models_offset(table: int, offset: int,
                                                               mode: str | None) -> None:
    limit = model_position_limit(OffsetTable(table + offset, offset, mode, clamp=False))
    assert limit is not None
    assert limit.positions == table
    assert limit.table == (table + offset, 8)
    assert "test_position_limit.py" in limit.source  # the model's own line, not Flax's


def test_models_without_an_overrun_have_no_limit() -> None:
    assert model_position_limit(OffsetTable(16, 0, None, clamp=True)) is None
    for name in ("scan", "shared", "gemmaish"):  # RoPE: no table read by position
        assert model_position_limit(zoo()[name]) is None, name


@pytest.fixture(scope="module")
def short_gpt() -> GPT2Like:
    return GPT2Like(GPTConfig(block_size=TABLE), rngs=nnx.Rngs(3))


def test_engine_refuses_a_row_past_the_table_naming_it(short_gpt: GPT2Like) -> None:
    eng = SymbolicLM(short_gpt, EngineOptions(min_capacity=4))
    prompts = [np.arange(1, 6, dtype=np.int32), np.arange(1, 11, dtype=np.int32)]
    with pytest.raises(InputError) as e:
        eng.generate(prompts, GenerationConfig(max_new_tokens=(20, 23)))
    msg = str(e.value)
    assert "row 1" in msg and "max_new_tokens 23" in msg and "table of 32" in msg
    assert "zoo.py" in msg and "lower max_new_tokens to 22" in msg
    assert eng.cache.compiles == 0  # refused before anything was built


def test_padded_refuses_the_same_row(short_gpt: GPT2Like) -> None:
    bound = systems.get("padded").bind(short_gpt)
    with pytest.raises(InputError, match="row 0: a 10-token prompt with max_new_tokens 23"):
        bound.generate([np.arange(1, 11, dtype=np.int32)], GenerationConfig(max_new_tokens=23))


@pytest.mark.parametrize("refill", [False, True])
def test_rows_that_end_at_the_table_keep_the_plain_models_tokens(short_gpt: GPT2Like,
                                                                  refill: bool) -> None:
    """Rows whose prompt + limit is exactly the table, beside rows that run on after them (in
    a tile a finished row is fed past its end; with refill its row takes a waiting sample):
    every row's greedy tokens are the plain model's and every log-prob is finite."""
    opts = EngineOptions(min_capacity=4, microbatch_rows=2 if refill else None, refill=refill)
    eng = SymbolicLM(short_gpt, opts)
    prompts = [np.arange(1, 23, dtype=np.int32), np.array([5, 6], np.int32),
               np.arange(3, 10, dtype=np.int32)]
    limits = (10, 20, 25)  # 22 + 10 = 32, 2 + 20, 7 + 25 = 32
    res = eng.generate(prompts, GenerationConfig(max_new_tokens=limits))
    for p, toks, lps, n in zip(prompts, res.tokens, res.logprobs, limits, strict=True):
        np.testing.assert_array_equal(toks, naive_generate(short_gpt, p, n)[0])
        assert np.all(np.isfinite(lps))
