"""Tunix (``google-tunix`` 0.1.7), the JAX RL fine-tuning library users would pick instead of us,
as a peer generation system on the same weights.

Why a peer and not another baseline written by us: the padded baseline is our reading of how JAX
RL stacks generate; Tunix *is* one. Our :class:`~jaxrl_sym.models.lm.DecoderLM`'s weights are
copied into Tunix's own Qwen2 (``tunix.models.qwen2.model.Qwen2``: RMSNorm, RoPE, GQA, SwiGLU,
tied head — the same function; its q/k/v biases are set to zero because ours has none) and Tunix's
own ``Sampler`` generates, called through its public ``__call__`` as a user would:

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
from jaxrl_sym.systems import PEER_INSTALL as INSTALL_HINT

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
    """Import Tunix's Qwen2 model and Sampler modules, or raise :class:`PeerMissingError` naming
    the extra to install.

    Why not ``import tunix``: its ``__init__`` imports the trainer stack, whose dependencies the
    light install leaves out. The package is registered without running its ``__init__`` (its
    submodules import as usual); a later ``import tunix`` in this process gets that bare package.
    """
    if not tunix_available():
        raise PeerMissingError(f"system 'tunix' needs the google-tunix package: {INSTALL_HINT}")
    if "tunix" not in sys.modules:
        spec = importlib.util.find_spec("tunix")
        assert spec is not None
        sys.modules["tunix"] = importlib.util.module_from_spec(spec)
    try:
        with _Quiet():
            qwen2 = importlib.import_module("tunix.models.qwen2.model")
            sampler = importlib.import_module("tunix.generate.sampler")
    except ImportError as err:
        raise PeerMissingError(f"system 'tunix': importing Tunix failed ({err}); {INSTALL_HINT}") \
            from err
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


def _lm_config(model: Any) -> Any:
    """Our model's LMConfig, after checking Tunix's Qwen2 can compute the same function."""
    from jaxrl_sym.models.lm import DecoderLM
    from jaxrl_sym.ops.attention import Causal

    if not isinstance(model, DecoderLM):
        raise InputError(f"system 'tunix' runs jaxrl_sym.models.lm.DecoderLM weights in Tunix's "
                         f"Qwen2; got {type(model).__name__} (use --preset, not --model)")
    bad = sorted({type(p).__name__ for p in model.cfg.layer_patterns() if p != Causal()})
    if bad:
        raise InputError(f"system 'tunix': Tunix's Qwen2 has full causal attention only, the model "
                         f"has {', '.join(bad)} layers; use --attention full")
    return model.cfg


def tunix_config(model: Any, tx: Tunix) -> Any:
    """Tunix's ``qwen2.ModelConfig`` for our DecoderLM (tied head, our dtype)."""
    c = _lm_config(model)
    return tx.qwen2.ModelConfig(
        num_layers=c.n_layers, vocab_size=c.vocab_size, embed_dim=c.d_model,
        hidden_dim=c.ffn_dim, num_heads=c.n_heads, head_dim=c.head_dim,
        num_kv_heads=c.n_kv_heads, rope_theta=c.rope_theta, norm_eps=c.norm_eps,
        use_tied_embedding=True, dtype=c.dtype, param_dtype=c.dtype)


def _pairs(model: Any, tm: Any) -> list[tuple[nnx.Variable, nnx.Variable, tuple[int, ...]]]:
    """(our variable, Tunix's variable, Tunix's shape) for every weight: the one mapping both
    directions of the conversion use."""
    c = model.cfg
    d, h, kv, hd = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    out = [(model.embed.embedding, tm.embedder.input_embedding, (c.vocab_size, d)),
           (model.final_norm.scale, tm.final_norm.w, (d,))]
    for ours, theirs in zip(model.layers, tm.layers, strict=True):
        a, ta = ours.attn, theirs.attn
        out += [(ours.attn_norm.scale, theirs.input_layernorm.w, (d,)),
                (a.q_proj.kernel, ta.q_proj.w, (d, h, hd)),
                (a.k_proj.kernel, ta.k_proj.w, (d, kv, hd)),
                (a.v_proj.kernel, ta.v_proj.w, (d, kv, hd)),
                (a.o_proj.kernel, ta.o_proj.w, (h, hd, d)),
                (ours.mlp_norm.scale, theirs.post_attention_layernorm.w, (d,)),
                (ours.mlp.gate.kernel, theirs.mlp.gate_proj.kernel, (d, c.ffn_dim)),
                (ours.mlp.up.kernel, theirs.mlp.up_proj.kernel, (d, c.ffn_dim)),
                (ours.mlp.down.kernel, theirs.mlp.down_proj.kernel, (c.ffn_dim, d))]
    return out


def to_tunix(model: Any, tx: Tunix | None = None) -> Any:
    """Tunix's Qwen2 holding ``model``'s weights (reshaped to its einsum layouts; q/k/v biases
    zero). Built under ``nnx.eval_shape``, so Tunix's random initialisation never runs."""
    tx = tx or load_tunix()
    cfg = tunix_config(model, tx)
    with _Quiet():
        tm = nnx.eval_shape(lambda: tx.qwen2.Qwen2(cfg, rngs=nnx.Rngs(0)))
    for ours, theirs, shape in _pairs(model, tm):
        theirs.set_value(jnp.asarray(ours.get_value()).reshape(shape))
    for layer in tm.layers:
        for bias in (layer.attn.q_bias, layer.attn.k_bias, layer.attn.v_bias):
            bias.set_value(jnp.zeros(bias.shape, cfg.param_dtype))
    return tm


def from_tunix(tm: Any, like: Any) -> Any:
    """Our DecoderLM (configured as ``like``) holding Tunix Qwen2 ``tm``'s weights; refuses
    non-zero q/k/v biases (our model has none). The inverse of :func:`to_tunix`."""
    from jaxrl_sym.models.lm import DecoderLM

    cfg = _lm_config(like)
    model = nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0)))
    for i, layer in enumerate(tm.layers):
        for name in ("q_bias", "k_bias", "v_bias"):
            if np.any(np.asarray(getattr(layer.attn, name).get_value())):
                raise InputError(f"Tunix layer {i} has a non-zero {name}; DecoderLM has no bias")
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
        self.vocab = int(_lm_config(model).vocab_size)
        self.tmodel = to_tunix(model, self.tx)
        self._samplers: dict[tuple[int, int], Any] = {}

    def _sampler(self, cache_size: int, eos: int) -> Any:
        key = (cache_size, eos)
        if key not in self._samplers:
            c = self.model.cfg
            cache = self.tx.sampler.CacheConfig(cache_size=cache_size, num_layers=c.n_layers,
                                                num_kv_heads=c.n_kv_heads, head_dim=c.head_dim)
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
