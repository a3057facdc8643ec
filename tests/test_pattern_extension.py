"""A new attention pattern is one class, written outside the library — and everything runs it.

Two patterns are defined here, the way a user would, as subclasses of
:class:`jaxrl_sym.ops.attention.Pattern` and nowhere else:

- ``Chunked(c)``: Llama 4's chunked local attention (a query sees the earlier keys of its own
  aligned chunk of ``c``). Its mask is in the Triton kernels' family (``KernelMask(period=c)``),
  so the kernels run it with no change; its S(t) resets every chunk, so the planner gives it a
  ring of ``c`` slots.
- ``Strided(s)``: the Sparse Transformer's strided pattern (a query sees keys a multiple of ``s``
  behind it). Its mask is outside the kernels' family (``kernel_mask() -> None``): the Triton
  backend refuses it by name in a direct kernel call and the runtime falls back to the masked
  XLA path; its S(t) is the whole prefix, so the planner keeps a growing store.

The oracles are independent of the library: visibility written here as plain Python over
integers, a naive loop attention (``tests/naive.py`` takes the visibility as a function) and a
model re-run on the whole sequence for every token (``naive_generate``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import naive_generate

from jaxrl_sym import Block, Causal, Window, attend
from jaxrl_sym.baselines.padded import padded_generate
from jaxrl_sym.errors import PatternError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.ops.attention import KernelMask, Pattern, reference_attention
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions


@dataclass(frozen=True)
class Chunked(Pattern):
    """Llama 4 chunked attention: causal within aligned chunks of ``size``."""

    size: int
    name = "chunked"
    symbol: ClassVar[str | None] = "c"

    def allows(self, q_pos, k_pos):
        return (k_pos <= q_pos) & (k_pos // self.size == q_pos // self.size)

    def key_range(self, t, size):
        return t - sympy.Mod(t, size), t + 1

    def kernel_mask(self):
        return KernelMask(period=self.size)


@dataclass(frozen=True)
class Strided(Pattern):
    """Sparse Transformer strided attention: keys 0, s, 2s, … positions behind the query."""

    size: int
    name = "strided"
    symbol: ClassVar[str | None] = "s"

    def allows(self, q_pos, k_pos):
        return (k_pos <= q_pos) & ((q_pos - k_pos) % self.size == 0)

    def key_range(self, t, size):
        return sympy.Integer(0), t + 1  # not an interval: keep the prefix


# ----------------------------------------------------------------------------- oracles


def sees(pattern: Pattern, q: int, k: int) -> bool:
    """Visibility by definition, integers only (no library code)."""
    if q < 0 or k < 0 or k > q:
        return False
    if isinstance(pattern, Chunked):
        return k // pattern.size == q // pattern.size
    if isinstance(pattern, Strided):
        return (q - k) % pattern.size == 0
    if isinstance(pattern, Window):
        return q - k < pattern.size
    if isinstance(pattern, Block):
        return k // pattern.size == q // pattern.size
    return True


def kernel_family_sees(mask: KernelMask, q: int, k: int) -> bool:
    """The kernels' documented mask family (kernels/common.py), as plain Python."""
    ok = 0 <= k <= q
    if mask.lookback is not None:
        ok = ok and k >= q - mask.lookback
    if mask.period is not None:
        ok = ok and k >= q - q % mask.period
    return ok


def naive(q, k, v, q_pos, k_pos, pattern, scale):
    """Loops over rows, heads, queries and keys in float64 (one segment)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, tq, hq, _ = q.shape
    hkv = k.shape[2]
    out = np.zeros((b, tq, hq, v.shape[3]))
    for r in range(b):
        for h in range(hq):
            for i in range(tq):
                js = [j for j in range(k.shape[1])
                      if sees(pattern, int(q_pos[r, i]), int(k_pos[r, j]))]
                if not js:
                    continue
                s = np.array([q[r, i, h] @ k[r, j, h // (hq // hkv)] * scale for j in js])
                w = np.exp(s - s.max())
                out[r, i, h] = (w[:, None] * v[r, js, h // (hq // hkv)]).sum(0) / w.sum()
    return out


PATTERNS = [Causal(), Window(3), Block(4), Chunked(3), Chunked(8), Strided(2), Strided(5)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(pattern=st.sampled_from(PATTERNS), q=st.integers(-2, 40), k=st.integers(-2, 40))
def test_every_pattern_states_one_mask_three_ways(pattern: Pattern, q: int, k: int) -> None:
    """``allows`` (XLA), ``kernel_mask`` (Triton) and ``key_range`` (planner) say the same."""
    want = sees(pattern, q, k)
    got = bool(pattern.allows(jnp.int32(q), jnp.int32(k))) and q >= 0 and k >= 0
    assert got == want
    mask = pattern.kernel_mask()
    if mask is not None:
        assert kernel_family_sees(mask, q, k) == want
    if q >= 0 and want:  # every visible key lies inside S(q)
        t, size = sympy.Symbol("t"), getattr(pattern, "size", None)
        start, stop = pattern.key_range(t, size)
        assert int(start.subs(t, q)) <= k < int(stop.subs(t, q))


@pytest.mark.parametrize("pattern", [Chunked(3), Strided(2)], ids=str)
def test_reference_attention_equals_naive(pattern: Pattern) -> None:
    rng = np.random.default_rng(0)
    b, t, hq, hkv, d = 2, 11, 4, 2, 8
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, t, hkv, d)).astype(np.float32)
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    pos[1, :3] = -1  # left padding in row 1
    seg = np.zeros_like(pos)
    got = reference_attention(q, k, v, pos, pos, seg, seg, pattern=pattern, scale=0.3)
    np.testing.assert_allclose(np.asarray(got), naive(q, k, v, pos, pos, pattern, 0.3),
                               atol=1e-5)


# ----------------------------------------------------------------------------- a user's model


class TinyLM(nnx.Module):
    """A third-party-style decoder whose layers use the patterns it is given."""

    def __init__(self, patterns: tuple[Pattern, ...], vocab: int = 41, dim: int = 32,
                 heads: int = 4, *, rngs: nnx.Rngs) -> None:
        self.patterns, self.heads = patterns, heads
        self.emb = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(64, dim, rngs=rngs)
        self.qkv = nnx.List([nnx.Linear(dim, 3 * dim, rngs=rngs) for _ in patterns])
        self.mlp = nnx.List([nnx.Linear(dim, dim, rngs=rngs) for _ in patterns])
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens, positions, segment_ids):
        x = self.emb(tokens) + self.pos(jnp.maximum(positions, 0))
        b, t, dim = x.shape
        for pattern, qkv, mlp in zip(self.patterns, self.qkv, self.mlp, strict=True):
            q, k, v = jnp.split(qkv(x).reshape(b, t, 3 * self.heads, dim // self.heads), 3, 2)
            x = x + attend(q, k, v, pattern, q_positions=positions, kv_positions=positions,
                           q_segment_ids=segment_ids, kv_segment_ids=segment_ids
                           ).reshape(b, t, dim)
            x = x + jnp.tanh(mlp(x))
        return self.head(x)


PROMPTS = [np.array([1, 2, 3], np.int32), np.array([4, 5, 6, 7, 8, 9, 10], np.int32),
           np.array([7], np.int32)]
LIMITS = (13, 6, 10)  # crosses chunk boundaries and store growth; rows end apart


def _model() -> TinyLM:
    return TinyLM((Chunked(4), Strided(3), Causal()), rngs=nnx.Rngs(3))


def test_the_planner_derives_stores_from_the_new_patterns() -> None:
    lm = SymbolicLM(_model(), EngineOptions(min_capacity=4, compact_min_rows=1))
    kinds = {type(s.pattern).__name__: s.kind.name for s in lm.specs.values()}
    assert kinds == {"Chunked": "block", "Strided": "growing", "Causal": "growing"}
    assert {s.capacity for s in lm.specs.values() if isinstance(s.pattern, Chunked)} == {4}


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_generation_with_new_patterns_equals_rerunning_the_model(backend: str) -> None:
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    model = _model()
    lm = SymbolicLM(model, EngineOptions(min_capacity=4, backend=backend, compact_min_rows=1))
    cfg = GenerationConfig(max_new_tokens=LIMITS, return_logits=True)
    res = lm.generate(PROMPTS, cfg)
    padded = padded_generate(model, PROMPTS, cfg)
    for i, (p, n) in enumerate(zip(PROMPTS, LIMITS, strict=True)):
        want, want_logits = naive_generate(model, p, n)
        np.testing.assert_array_equal(res.tokens[i], want)
        np.testing.assert_array_equal(padded.tokens[i], want)
        np.testing.assert_allclose(np.asarray(res.logits[i]), want_logits, atol=1e-4, rtol=0)


def test_triton_kernels_run_an_in_family_pattern_and_refuse_the_other() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from jaxrl_sym.backends import triton_ops

    rng = np.random.default_rng(1)
    n, hq, hkv, d = 23, 4, 2, 16
    q = jnp.asarray(rng.standard_normal((n, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((n, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, hkv, d)), jnp.float32)
    cu = jnp.asarray([0, 9, 23], jnp.int32)
    out = triton_ops.packed_attention(q, k, v, cu, pattern=Chunked(4), scale=0.25,
                                      block_m=16, block_n=16)
    pos = np.concatenate([np.arange(9), np.arange(14)]).astype(np.int32)
    want = np.concatenate([
        naive(q[None, :9], k[None, :9], v[None, :9], pos[None, :9], pos[None, :9], Chunked(4),
              0.25)[0],
        naive(q[None, 9:], k[None, 9:], v[None, 9:], pos[None, 9:], pos[None, 9:], Chunked(4),
              0.25)[0]])
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-4)
    with pytest.raises(PatternError, match=r"Strided\(size=2\).*kernel_mask"):
        triton_ops.packed_attention(q, k, v, cu, pattern=Strided(2), scale=0.25)


def test_a_non_pattern_is_refused_by_name() -> None:
    x = jnp.zeros((1, 2, 1, 4))
    p = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(PatternError, match="your own subclass"):
        attend(x, x, x, "window:4", q_positions=p, kv_positions=p)
