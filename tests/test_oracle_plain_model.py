"""Generation on models that are not ``DecoderLM``, against re-running the plain model.

The padded baseline is a baseline, not an oracle: it shares the jaxpr interpreter, the reference
attention, ``select_tokens`` and ``check_model`` with the symbolic runtime. Here both systems
(``SymbolicLM(model).generate`` and ``padded_generate``) are checked against the plain model run
the naive way, in plain JAX: greedy decoding is a loop that runs the model's full forward on
the whole sequence so far at every step and takes the argmax; a sampled row's log-probs are
``log_softmax(logits / T)`` of the plain model on that row's prompt + response.

Two kinds of models, on ragged prompts drawn by hypothesis:

* ``PlainLM`` (this file): sliding-window + full layers (GQA, soft-capped logits), and
  linear-attention (a recurrent state) + window layers. The instance the systems run calls
  :func:`jaxrl_sym.attend`; its twin with the same weights calls :func:`plain_attention`
  below — dense masked softmax by token index, and linear attention as an explicit running
  state (S_t = sum phi(k) v^T, z_t = sum phi(k)) — so the oracle shares no code with the
  library at all.
* the zoo's Gemma-2-like model (``tests/zoo.py``), re-run with its own
  ``__call__`` (whose ``attend`` evaluates the library's reference attention; that one is
  checked against Python loops in ``test_pattern_extension.py``).

The oracle buffer is right-padded to a fixed [rows, L] so its program compiles once per model;
padding after a row's last token cannot change a causal model's logits before it.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zoo import zoo

from jaxrl_sym import Causal, GenerationConfig, GenerationResult, Linear, Window, attend
from jaxrl_sym.baselines.padded import padded_generate
from jaxrl_sym.errors import InputError
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions

ROWS, WIDTH = 4, 32  # the oracle's buffer: up to 4 prompts of <= 14 tokens + <= 8 new ones
TOL = 1e-4

# --------------------------------------------------------------------------- a plain model


def plain_attention(q: jax.Array, k: jax.Array, v: jax.Array, kind: str, window: int,
                    scale: float, softcap: float | None) -> jax.Array:
    """q [B,T,H,D], k/v [B,T,Hkv,D]; one sequence per row, position = index."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # head h reads kv head h // g
    if kind == "linear":
        fq, fk = jax.nn.elu(q) + 1.0, jax.nn.elu(k) + 1.0
        state = jnp.cumsum(jnp.einsum("bthd,bthe->bthde", fk, v), axis=1)  # S_t
        norm = jnp.cumsum(fk, axis=1)  # z_t
        num = jnp.einsum("bthd,bthde->bthe", fq, state)
        return num / jnp.einsum("bthd,bthd->bth", fq, norm)[..., None]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    i = jnp.arange(q.shape[1])
    sees = i[None, :] <= i[:, None]
    if kind == "window":
        sees &= i[:, None] - i[None, :] < window
    p = jax.nn.softmax(jnp.where(sees, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


@dataclasses.dataclass(frozen=True)
class PlainConfig:
    layers: tuple[str, ...]
    vocab: int = 41
    dim: int = 32
    heads: int = 4
    kv_heads: int = 2
    window: int = 3
    softcap: float | None = None


def rope(x: jax.Array, pos: jax.Array) -> jax.Array:
    """Rotary embedding on the two halves of the head dimension (Llama / HF convention)."""
    half = x.shape[-1] // 2
    ang = pos.astype(jnp.float32)[..., None, None] * 10000.0 ** (-jnp.arange(half) / half)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * jnp.cos(ang) - b * jnp.sin(ang),
                            a * jnp.sin(ang) + b * jnp.cos(ang)], axis=-1)


class PlainLayer(nnx.Module):
    def __init__(self, c: PlainConfig, kind: str, independent: bool, rngs: nnx.Rngs) -> None:
        hd = c.dim // c.heads
        kv = c.heads if kind == "linear" else c.kv_heads
        self.norm1, self.norm2 = nnx.RMSNorm(c.dim, rngs=rngs), nnx.RMSNorm(c.dim, rngs=rngs)
        self.q = nnx.Linear(c.dim, c.heads * hd, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(c.dim, 2 * kv * hd, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(c.heads * hd, c.dim, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(c.dim, 2 * c.dim, rngs=rngs)
        self.down = nnx.Linear(2 * c.dim, c.dim, rngs=rngs)
        self.kind, self.c, self.kv_heads, self.independent = kind, c, kv, independent

    def __call__(self, x: jax.Array, pos: jax.Array, seg: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        c, hd = self.c, self.c.dim // self.c.heads
        h = self.norm1(x)
        q = self.q(h).reshape(b, t, c.heads, hd)
        k, v = jnp.split(self.kv(h).reshape(b, t, 2 * self.kv_heads, hd), 2, axis=2)
        if self.kind != "linear":
            q, k = rope(q, pos), rope(k, pos)
        softcap = c.softcap if self.kind != "linear" else None
        if self.independent:
            o = plain_attention(q, k, v, self.kind, c.window, 0.5, softcap)
        else:
            pattern = {"full": Causal(), "window": Window(c.window), "linear": Linear()}
            o = attend(q, k, v, pattern[self.kind], q_positions=pos, kv_positions=pos,
                       q_segment_ids=seg, kv_segment_ids=seg, scale=0.5, logit_softcap=softcap)
        x = x + self.o(o.reshape(b, t, -1))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class PlainLM(nnx.Module):
    """``model(tokens, positions, segment_ids) -> logits``; ``independent`` picks the attention
    (the library's ``attend`` or :func:`plain_attention`), nothing else differs."""

    def __init__(self, c: PlainConfig, *, independent: bool, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(c.vocab, c.dim, rngs=rngs)
        self.blocks = nnx.List([PlainLayer(c, k, independent, rngs) for k in c.layers])
        self.norm = nnx.RMSNorm(c.dim, rngs=rngs)
        self.head = nnx.Linear(c.dim, c.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, positions, segment_ids)
        return self.head(self.norm(x))


PLAIN = {
    "window-softcap": PlainConfig(("window", "full"), softcap=2.0),
    "linear": PlainConfig(("linear", "window")),
}
ZOO = ("gemmaish",)  # Gemma-2-like: interleaved window/full GQA, attention and final soft-caps
NAMES = (*PLAIN, *ZOO)


@cache
def models(name: str) -> tuple[nnx.Module, nnx.Module, SymbolicLM]:
    """(the model the systems run, its oracle twin, the symbolic engine)."""
    if name in PLAIN:
        model = PlainLM(PLAIN[name], independent=False, rngs=nnx.Rngs(7))
        twin = PlainLM(PLAIN[name], independent=True, rngs=nnx.Rngs(7))
        for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(twin)),
                        strict=True):
            assert np.array_equal(a, b)  # same weights, only the attention code differs
    else:
        model = twin = zoo()[name]
    return model, twin, SymbolicLM(model, EngineOptions(min_capacity=4, compact_min_rows=1))


@cache
def plain_forward(name: str):  # a jitted function
    """The twin's full forward on a fixed [ROWS, WIDTH] buffer, positions 0..WIDTH-1."""
    graphdef, state = nnx.split(models(name)[1])
    pos = jnp.broadcast_to(jnp.arange(WIDTH, dtype=jnp.int32), (ROWS, WIDTH))

    @jax.jit
    def fwd(tokens: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(tokens, pos, jnp.zeros_like(pos))

    return lambda tokens: np.asarray(fwd(jnp.asarray(tokens)), np.float64)


# --------------------------------------------------------------------------- the oracle


def plain_greedy(name: str, prompts: list[np.ndarray], limits: tuple[int, ...],
                 eos: tuple[int, ...]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Greedy rows and the logits behind each token: every step runs the whole sequence so far
    through the plain model and appends the argmax (a row stops at its limit or after eos)."""
    fwd = plain_forward(name)
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    rows: list[list[np.ndarray]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        buf = np.zeros((ROWS, WIDTH), np.int32)
        for r in live:
            buf[r, :len(seqs[r])] = seqs[r]
        logits = fwd(buf)
        for r in list(live):
            x = logits[r, len(seqs[r]) - 1]
            tok = int(np.argmax(x))
            out[r].append(tok)
            rows[r].append(x)
            seqs[r].append(tok)
            if len(out[r]) == limits[r] or tok in eos:
                live.remove(r)
    return [np.array(o, np.int32) for o in out], [np.stack(x) for x in rows]


def plain_logprobs(name: str, prompts: list[np.ndarray], responses: list[np.ndarray],
                   temperature: float) -> list[np.ndarray]:
    """log p(response token | sequence before it) under softmax(plain logits / T)."""
    buf = np.zeros((ROWS, WIDTH), np.int32)
    for r, (p, t) in enumerate(zip(prompts, responses, strict=True)):
        buf[r, :len(p) + len(t)] = np.concatenate([p, t])
    logits = plain_forward(name)(buf) / temperature
    lsm = logits - logits.max(-1, keepdims=True)
    lsm = lsm - np.log(np.exp(lsm).sum(-1, keepdims=True))
    return [lsm[r, len(p) - 1 + np.arange(len(t)), t]
            for r, (p, t) in enumerate(zip(prompts, responses, strict=True))]


# --------------------------------------------------------------------------- the checks


@st.composite
def requests(draw: st.DrawFn, vocab: int) -> tuple[list[np.ndarray], GenerationConfig]:
    n = draw(st.integers(1, ROWS))
    lens = draw(st.lists(st.integers(1, 14), min_size=n, max_size=n))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    prompts = [rng.integers(0, vocab, k).astype(np.int32) for k in lens]
    if n > 1 and draw(st.booleans()):  # a GRPO-like batch: one prompt repeated
        prompts[-1] = prompts[0]
    limits = tuple(draw(st.lists(st.integers(1, 8), min_size=n, max_size=n)))
    temperature = draw(st.sampled_from([0.0, 0.0, 0.7, 1.0]))
    cfg = GenerationConfig(max_new_tokens=limits, temperature=temperature,
                           eos_id=draw(st.sampled_from([None, 3])),
                           seed=draw(st.integers(0, 99)), return_logits=temperature == 0.0)
    return prompts, cfg


def check_against_plain_model(name: str, prompts: list[np.ndarray], cfg: GenerationConfig,
                              res: GenerationResult) -> None:
    limits = cfg.max_new_tokens
    eos = cfg.eos_ids
    for i, (toks, lps) in enumerate(zip(res.tokens, res.logprobs, strict=True)):
        assert 1 <= len(toks) <= limits[i], (i, toks)
        assert len(lps) == len(toks)
        stop = [j for j, t in enumerate(toks) if t in eos]
        assert stop in ([], [len(toks) - 1]), f"row {i} runs past eos: {toks}"
        if len(toks) < limits[i]:
            assert toks[-1] in eos, f"row {i} stopped early without eos: {toks}"
    if cfg.temperature == 0.0:
        want, want_logits = plain_greedy(name, prompts, limits, eos)
        for i, (toks, w) in enumerate(zip(res.tokens, want, strict=True)):
            np.testing.assert_array_equal(toks, w, err_msg=f"{name} row {i}")
            np.testing.assert_allclose(np.asarray(res.logits[i]), want_logits[i], atol=TOL,
                                       rtol=0, err_msg=f"{name} row {i} logits")
        want_lp = plain_logprobs(name, prompts, want, 1.0)
    else:
        want_lp = plain_logprobs(name, prompts, list(res.tokens), cfg.temperature)
    for i, (lp, w) in enumerate(zip(res.logprobs, want_lp, strict=True)):
        np.testing.assert_allclose(np.asarray(lp), w, atol=TOL, rtol=TOL,
                                   err_msg=f"{name} row {i} log-probs")


SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=3, **SETTINGS)
@given(data=st.data())
def test_symbolic_generation_equals_the_plain_model(name: str, data: st.DataObject) -> None:
    eng = models(name)[2]
    prompts, cfg = data.draw(requests(model_vocab(name)))
    check_against_plain_model(name, prompts, cfg, eng.generate(prompts, cfg))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=2, **SETTINGS)
@given(data=st.data())
def test_padded_generation_equals_the_plain_model(name: str, data: st.DataObject) -> None:
    model = models(name)[0]
    prompts, cfg = data.draw(requests(model_vocab(name)))
    check_against_plain_model(name, prompts, cfg, padded_generate(model, prompts, cfg))


@cache
def fixed_engine(name: str, max_len: int) -> SymbolicLM:
    """The engine with full-attention stores fixed at ``max_len`` (no growth)."""
    return SymbolicLM(models(name)[0], EngineOptions(max_len=max_len, min_capacity=4,
                                                     decode_tile=2))


FIXED = 16  # the tight max_len: rows of prompt + limit up to 16, prompts up to 14 tokens


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=3, **SETTINGS)
@given(data=st.data())
def test_fixed_max_len_with_ragged_prompts_equals_the_plain_model(
        name: str, data: st.DataObject) -> None:
    """EngineOptions.max_len with ragged prompts (issue 29): the shortest prompt's row starts
    furthest left in the right-aligned block, so the fixed stores must hold its left padding
    plus max_len; sized from the longest prompt, a short prompt's long response wrote past the
    store (clamped over older keys) and the tokens silently differed."""
    prompts, cfg = data.draw(requests(model_vocab(name)))
    limits = tuple(min(m, FIXED - len(p)) for p, m in zip(prompts, cfg.max_new_tokens,
                                                          strict=True))
    cfg = dataclasses.replace(cfg, max_new_tokens=limits)
    check_against_plain_model(name, prompts, cfg, fixed_engine(name, FIXED).generate(prompts, cfg))


@pytest.mark.parametrize("name", NAMES)
def test_fixed_max_len_short_prompt_long_response_beside_a_long_prompt(name: str) -> None:
    """The case that failed: 1 + 15 and 13 + 3 tokens each fit max_len 16 exactly."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 40, n).astype(np.int32) for n in (1, 13)]
    cfg = GenerationConfig(max_new_tokens=(8, 3), return_logits=True)
    check_against_plain_model(name, prompts, cfg, fixed_engine(name, FIXED).generate(prompts,
                                                                                      cfg))


def test_fixed_max_len_refuses_a_row_that_does_not_fit() -> None:
    prompts = [np.arange(1, 4, dtype=np.int32), np.arange(1, 13, dtype=np.int32)]
    with pytest.raises(InputError, match=r"max_len=16: row 1 needs 12 prompt \+ 6 new tokens"):
        fixed_engine("gemmaish", FIXED).generate(prompts, GenerationConfig(max_new_tokens=6))


@cache
def model_vocab(name: str) -> int:
    pos = jnp.zeros((1, 1), jnp.int32)
    return int(models(name)[1](pos, pos, pos).shape[-1])


def test_the_oracle_is_not_vacuous() -> None:
    """The twin differs from the attend model only in its attention, and the plain attention
    is not trivially the same: a model whose window is wrong disagrees with it."""
    model, twin, _ = models("window-softcap")
    tok = jnp.asarray(np.arange(12, dtype=np.int32) % 41)[None]
    pos = jnp.arange(12, dtype=jnp.int32)[None]
    a, b = model(tok, pos, 0 * pos), twin(tok, pos, 0 * pos)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    wider = PlainLM(dataclasses.replace(PLAIN["window-softcap"], window=4), independent=True,
                    rngs=nnx.Rngs(7))
    assert np.abs(np.asarray(wider(tok, pos, 0 * pos)) - np.asarray(a)).max() > 1e-3
