"""Tunix's own Gemma 4 (``google-tunix`` 0.1.7, ``tunix.models.gemma4``) as the peer for window
and mixed attention: the Tunix model that keeps a *ring* KV cache.

Why a second Tunix peer: the ``tunix`` system (:mod:`jaxrl_sym.baselines.tunix`) runs our weights
in Tunix's Qwen2, which has full causal attention only. For a sliding window the fair opponent is
the Tunix model built for it: its Gemma 4 keeps ``sliding_window_size`` slots per local layer
(``use_sliding_window_kv_cache``, on by default) and writes them as a ring, so its decode cost per
step does not grow with the sequence — what sym's window store does.

**Speed at equal shape, not the same function.** Gemma 4's block is not our ``DecoderLM``'s:
it scales embeddings by √d, RMS-normalises queries, keys *and values* per head and does not
divide attention logits by √head_dim, wraps attention and MLP in sandwich norms (4 norms per
layer, plus a ``skip_scale``), and uses a GELU-gated MLP. Those norms cannot be made identities,
so our weights cannot be copied into it to compute our function. The model here is Gemma 4 with
its own random initialisation at our model's shape — layers, width, query/kv heads, head
dimension, FFN width, vocabulary, RoPE base, window, and each layer local (our ``Window``) or
global (our ``Causal``) — with Gemma 4's optional extras turned off so the work per token matches:
no per-layer input embeddings, no KV sharing between layers, no MoE, global layers with the same
head dimension, kv heads and full-width RoPE as the local ones, no final logit soft-cap. Its tokens
are therefore *not* comparable with ours; what is comparable is time and memory per token.

Generation is Tunix's own ``Sampler`` through its public call, exactly as for the Qwen2 peer
(:class:`~jaxrl_sym.baselines.tunix.TunixSystem`: id tokenizer, smallest cache the Sampler accepts
— the next power of two of the longest prompt + max new tokens; local layers then hold
``min(cache_size, window)`` ring slots, global layers ``cache_size`` slots).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from flax import nnx

from jaxrl_sym.baselines.tunix import TunixSystem, _IdTokenizer, _Quiet, load_tunix
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult

WEIGHTS_NOTE = ("Tunix Gemma 4 random init at the model's shape (its block is not DecoderLM's: "
                "tokens not comparable, speed at equal shape)")


def load_gemma4() -> Any:
    """Tunix's ``tunix.models.gemma4.model`` module (imported as :func:`load_tunix` imports its
    other modules: without Tunix's trainer stack)."""
    load_tunix()
    with _Quiet():
        return importlib.import_module("tunix.models.gemma4.model")


def layer_kinds(model: Any) -> tuple[tuple[bool, ...], int | None]:
    """(per layer: local?, the window) of our ``DecoderLM``, or :class:`InputError` naming what
    Gemma 4 cannot express (block/linear layers, windows of different sizes)."""
    from jaxrl_sym.models.lm import DecoderLM
    from jaxrl_sym.ops.attention import Causal, Window

    if not isinstance(model, DecoderLM):
        raise InputError(f"system 'tunix-gemma4' builds Tunix's Gemma 4 at the shape of a "
                         f"jaxrl_sym DecoderLM (--preset); got {type(model).__name__}")
    pats = model.cfg.layer_patterns()
    bad = sorted({type(p).__name__ for p in pats if not isinstance(p, Window | Causal)})
    if bad:
        raise InputError(f"system 'tunix-gemma4': Tunix's Gemma 4 has sliding-window and global "
                         f"layers only, the model has {', '.join(bad)} layers; use --attention "
                         "window or mixed")
    sizes = {p.size for p in pats if isinstance(p, Window)}
    if len(sizes) > 1:
        raise InputError(f"system 'tunix-gemma4': Gemma 4 has one sliding_window_size, the "
                         f"model's windows are {sorted(sizes)}; use one --window")
    if not sizes:
        raise InputError("system 'tunix-gemma4' is the ring-cache peer for window/mixed "
                         "attention; for --attention full use --systems tunix")
    return tuple(isinstance(p, Window) for p in pats), sizes.pop()


def gemma4_config(model: Any, g4: Any, *, ring: bool = True) -> Any:
    """Tunix's Gemma 4 ``ModelConfig`` at our model's shape, extras off (see the module
    docstring). ``ring=False``: Tunix's full-size cache with the window masked instead (the same
    function; the ring's oracle in the tests)."""
    local, window = layer_kinds(model)
    c = model.cfg
    kind = g4.AttentionType
    pattern = tuple(kind.LOCAL_SLIDING if is_local else kind.GLOBAL for is_local in local)
    theta = int(c.rope_theta)
    return g4.ModelConfig(
        num_layers=c.n_layers, num_embed=c.vocab_size, embed_dim=c.d_model, hidden_dim=c.ffn_dim,
        num_heads=c.n_heads, head_dim=c.head_dim, num_kv_heads=c.n_kv_heads,
        final_logit_softcap=None, sliding_window_size=window, per_layer_input_dim=0,
        num_global_kv_heads=None, global_key_size=c.head_dim, attention_pattern=pattern,
        frac_shared_layers=0.0, global_rope_proportion=1.0, local_rope_proportion=1.0,
        local_base_frequency=theta, global_base_frequency=theta,
        use_sliding_window_kv_cache=ring, dtype=c.dtype, param_dtype=c.dtype)


def build_gemma4(model: Any, seed: int = 0, *, ring: bool = True) -> Any:
    """Tunix's Gemma 4 at ``model``'s shape with Tunix's own random initialisation (the same
    weights for the same seed, ring or not)."""
    g4 = load_gemma4()
    cfg = gemma4_config(model, g4, ring=ring)
    with _Quiet():
        return g4.Gemma4(cfg, rngs=nnx.Rngs(seed))


class TunixGemma4System(TunixSystem):
    """Tunix's Gemma 4 (ring cache) at our model's shape, generating with Tunix's Sampler: the
    ``tunix-gemma4`` system. Request handling, trimming and accounting are the Qwen2 peer's;
    only the model differs, and no logits or token check against ours make sense."""

    def __init__(self, model: Any, *, seed: int = 0, ring: bool = True) -> None:
        # Not TunixSystem.__init__: that one copies our weights into Qwen2 (full attention only).
        self.tx = load_tunix()
        self.model = model
        self.defaults = False
        self.vocab = model.cfg.vocab_size
        self.tmodel = build_gemma4(model, seed, ring=ring)
        self._samplers: dict[tuple[int, int], Any] = {}

    def _sampler(self, cache_size: int, eos: int) -> Any:
        """One Sampler per (cache size, EOS). Gemma 4 has ``init_cache`` (ring slots in local
        layers), so ``CacheConfig``'s layer/head fields are only required, not used."""
        key = (cache_size, eos)
        if key not in self._samplers:
            c = self.model.cfg
            cache = self.tx.sampler.CacheConfig(cache_size=cache_size, num_layers=c.n_layers,
                                                num_kv_heads=c.n_kv_heads, head_dim=c.head_dim)
            with _Quiet():
                self._samplers[key] = self.tx.sampler.Sampler(
                    self.tmodel, _IdTokenizer(eos, self.vocab), cache)
        return self._samplers[key]

    def __call__(self, prompts: Sequence[Any], cfg: GenerationConfig) -> GenerationResult:
        out = super().__call__(prompts, cfg)
        out.stats["weights"] = WEIGHTS_NOTE
        out.stats["ring_slots"] = ring_slots(self.tmodel, out.stats["cache_size"])
        return out


def ring_slots(tmodel: Any, cache_size: int) -> list[int]:
    """KV slots Tunix's Gemma 4 allocates per layer for a Sampler of ``cache_size``: the ring
    (``min(cache_size, window)``) in local layers, ``cache_size`` in global ones."""
    cache = tmodel.init_cache(1, cache_size, tmodel.config.dtype)  # batch 1: a few KB
    return [int(cache[f"layer_{i}"]["k"].shape[1]) for i in range(len(tmodel.layers))]
