"""Chunked log-probs (``RLConfig.logprob_chunk``) against the whole-logits computation.

Oracle: the same programs built with ``logprob_chunk=None`` (the head applied to every slot at
once, as before chunking existed). Chunked and unchunked must agree within 1e-5 on reference
log-probs, value estimates, the loss, every aux term and every gradient — for chunk sizes that
do and do not divide the slot count — on DecoderLM and on Gemma 3 (untied head *and* final
soft-cap), through the sym system (traced features) and the padded one. A model without the
``features``/``head`` split falls back to whole logits and says so.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hf_models import FIXTURES
from zoo import GPT2Like, GPTConfig

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.contract import check_features
from jaxrl_sym.models.hf import load_pretrained
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer
from jaxrl_sym.rl.algorithms.losses import loss_from_terms, slot_terms
from jaxrl_sym.rl.step.logprobs import chunked_terms
from jaxrl_sym.rl.step.programs import build_fns
from jaxrl_sym.systems.forward import SplitForward

TOL = 1e-5
CFG = RLConfig.of(algo="ppo", group_size=1, beta=0.1, entropy_coef=0.01, temperature=0.8)


def _arrays(rng: np.random.Generator, shape: tuple[int, ...], targets: Any) -> dict[str, Any]:
    """Loss arrays of one layout: random advantages, old/ref log-probs, returns, weights."""
    mask = rng.random(shape) < 0.7
    f = lambda lo, hi: jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)
    return {"targets": jnp.asarray(targets, jnp.int32), "mask": jnp.asarray(mask),
            "weight": jnp.asarray(mask / max(mask.sum(), 1), jnp.float32),
            "old_lp": f(-5, -0.1), "ref_lp": f(-5, -0.1), "adv": f(-1, 1),
            "returns": f(-1, 1), "old_values": f(-1, 1)}


def _close(a: Any, b: Any) -> None:
    """Every leaf within 1e-5 of the oracle's, relative to that leaf's largest magnitude (a
    gradient entry of 3e4 carries fp32 rounding of the summation order well above 1e-5)."""
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        y = np.asarray(y)
        scale = max(1.0, float(np.max(np.abs(y)))) if y.size else 1.0
        np.testing.assert_allclose(np.asarray(x), y, atol=TOL * scale, rtol=TOL)


@settings(max_examples=4, deadline=None)
@given(rows=st.integers(1, 4), length=st.integers(1, 9), chunk=st.integers(1, 40),
       softcap=st.booleans(), seed=st.integers(0, 2**16))
def test_chunked_terms_match_whole_logits(rows: int, length: int, chunk: int, softcap: bool,
                                          seed: int) -> None:
    """A linear head (optionally soft-capped) on random features: per-slot terms, loss, aux and
    gradients (head weight, value head, features) equal the whole-logits loss."""
    rng = np.random.default_rng(seed)
    vocab, dim = 11, 5
    head = lambda leaves, f: (lambda z: 3.0 * jnp.tanh(z / 3.0) if softcap else z)(
        f @ leaves[0])
    fwd = SplitForward(logits=lambda leaves, inp: head(leaves, inp[0]),
                       features=lambda leaves, inp: inp[0], head=head, head_leaves=frozenset({0}))
    w = jnp.asarray(rng.normal(size=(dim, vocab)), jnp.float32)
    value = {"w": jnp.asarray(rng.normal(size=(vocab,)), jnp.float32), "b": jnp.float32(0.3)}
    feats = jnp.asarray(rng.normal(size=(rows, length, dim)), jnp.float32)
    arrays = _arrays(rng, (rows, length), rng.integers(0, vocab, (rows, length)))

    def chunked(w, value, feats):
        terms = chunked_terms(fwd, [w], (feats,), arrays["targets"], CFG.algorithm.temperature,
                              chunk, value_head=value)
        return loss_from_terms(terms, arrays, CFG.algorithm), terms

    def whole(w, value, feats):
        terms = slot_terms(head([w], feats), arrays["targets"], CFG.algorithm.temperature, value)
        return loss_from_terms(terms, arrays, CFG.algorithm), terms

    @jax.jit
    def both(w, value, feats):  # one compile per example
        grad = lambda f: jax.value_and_grad(lambda *a: f(*a)[0], argnums=(0, 1, 2),
                                            has_aux=True)(w, value, feats)
        return (grad(chunked), chunked(w, value, feats)[1]), (grad(whole),
                                                             whole(w, value, feats)[1])

    got, want = both(w, value, feats)
    _close(got, want)


def _decoder() -> nnx.Module:
    return init_model(preset("tiny"), 3)


def _gemma3() -> nnx.Module:
    return load_pretrained(FIXTURES / "gemma3_local_global", dtype="float32")[0]


def _programs(model: nnx.Module, system: str, chunks: tuple[int, ...]
              ) -> tuple[RLTrainer, list[dict[str, Any]]]:
    """One trainer, and its programs built unchunked and for each chunk size (same forward)."""
    tr = RLTrainer(model, lambda p, r: 0.0, CFG, system=system)
    fwd = tr.forwards.bound(tr.system).logits_fn()
    assert isinstance(fwd, SplitForward)
    cfgs = [CFG.replace(logprob_chunk=None)] + [CFG.replace(logprob_chunk=c) for c in chunks]
    return tr, [build_fns(c, tr.tx, fwd) for c in cfgs]


@pytest.mark.parametrize(("make", "system", "chunks"), [
    # one packed row of 64 slots: 37 per chunk does not divide it, 16 does
    (_decoder, "sym", (37,)),
    (_decoder, "padded", (9,)),  # 3 rows x 13 slots: 3 positions per chunk, the last one short
    (_gemma3, "sym", (16,)),  # untied lm_head and final soft-cap
])
def test_programs_chunked_equal_unchunked(make, system: str, chunks: tuple[int, ...]) -> None:
    """Reference log-probs, value estimates, loss + aux and gradients of the step's own
    programs: chunked == unchunked within 1e-5."""
    model = make()
    tr, fns = _programs(model, system, chunks)
    rng = np.random.default_rng(0)
    vocab = tr.vocab_size
    prompts = [rng.integers(1, vocab, n).astype(np.int32) for n in (3, 6, 2)]
    responses = [rng.integers(1, vocab, n).astype(np.int32) for n in (5, 2, 7)]
    lay = tr.system.layout(prompts, responses, row_len=None)
    params = {**tr.params, "value": {"w": jnp.asarray(rng.normal(size=vocab), jnp.float32),
                                     "b": jnp.float32(0.1)}}
    arrays = _arrays(rng, lay.shape, lay.targets)
    inputs = tuple(jnp.asarray(x) for x in lay.inputs)
    want = None
    for f in fns:
        got = (f["ref"](params["lm"], inputs, arrays["targets"]), f["values"](params, None, inputs),
               f["grad"](params, None, inputs, arrays))
        if want is None:
            want = got
        else:
            _close(got, want)
    assert fns[0]["logprob_chunking"] == "off: ExecutionConfig.logprob_chunk=None"
    assert fns[1]["logprob_chunking"] == f"on: {chunks[0]} token slots per chunk"


def test_model_without_split_falls_back_and_says_so() -> None:
    """GPT2Like (tests/zoo.py) has no features/head: the step runs on whole logits and its
    programs report why, instead of silently ignoring ``logprob_chunk``."""
    model = GPT2Like(GPTConfig(), rngs=nnx.Rngs(0))
    assert check_features(model) == "GPT2Like has no features/head"
    tr = RLTrainer(model, lambda p, r: 0.0, CFG.replace(algo="grpo", group_size=2),
                   system="padded")
    assert tr.fns("padded")["logprob_chunking"] == "off: GPT2Like has no features/head"


def test_inconsistent_split_is_an_input_error() -> None:
    """A model whose head(features) disagrees with __call__ is broken, not silently unchunked."""

    class Bad(nnx.Module):
        def __init__(self) -> None:
            self.lm = init_model(preset("tiny"), 0)

        def __call__(self, t, p, s):
            return self.lm(t, p, s)

        def features(self, t, p, s):
            return self.lm.features(t, p, s)

        def head(self, f):
            return self.lm.head(f)[..., :-1]

    with pytest.raises(InputError, match="head"):
        check_features(Bad())
    with pytest.raises(InputError, match="logprob_chunk"):
        RLConfig.of(logprob_chunk=0)
