"""Tunix (``google-tunix`` 0.1.7), the JAX RL fine-tuning library users would pick instead of us,
as a peer generation system on the same weights.

Why a peer and not another baseline written by us: the padded baseline is our reading of how JAX
RL stacks generate; Tunix *is* one. Our :class:`~jaxrl_sym.models.lm.DecoderLM`'s weights are
copied into Tunix's own Qwen2 (``tunix.models.qwen2.model.Qwen2``: RMSNorm, RoPE, GQA, SwiGLU,
tied head — the same function; its q/k/v biases are set to zero because ours has none), or a
Qwen2 checkpoint loaded by :func:`jaxrl_sym.models.hf.load_pretrained` with its biases and head,
and Tunix's own ``Sampler`` generates, called through its public ``__call__`` as a user would:

* ``tunix``: the smallest KV cache it accepts for the request — prompts left-padded by Tunix to
  the next power of two of the longest (its default ``max_prompt_length``), ``cache_size`` = that
  + max new tokens (what a user sizing the cache for the run would set).
* ``tunix-defaults``: its rollout defaults (``RolloutConfig``: ``max_prompt_length=64``,
  ``kv_cache_size=1024``); a request that does not fit 1024 slots fails as it fails for a user.

Token ids go in as text through a tiny id tokenizer (``"3 17 5"``), so Tunix's host-side
tokenise/pad/trim path is part of its measured time as it is for its users. Tunix's semantics
that differ from ours, and how results are mapped back:

* It has one ``max_generation_steps`` for the batch: every row decodes to max(limits) (its
  ``while_loop`` stops only when *all* rows are done); each row is trimmed to its own limit here.
* Its outputs end *before* the first EOS; the EOS token is appended here (it is what was sampled),
  but its log-prob is not returned by Tunix, so such a row's ``logprobs`` is one shorter.
* Its Qwen2 has no ``num_embed``, so ``return_logits=True`` cannot work in 0.1.7: no logits.
* Pad id = vocab size (never sampled; Tunix masks every buffer slot equal to the pad id, so a
  sampled pad would be masked). Its embedding lookup clamps that id; pad slots are masked anyway.
* Temperature > 0 samples with Tunix's own keys (``top_p=1.0``): same distribution, other tokens.

Tunix is optional (``pip install 'jaxrl_sym[peers]'``). ``import tunix`` runs its package
``__init__``, which imports its whole trainer stack (datasets, grain, qwix, metrax, ...);
:func:`load_tunix` imports only the submodules used here without running that ``__init__``, so the
light install (``pip install --no-deps google-tunix==0.1.7 jaxtyping wadler_lindig
sentencepiece``) is enough.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult, row_limits, validate_prompts
from jaxrl_sym.runtime.metrics import (
    CompileCounter,
    device_peak_bytes,
    executable_temp_bytes,
    tree_bytes,
)

TESTED_VERSION = "0.1.7"
# Tunix's RolloutConfig defaults (tunix/rl/rollout/base_rollout.py, 0.1.7).
ROLLOUT_MAX_PROMPT_LENGTH = 64
ROLLOUT_KV_CACHE_SIZE = 1024


class PeerMissingError(InputError):
    """A peer system was asked for but its package is not installed."""


@dataclass(frozen=True)
class Tunix:
    """The Tunix submodules this adapter uses."""

    qwen2: ModuleType  # tunix.models.qwen2.model
    sampler: ModuleType  # tunix.generate.sampler
    version: str


def tunix_available() -> bool:
    """Whether the ``tunix`` package can be found (without importing it)."""
    return sys.modules.get("tunix") is not None or importlib.util.find_spec("tunix") is not None


def load_tunix() -> Tunix:
    """Import Tunix's Qwen2 model and Sampler modules, or raise :class:`PeerMissingError` (the
    ``tunix`` system's spec adds how to install it: ``jaxrl_sym.systems.get("tunix").install``).

    Why not ``import tunix``: its ``__init__`` imports the trainer stack, whose dependencies the
    light install leaves out. The package is registered without running its ``__init__`` (its
    submodules import as usual); a later ``import tunix`` in this process gets that bare package.
    """
    if not tunix_available():
        raise PeerMissingError("system 'tunix' needs the google-tunix package, which is not "
                               "installed")
    if "tunix" not in sys.modules:
        spec = importlib.util.find_spec("tunix")
        assert spec is not None
        sys.modules["tunix"] = importlib.util.module_from_spec(spec)
    try:
        with _Quiet():
            qwen2 = importlib.import_module("tunix.models.qwen2.model")
            sampler = importlib.import_module("tunix.generate.sampler")
    except ImportError as err:
        raise PeerMissingError(f"system 'tunix': importing Tunix failed ({err})") from err
    try:
        version = importlib.metadata.version("google-tunix")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Tunix(qwen2, sampler, version)


class _Quiet(warnings.catch_warnings):
    """Tunix 0.1.7's own deprecation warnings hidden (``jax.experimental.shard_map``, nnx
    ``sharding=``, and one per call because its Qwen2 has no ``init_cache``): nothing a user of
    this adapter can act on."""

    def __enter__(self) -> None:
        super().__enter__()
        warnings.simplefilter("ignore", DeprecationWarning)


# --------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class Arch:
    """What Tunix's Qwen2 needs to know of one of our models (``DecoderLM`` or a Hugging Face
    Qwen2 ``CausalLM``), read once and checked: the function must be the one Tunix computes."""

    n_layers: int
    vocab: int
    d: int
    ffn: int
    heads: int
    kv: int
    hd: int
    theta: float
    eps: float
    tied: bool
    bias: bool  # q/k/v biases (Qwen2 checkpoints); DecoderLM has none: Tunix's are set to zero
    dtype: Any


def arch(model: Any) -> Arch:
    """Our model's shape for Tunix, or :class:`InputError` saying why Tunix's Qwen2 cannot
    compute the same function (another attention pattern, family or RoPE)."""
    from jaxrl_sym.models.hf.modeling import CausalLM
    from jaxrl_sym.models.lm import DecoderLM

    if isinstance(model, DecoderLM):
        c = model.cfg
        _full_only(c.layer_patterns())
        return Arch(c.n_layers, c.vocab_size, c.d_model, c.ffn_dim, c.n_heads, c.n_kv_heads,
                    c.head_dim, float(c.rope_theta), float(c.norm_eps), True, False, c.dtype)
    if isinstance(model, CausalLM):
        c = model.cfg
        odd = [name for name, on in (
            (f"model_type {c.model_type}", c.model_type != "qwen2"), ("qk_norm", c.qk_norm),
            ("o_bias", c.o_bias), ("mlp_bias", c.mlp_bias), ("gemma_norm", c.gemma_norm),
            (f"hidden_act {c.hidden_act}", c.hidden_act != "silu"),
            ("embed_scale", c.embed_scale is not None), ("softcaps", c.attn_softcap is not None
                                                         or c.final_softcap is not None),
            ("attn_scale", c.attn_scale not in (None, c.head_dim ** -0.5))) if on]
        if odd:
            raise InputError(f"system 'tunix' runs Qwen2 checkpoints in Tunix's Qwen2; this model "
                             f"has {', '.join(odd)}")
        _full_only(c.patterns)
        return Arch(c.num_layers, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_heads,
                    c.num_kv_heads, c.head_dim, _theta(c.inv_freq, c.head_dim),
                    float(c.rms_norm_eps), bool(c.tie_word_embeddings), bool(c.qkv_bias), c.dtype)
    raise InputError(f"system 'tunix' runs a jaxrl_sym DecoderLM (--preset) or a Qwen2 "
                     f"checkpoint in Tunix's Qwen2; got {type(model).__name__}")


def _full_only(patterns: Sequence[Any]) -> None:
    from jaxrl_sym.ops.attention import Causal

    bad = sorted({type(p).__name__ for p in patterns if p != Causal()})
    if bad:
        raise InputError(f"system 'tunix': Tunix's Qwen2 has full causal attention only, the model "
                         f"has {', '.join(bad)} layers; use --attention full")


def _theta(inv_freq: Sequence[float], hd: int) -> float:
    """RoPE base from a checkpoint's inverse frequencies; refused unless Tunix's plain
    ``theta ** (-2i / hd)`` reproduces them (rope scaling is not in Tunix's Qwen2)."""
    theta = float(inv_freq[1]) ** (-hd / 2)
    plain = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    if not np.allclose(plain, np.asarray(inv_freq, np.float64), rtol=1e-5):
        raise InputError("system 'tunix': the checkpoint's RoPE frequencies are scaled; Tunix's "
                         "Qwen2 has plain RoPE only")
    return theta


def tunix_config(model: Any, tx: Tunix) -> Any:
    """Tunix's ``qwen2.ModelConfig`` for our model (its head tying and dtype)."""
    a = arch(model)
    return tx.qwen2.ModelConfig(
        num_layers=a.n_layers, vocab_size=a.vocab, embed_dim=a.d, hidden_dim=a.ffn,
        num_heads=a.heads, head_dim=a.hd, num_kv_heads=a.kv, rope_theta=a.theta,
        norm_eps=a.eps, use_tied_embedding=a.tied, dtype=a.dtype, param_dtype=a.dtype)


Pair = tuple[nnx.Variable, nnx.Variable, tuple[int, ...]]


def _pairs(model: Any, tm: Any) -> list[Pair]:
    """(our variable, Tunix's variable, Tunix's shape) for every weight: the one mapping both
    directions of the conversion use."""
    a = arch(model)
    d, h, kv, hd, f = a.d, a.heads, a.kv, a.hd, a.ffn
    if hasattr(model, "embed"):  # DecoderLM
        ours = [(b.attn_norm, b.attn, b.mlp_norm, b.mlp.gate, b.mlp.up, b.mlp.down)
                for b in model.layers]
        emb, final, head = model.embed.embedding, model.final_norm.scale, None
        scale = lambda n: n.scale
    else:  # Hugging Face CausalLM (Qwen2)
        ours = [(b.input_layernorm, b.self_attn, b.post_attention_layernorm, b.mlp.gate_proj,
                 b.mlp.up_proj, b.mlp.down_proj) for b in model.model.layers]
        emb, final = model.model.embed_tokens.embedding, model.model.norm.weight
        head = None if a.tied else model.lm_head.kernel
        scale = lambda n: n.weight
    out: list[Pair] = [(emb, tm.embedder.input_embedding, (a.vocab, d)),
                       (final, tm.final_norm.w, (d,))]
    if head is not None:
        out.append((head, tm.lm_head.w, (d, a.vocab)))
    for (n1, at, n2, gate, up, down), t in zip(ours, tm.layers, strict=True):
        out += [(scale(n1), t.input_layernorm.w, (d,)),
                (at.q_proj.kernel, t.attn.q_proj.w, (d, h, hd)),
                (at.k_proj.kernel, t.attn.k_proj.w, (d, kv, hd)),
                (at.v_proj.kernel, t.attn.v_proj.w, (d, kv, hd)),
                (at.o_proj.kernel, t.attn.o_proj.w, (h, hd, d)),
                (scale(n2), t.post_attention_layernorm.w, (d,)),
                (gate.kernel, t.mlp.gate_proj.kernel, (d, f)),
                (up.kernel, t.mlp.up_proj.kernel, (d, f)),
                (down.kernel, t.mlp.down_proj.kernel, (f, d))]
        if a.bias:
            out += [(at.q_proj.bias, t.attn.q_bias, (h * hd,)),
                    (at.k_proj.bias, t.attn.k_bias, (kv * hd,)),
                    (at.v_proj.bias, t.attn.v_bias, (kv * hd,))]
    return out


def to_tunix(model: Any, tx: Tunix | None = None) -> Any:
    """Tunix's Qwen2 holding ``model``'s weights (reshaped to its einsum layouts; q/k/v biases
    zero where ours has none). Built under ``nnx.eval_shape``, so Tunix's random initialisation
    never runs."""
    tx = tx or load_tunix()
    cfg = tunix_config(model, tx)
    with _Quiet():
        tm = nnx.eval_shape(lambda: tx.qwen2.Qwen2(cfg, rngs=nnx.Rngs(0)))
    for ours, theirs, shape in _pairs(model, tm):
        theirs.set_value(jnp.asarray(ours.get_value()).reshape(shape))
    if not arch(model).bias:
        for layer in tm.layers:
            for bias in (layer.attn.q_bias, layer.attn.k_bias, layer.attn.v_bias):
                bias.set_value(jnp.zeros(bias.shape, cfg.param_dtype))
    return tm


def from_tunix(tm: Any, like: Any) -> Any:
    """A model configured as ``like`` (DecoderLM or Qwen2 CausalLM) holding Tunix Qwen2 ``tm``'s
    weights; refuses non-zero q/k/v biases where ``like`` has none. The inverse of
    :func:`to_tunix`."""
    from jaxrl_sym.models.hf.modeling import abstract_model
    from jaxrl_sym.models.lm import DecoderLM

    a = arch(like)
    model = (nnx.eval_shape(lambda: DecoderLM(like.cfg, rngs=nnx.Rngs(0)))
             if isinstance(like, DecoderLM) else abstract_model(like.cfg))
    for i, layer in enumerate(tm.layers):
        for name in ("q_bias", "k_bias", "v_bias"):
            if not a.bias and np.any(np.asarray(getattr(layer.attn, name).get_value())):
                raise InputError(f"Tunix layer {i} has a non-zero {name}; "
                                 f"{type(like).__name__} has no bias")
    for ours, theirs, _ in _pairs(model, tm):
        ours.set_value(jnp.asarray(theirs.get_value()).reshape(ours.shape))
    return model


# --------------------------------------------------------------------------- generation


class _IdTokenizer:
    """Token ids as text (``"3 17 5"``): Tunix's Sampler takes strings, our systems take ids."""

    def __init__(self, eos: int, pad: int) -> None:
        self._eos, self._pad = eos, pad

    def encode(self, text: str, **_: Any) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return " ".join(str(int(t)) for t in ids)

    def bos_id(self) -> None:
        return None  # no BOS is prepended: prompts are complete token sequences

    def eos_id(self) -> int:
        return self._eos

    def pad_id(self) -> int:
        return self._pad


@dataclass(frozen=True)
class TunixGeometry:
    """How Tunix is sized for one request."""

    max_prompt_length: int | None  # None: Tunix's rule (next power of two of the longest)
    cache_size: int
    prompt_len: int  # what Tunix pads the prompts to


def geometry(prompt_lens: Sequence[int], new_tokens: int, *, defaults: bool) -> TunixGeometry:
    """Tunix's padded prompt length for these prompts and the cache for the request: the
    smallest it accepts (``padded + new_tokens``), or its rollout defaults."""
    longest = int(max(prompt_lens))
    requested = ROLLOUT_MAX_PROMPT_LENGTH if defaults else None
    if requested is None or requested < longest:
        padded = 1 << (longest - 1).bit_length()  # tunix.generate.utils.next_power_of_2
    else:
        padded = requested
    cache = ROLLOUT_KV_CACHE_SIZE if defaults else padded + new_tokens
    return TunixGeometry(requested, cache, padded)


class TunixSystem:
    """Our model's weights in Tunix's Qwen2, generating with Tunix's Sampler: the ``tunix`` /
    ``tunix-defaults`` system. One Sampler per cache size (a user keeps one per run; a new size
    is a new Sampler and new compiles)."""

    def __init__(self, model: Any, *, defaults: bool = False) -> None:
        self.tx = load_tunix()
        self.model = model
        self.defaults = defaults
        self.arch = arch(model)
        self.vocab = self.arch.vocab
        self.tmodel = to_tunix(model, self.tx)
        self._samplers: dict[tuple[int, int], Any] = {}

    def _sampler(self, cache_size: int, eos: int) -> Any:
        key = (cache_size, eos)
        if key not in self._samplers:
            a = self.arch
            cache = self.tx.sampler.CacheConfig(cache_size=cache_size, num_layers=a.n_layers,
                                                num_kv_heads=a.kv, head_dim=a.hd)
            self._samplers[key] = self.tx.sampler.Sampler(
                self.tmodel, _IdTokenizer(eos, self.vocab), cache)
        return self._samplers[key]

    def __call__(self, prompts: Sequence[np.ndarray], cfg: GenerationConfig) -> GenerationResult:
        rows = validate_prompts(prompts, self.vocab, cfg)
        limits = row_limits(cfg, len(rows))
        n = int(limits.max())
        geo = geometry([r.size for r in rows], n, defaults=self.defaults)
        pad = self.vocab  # outside the vocabulary: never sampled, so never masked by mistake
        eos = pad if cfg.eos_id is None else int(cfg.eos_id)
        sampler = self._sampler(geo.cache_size, eos)
        sampling = (dict(temperature=cfg.temperature, top_p=1.0, seed=cfg.seed)
                    if cfg.temperature > 0 else {})
        text = [" ".join(map(str, r.tolist())) for r in rows]
        with CompileCounter() as counter, _Quiet():
            t0 = time.perf_counter()
            out = sampler(text, max_generation_steps=n, max_prompt_length=geo.max_prompt_length,
                          echo=False, return_logprobs=True, eos_tokens=[eos], **sampling)
            seconds = time.perf_counter() - t0
        toks, lps = _trim(out, limits, cfg.eos_id)
        dev_peak = device_peak_bytes()  # before the accounting below allocates anything
        held, temp = _accounting(sampler, self.tmodel, len(rows), geo, n, cfg, sampling)
        stats = {"xla_compiles": counter.count, "compile_cache_hits": counter.cache_hits,
                 "compile_seconds": counter.seconds,
                 "run_seconds": seconds, "peak_bytes": dev_peak if dev_peak is not None
                 else held + temp, "accounted_bytes": held + temp, "prompt_len": geo.prompt_len,
                 "cache_size": geo.cache_size, "decode_steps": n, "tunix_version": self.tx.version}
        if cfg.return_logits:
            stats["logits"] = "not returned: Tunix 0.1.7's Qwen2 has no num_embed for its buffer"
        return GenerationResult(toks, lps, None, stats)


def _trim(out: Any, limits: np.ndarray, eos_id: int | None
          ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-row tokens (EOS included, as every other system reports) and log-probs, each row cut
    at its own limit. Tunix's rows end before the first EOS: a row shorter than the batch's
    decode steps stopped at an EOS."""
    n = int(limits.max())
    toks, lps = [], []
    for i, lim in enumerate(int(x) for x in limits):
        t = np.asarray(out.tokens[i], np.int32)
        lp = np.asarray(out.logprobs[i], np.float32)
        hit_eos = eos_id is not None and t.size < n
        t, lp = t[:lim], lp[:lim]
        if hit_eos and t.size < lim:
            t = np.append(t, np.int32(eos_id))
        toks.append(t)
        lps.append(lp)
    return toks, lps


def _accounting(sampler: Any, tmodel: Any, b: int, geo: TunixGeometry, n: int,
                cfg: GenerationConfig, sampling: dict[str, Any]) -> tuple[int, int]:
    """(bytes held, largest XLA temporary) for the CPU accounting every system reports: weights
    + Tunix's sampling state (token/position/log-prob buffers, KV cache of ``cache_size`` slots,
    donated in place between its two programs) and the larger of its prefill and decode
    executables' temporaries. Reads Tunix's two jitted functions (private attributes) after the
    measured call; the compiles this needs are not counted."""
    with _Quiet():
        return _measure(sampler, tmodel, b, geo, n, cfg, sampling)


def _measure(sampler: Any, tmodel: Any, b: int, geo: TunixGeometry, n: int,
             cfg: GenerationConfig, sampling: dict[str, Any]) -> tuple[int, int]:
    ids = jnp.full((b, geo.prompt_len), sampler.tokenizer.pad_id(), jnp.int32)
    # A concrete state (its static fields hold concrete arrays, so it cannot be abstract).
    state = sampler.init_sample_state(
        ids, total_sampling_steps=geo.prompt_len + n, include_logits=False,
        forbidden_token_ids=None, temperature=sampling.get("temperature", 0.0),
        top_p=sampling.get("top_p"), top_k=None, seed=jax.random.PRNGKey(cfg.seed),
        beam_size=None, include_logprobs=True)
    params = sampler._flattened_transformer_state
    prefill = sampler._compiled_prefill_fn.lower(params, state, None, echo=False).compile()
    after = jax.eval_shape(lambda p, s: sampler._prefill_fn(p, s, None, echo=False), params, state)
    decode = sampler._compiled_decode_fn.lower(params, after).compile()
    held = tree_bytes(nnx.state(tmodel)) + _abstract_bytes(after) + ids.nbytes
    return held, max(executable_temp_bytes(prefill), executable_temp_bytes(decode))


def _abstract_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "shape"))
