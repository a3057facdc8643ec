"""Partial rollouts (``jaxrl_sym.rl.step.partial``): the degenerate setting equals the plain step;
with it on, every sample finishes and is trained exactly once, carried tokens are a prefix of the
trained response and keep the behaviour policy's log-probs (checked against a plain forward of
the parameters that sampled them) — on sym, where one generation call stops itself, with a
Gemma-like zoo model, and on padded, which generates in segments, with a GPT-2-like one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from zoo import GemmaishConfig, GemmaishLM, GPT2Like, GPTConfig

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
from jaxrl_sym.rl.step.partial import PartialBuffer, PartialConfig
from jaxrl_sym.rl.step.state import params_sha256
from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE
from jaxrl_sym.runtime.options import EngineOptions

TASK = get_task("reverse", max_digits=2)
MODEL = preset("tiny", vocab_size=VOCAB_SIZE)
# beta 0: no reference pass, so the plain step and the partial one run the same stages;
# 8 new tokens: an untrained model rarely emits EOS, so rows differ in when they finish
CFG = RLConfig.of(algo="grpo", group_size=2, eos_id=EOS, max_new_tokens=8, lr=1e-2,
                  temperature=1.0, entropy_coef=0.01)  # the update always moves


def _trainer(partial: PartialConfig | None, model: object = None,
             system: str = "sym", engine: EngineOptions | None = None) -> RLTrainer:
    return RLTrainer(init_model(MODEL, 0) if model is None else model, TASK.reward, CFG,
                     metric_fn=TASK.exact_match, partial=partial, system=system, engine=engine)


def test_config_is_checked() -> None:
    with pytest.raises(InputError, match="--partial-rollout"):
        PartialConfig(0.0)
    with pytest.raises(InputError, match="--partial-segment"):
        PartialConfig(0.5, segment=0)
    with pytest.raises(InputError, match="--partial-max-carry"):
        PartialConfig(0.5, max_carry=True)


def test_fraction_one_in_one_segment_is_the_plain_step() -> None:
    """One trainer, its state restored between the two steps (so programs compile once)."""
    prompts = TASK.sample(np.random.default_rng(0), 3)
    tr = _trainer(None)
    start = tr.state.copy()  # the step's update consumes the trainer's own buffers
    start_sha = params_sha256(start.params)
    m0 = tr.step(prompts, seed=5)
    plain_sha = tr.params_sha256()
    assert "partial" not in m0 and tr.rollouts is None
    tr.commit(start)
    cfg = PartialConfig(1.0, segment=CFG.algorithm.max_new_tokens)
    tr.partial, tr.rollouts = cfg, PartialBuffer(cfg)
    m1 = tr.step(prompts, seed=5)
    assert tr.params_sha256() == plain_sha != start_sha
    assert m0["reward"] == m1["reward"] and m1["partial"]["segments"] == 1
    assert m1["partial"]["carried_rows"] == 0 and not tr.rollouts.rows


def _logprobs(model: object, prompt: np.ndarray, tokens: list[int]) -> np.ndarray:
    """Sampling log-probs of ``tokens`` after ``prompt`` by a plain forward (temperature 1)."""
    seq = np.concatenate([prompt, np.asarray(tokens, np.int32)])[None]
    pos = np.arange(seq.shape[1], dtype=np.int32)[None]
    logits = (model(jnp.asarray(seq), jnp.asarray(pos), jnp.zeros_like(pos))[0]
              / CFG.algorithm.temperature)
    lp = jax.nn.log_softmax(logits, axis=-1)
    n = len(prompt)
    return np.asarray([lp[n - 1 + i, t] for i, t in enumerate(tokens)])


@pytest.mark.parametrize("system", ["sym", "padded"])
def test_carried_rows_finish_once_with_behaviour_logprobs(system: str) -> None:
    if system == "sym":  # one call that stops itself: staggered limits, so rows end tiles apart
        model = GemmaishLM(GemmaishConfig(), rngs=nnx.Rngs(3))
        limits: list[int] | None = [3, 12, 30]
    else:  # segments of 2 tokens: the rule holds after the third, when the 6-token rows end
        model, limits = GPT2Like(GPTConfig(), rngs=nnx.Rngs(0)), [2, 6, 8]
    # a microbatch policy that splits rows by prompt length (carried rows' prompts are longer):
    # the stopping call must still decode every row in one loop
    engine = EngineOptions(max_pad_fraction=0.02)
    tr = _trainer(PartialConfig(0.5, segment=2, max_carry=1), model, system, engine)
    rng = np.random.default_rng(1)
    snapshots: dict[int, tuple[list[int], list[float]]] = {}
    trained: dict[int, np.ndarray] = {}
    added, carried_seen, k = 0, 0, 0
    while k < 2 or tr.rollouts.rows:
        prompts = TASK.sample(rng, 3) if k < 2 else []
        added += len(prompts) * CFG.algorithm.group_size
        behaviour = tr.model()  # the parameters that sample this step's new tokens
        m = tr.step(prompts, seed=100 + k, limits=limits if prompts else None)
        k += 1
        assert m["partial"]["max_staleness"] <= 1  # max_carry 1
        if system == "sym":
            assert m["partial"]["segments"] == 1  # stopped inside the one call, not segmented
            assert m["partial"]["decode_loops"] == 1  # carried rows decode beside new ones
        elif m["partial"]["carried_rows"]:
            assert m["partial"]["segments"] >= 1 and not m["partial"]["stopped_early"]
        for r in tr.rollouts.last_trained:
            assert r.uid not in trained  # trained exactly once
            trained[r.uid] = np.asarray(r.tokens)
            assert r.done and len(r.tokens) == len(r.logprobs)
            if r.uid in snapshots:  # carried: its earlier tokens and log-probs are kept
                toks, lps = snapshots.pop(r.uid)
                assert r.tokens[:len(toks)] == toks and r.logprobs[:len(lps)] == lps
        for r in tr.rollouts.rows:
            if not r.done and r.uid not in snapshots:
                carried_seen += 1
                snapshots[r.uid] = (list(r.tokens), list(r.logprobs))
                np.testing.assert_allclose(r.logprobs, _logprobs(behaviour, r.prompt, r.tokens),
                                           atol=2e-4)
        assert k < 8, "carried rows never finished"
    assert carried_seen > 0, "nothing was carried: the test would not test carrying"
    assert not snapshots and len(trained) == added
    with pytest.raises(InputError, match="no carried rows"):
        tr.step([], seed=1)


def test_train_refuses_a_bad_partial_config_before_any_work() -> None:
    from jaxrl_sym.rl.run.train import train

    with pytest.raises(InputError, match="--partial-rollout"):
        train("grpo", "reverse", steps=1, partial={"fraction": 1.5}, progress=False)
