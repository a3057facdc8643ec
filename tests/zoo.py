"""Models written the way public Flax NNX LLM code is written, independently of ``DecoderLM``.

Each has its own config class and names, calls nothing of this library but ``attend`` (and the
patterns), and follows only the contract: ``model(tokens, positions, segment_ids) -> logits``.
They differ from ``DecoderLM`` where real models differ: learned positions + LayerNorm with bias +
GELU + fused QKV unpacked with ``jnp.split``/``unstack`` (GPT-2), stacked layer weights applied
with ``lax.scan`` (MaxText / ``nnx.scan`` style), one shared block under ``fori_loop``, interleaved
window/full GQA layers with parallel attention+MLP and attention- and final-logit soft-capping
(Gemma-2-like),
RoPE built with ``jnp.stack`` (interleaved pairs, GPT-J/Llama-Meta convention).

``naive_generate`` is the oracle for any of them: greedy decoding by re-running the full forward
on the whole sequence at every step (right-padded to a power-of-two width under ``jit``) — no
caches, no shared code with either system.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxrl_sym import Causal, Window, attend

# --------------------------------------------------------------------------- GPT-2-like


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 61
    n_embd: int = 32
    n_head: int = 4
    n_layer: int = 2
    block_size: int = 256


class GPTBlock(nnx.Module):
    def __init__(self, c: GPTConfig, rngs: nnx.Rngs) -> None:
        self.ln_1 = nnx.LayerNorm(c.n_embd, rngs=rngs)
        self.c_attn = nnx.Linear(c.n_embd, 3 * c.n_embd, rngs=rngs)  # fused qkv, with bias
        self.c_proj = nnx.Linear(c.n_embd, c.n_embd, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(c.n_embd, rngs=rngs)
        self.c_fc = nnx.Linear(c.n_embd, 4 * c.n_embd, rngs=rngs)
        self.mlp_proj = nnx.Linear(4 * c.n_embd, c.n_embd, rngs=rngs)
        self.n_head = c.n_head

    def __call__(self, x, pos, seg):
        b, t, d = x.shape
        qkv = self.c_attn(self.ln_1(x)).reshape(b, t, 3, self.n_head, d // self.n_head)
        q, k, v = jnp.unstack(qkv, axis=2)
        y = attend(q, k, v, Causal(), q_positions=pos, kv_positions=pos,
                   q_segment_ids=seg, kv_segment_ids=seg)
        x = x + self.c_proj(y.reshape(b, t, d))
        return x + self.mlp_proj(jax.nn.gelu(self.c_fc(self.ln_2(x))))


class GPT2Like(nnx.Module):
    def __init__(self, c: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.wte = nnx.Embed(c.vocab, c.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(c.block_size, c.n_embd, rngs=rngs)  # learned positions
        self.h = nnx.List([GPTBlock(c, rngs) for _ in range(c.n_layer)])
        self.ln_f = nnx.LayerNorm(c.n_embd, rngs=rngs)
        self.lm_head = nnx.Linear(c.n_embd, c.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, positions, segment_ids):
        x = self.wte(tokens) + self.wpe(jnp.maximum(positions, 0))
        for blk in self.h:
            x = blk(x, positions, segment_ids)
        return self.lm_head(self.ln_f(x))


# --------------------------------------------------------------------------- stacked layers


def rope_interleaved(x, pos, base=10000.0):
    """Rotary embedding on interleaved pairs (x0,x1),(x2,x3)…, built with jnp.stack."""
    d = x.shape[-1]
    freqs = 1.0 / base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    ang = jnp.maximum(pos, 0).astype(jnp.float32)[..., None, None] * freqs
    xr = x.reshape(*x.shape[:-1], d // 2, 2)
    a, b = xr[..., 0], xr[..., 1]
    c, s = jnp.cos(ang), jnp.sin(ang)
    return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class StackedConfig:
    vocab_size: int = 53
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    depth: int = 3
    mlp: int = 48
    window: int | None = 5


class ScanLM(nnx.Module):
    """Layer weights stacked on a leading axis, applied with ``lax.scan`` (one traced body)."""

    def __init__(self, c: StackedConfig, *, rngs: nnx.Rngs) -> None:
        hd = c.hidden // c.heads
        init = nnx.initializers.normal(0.1)
        shapes = {
            "wq": (c.depth, c.hidden, c.heads * hd), "wk": (c.depth, c.hidden, c.kv_heads * hd),
            "wv": (c.depth, c.hidden, c.kv_heads * hd), "wo": (c.depth, c.heads * hd, c.hidden),
            "w_up": (c.depth, c.hidden, c.mlp), "w_gate": (c.depth, c.hidden, c.mlp),
            "w_down": (c.depth, c.mlp, c.hidden), "norm": (c.depth, 2, c.hidden),
        }
        self.stack = nnx.Dict({k: nnx.Param(init(rngs.params(), s)) for k, s in shapes.items()})
        self.embedding = nnx.Param(init(rngs.params(), (c.vocab_size, c.hidden)))
        self.c = c

    def __call__(self, tokens, positions, segment_ids):
        c, hd = self.c, self.c.hidden // self.c.heads
        pattern = Window(c.window) if c.window else Causal()
        x = self.embedding[...][tokens]
        b, t, _ = x.shape

        def rms(h, w):
            return h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * (1 + w)

        def layer(h, w):
            a = rms(h, w["norm"][0])
            q = rope_interleaved((a @ w["wq"]).reshape(b, t, c.heads, hd), positions)
            k = rope_interleaved((a @ w["wk"]).reshape(b, t, c.kv_heads, hd), positions)
            v = (a @ w["wv"]).reshape(b, t, c.kv_heads, hd)
            o = attend(q, k, v, pattern, q_positions=positions, kv_positions=positions,
                       q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
            h = h + o.reshape(b, t, -1) @ w["wo"]
            m = rms(h, w["norm"][1])
            return h + (jax.nn.silu(m @ w["w_gate"]) * (m @ w["w_up"])) @ w["w_down"], None

        weights = {k: v[...] for k, v in self.stack.items()}
        x, _ = lax.scan(layer, x, weights)
        return x @ self.embedding[...].T


class SharedBlockLM(nnx.Module):
    """One block applied ``depth`` times with ``fori_loop`` (ALBERT / universal-transformer)."""

    def __init__(self, vocab: int = 47, dim: int = 24, heads: int = 3, depth: int = 3, *,
                 rngs: nnx.Rngs) -> None:
        self.emb = nnx.Embed(vocab, dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)
        self.heads, self.depth = heads, depth

    def __call__(self, tokens, positions, segment_ids):
        x = self.emb(tokens)
        b, t, d = x.shape

        def body(_, h):
            q, k, v = jnp.split(self.qkv(self.norm(h)), 3, axis=-1)
            q, k, v = (z.reshape(b, t, self.heads, d // self.heads) for z in (q, k, v))
            o = attend(q, k, v, Causal(), q_positions=positions, kv_positions=positions,
                       q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
            return h + self.out(o.reshape(b, t, d))

        x = lax.fori_loop(0, self.depth, body, x)
        return self.head(x)


# --------------------------------------------------------------------------- Gemma-2-like


@dataclasses.dataclass(frozen=True)
class GemmaishConfig:
    num_embed: int = 67
    embed_dim: int = 32
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 8
    hidden_dim: int = 64
    sliding_window_size: int = 4
    final_logit_softcap: float = 30.0
    attn_logit_softcap: float = 0.5  # small: random weights give small logits, the cap must bite
    layer_kinds: tuple[str, ...] = ("local", "global", "local", "global")


class GemmaishLayer(nnx.Module):
    def __init__(self, c: GemmaishConfig, kind: str, rngs: nnx.Rngs) -> None:
        self.pre_norm = nnx.RMSNorm(c.embed_dim, rngs=rngs)
        self.q_einsum = nnx.Param(nnx.initializers.normal(0.2)(
            rngs.params(), (c.num_heads, c.embed_dim, c.head_dim)))
        self.kv_einsum = nnx.Param(nnx.initializers.normal(0.2)(
            rngs.params(), (2, c.num_kv_heads, c.embed_dim, c.head_dim)))
        self.attn_vec_einsum = nnx.Param(nnx.initializers.normal(0.2)(
            rngs.params(), (c.num_heads, c.head_dim, c.embed_dim)))
        self.gating = nnx.Linear(c.embed_dim, 2 * c.hidden_dim, use_bias=False, rngs=rngs)
        self.linear = nnx.Linear(c.hidden_dim, c.embed_dim, use_bias=False, rngs=rngs)
        self.pattern = Window(c.sliding_window_size) if kind == "local" else Causal()
        self.softcap = c.attn_logit_softcap

    def __call__(self, x, pos, seg):
        h = self.pre_norm(x)
        q = jnp.einsum("btd,ndh->btnh", h, self.q_einsum[...])
        k, v = jnp.einsum("btd,cndh->cbtnh", h, self.kv_einsum[...])  # unpacked along axis 0
        o = attend(q, k, v, self.pattern, q_positions=pos, kv_positions=pos,
                   q_segment_ids=seg, kv_segment_ids=seg, scale=0.3,
                   logit_softcap=self.softcap)
        attn = jnp.einsum("btnh,nhd->btd", o, self.attn_vec_einsum[...])
        g, u = jnp.split(self.gating(h), 2, axis=-1)
        return x + attn + self.linear(jax.nn.gelu(g) * u)  # parallel attention + MLP


class GemmaishLM(nnx.Module):
    def __init__(self, c: GemmaishConfig, *, rngs: nnx.Rngs) -> None:
        self.embedder = nnx.Embed(c.num_embed, c.embed_dim, rngs=rngs)
        self.blocks = nnx.List([GemmaishLayer(c, k, rngs) for k in c.layer_kinds])
        self.final_norm = nnx.RMSNorm(c.embed_dim, rngs=rngs)
        self.c = c

    def __call__(self, tokens, positions, segment_ids):
        x = self.embedder(tokens) * jnp.sqrt(float(self.c.embed_dim))
        for blk in self.blocks:
            x = blk(x, positions, segment_ids)
        logits = self.embedder.attend(self.final_norm(x))
        cap = self.c.final_logit_softcap
        return jnp.tanh(logits / cap) * cap


# --------------------------------------------------------------------------- oracle


def zoo(seed: int = 0) -> dict[str, nnx.Module]:
    """One instance of every zoo model (small enough for CPU tests)."""
    r = lambda k: nnx.Rngs(seed + k)
    return {
        "gpt2": GPT2Like(GPTConfig(), rngs=r(0)),
        "scan": ScanLM(StackedConfig(), rngs=r(1)),
        "shared": SharedBlockLM(rngs=r(2)),
        "gemmaish": GemmaishLM(GemmaishConfig(), rngs=r(3)),
    }


# naive_generate's steps so far, per model (held, so its id is not reused): (model, digest of
# its weights when they ran, {prompt: (tokens, logits rows)})
_NAIVE_RUNS: dict[int, tuple[nnx.Module, str, dict[tuple[int, ...], tuple[list, list]]]] = {}


def _weights_digest(model: nnx.Module) -> str:
    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(nnx.state(model)):
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()


def _bucket(n: int) -> int:
    """The forward's width for a sequence of ``n`` tokens: the next power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


@nnx.jit
def _plain_forward(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return model(tokens, pos, jnp.zeros_like(pos))[0]


def naive_generate(model: nnx.Module, prompt: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and their logits rows, re-running the whole sequence at every step.

    Step ``i`` is a forward of the prompt and the ``i`` tokens before it, right-padded with
    zeros to a power-of-two width, and reads the logits at the last real position. Padding after
    a position cannot reach it in a causal model, which generation presupposes (a token cannot
    depend on tokens not yet drawn); a model that leaked the future would differ from every
    cached system here, so the padding can only make this oracle stricter. The forward is the
    plain model under ``jit`` (one compile per width: eager forwards compiled every operation
    at every new length, ~1.6 s a step, the suite's costliest oracle).

    A run of ``n`` steps is the first ``n`` steps of any longer run of the same model, weights
    and prompt: steps an earlier call computed are returned, not recomputed (the same forwards,
    the same bits), and a longer call continues from them (tests ask for the same prompt
    several times: a GRPO batch repeats each prompt)."""
    digest = _weights_digest(model)
    known = _NAIVE_RUNS.get(id(model))
    if known is None or known[1] != digest:
        known = _NAIVE_RUNS[id(model)] = (model, digest, {})
    toks, rows = known[2].setdefault(tuple(int(x) for x in prompt), ([], []))
    seq = [int(x) for x in prompt] + toks
    while len(toks) < n:
        buf = np.zeros((1, _bucket(len(seq))), np.int32)
        buf[0, :len(seq)] = seq
        logits = np.asarray(_plain_forward(model, jnp.asarray(buf))[len(seq) - 1], np.float32)
        nxt = int(np.argmax(logits))
        toks.append(nxt)
        rows.append(logits)
        seq.append(nxt)
    if _weights_digest(model) != digest:  # a forward that changes its model: never reused
        del _NAIVE_RUNS[id(model)]
    return np.asarray(toks[:n], np.int32), np.stack(rows[:n])


def gpt2(seed: int = 0) -> GPT2Like:
    """Factory for ``jaxrl-sym decode --model zoo:gpt2`` (with ``tests`` on PYTHONPATH)."""
    return GPT2Like(GPTConfig(), rngs=nnx.Rngs(seed))
