"""Speculative decoding inside the RL step (``RLConfig.speculate``), on models unlike DecoderLM.

Oracle: the step's own first-epoch importance ratio. Its "old" log-probs are the ones the
rollout reported; its new ones come from the packed training forward of the same weights. A
speculative rollout whose log-probs were the draft's, or belonged to other tokens, would move
the ratio away from 1 — so ``ratio_min == ratio_max == 1`` (and ``kl_old == 0``) checks every
emitted token's log-prob against an independent forward. Rows must also end where the task's
EOS or the limit says, and the drafts must have been exercised (drafted and accepted > 0).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from flax import nnx
from zoo import GemmaishConfig, GemmaishLM, GPT2Like, GPTConfig

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
from jaxrl_sym.rl.cli import main as train_main
from jaxrl_sym.rl.tasks import EOS, VOCAB_SIZE

TASK = get_task("reverse", max_digits=3)
CFG = RLConfig(algo="grpo", group_size=4, epochs=1, eos_id=EOS, lr=1e-2,
               max_new_tokens=TASK.max_new_tokens, speculate=3)


def _models() -> dict[str, nnx.Module]:
    return {"gpt2": GPT2Like(GPTConfig(vocab=VOCAB_SIZE, n_layer=2), rngs=nnx.Rngs(0)),
            "gemmaish": GemmaishLM(GemmaishConfig(num_embed=VOCAB_SIZE), rngs=nnx.Rngs(0))}


@pytest.mark.parametrize(("name", "adaptive"), [("gpt2", False), ("gemmaish", True)])
def test_speculative_rollouts_carry_the_policys_logprobs(name: str, adaptive: bool) -> None:
    trainer = RLTrainer(_models()[name], TASK.reward, replace(CFG, speculate_adaptive=adaptive))
    for step in range(2):  # the second step decodes with updated weights (set_params)
        m = trainer.step(TASK.sample(np.random.default_rng(step), 4), seed=10 + step)
        assert m["ratio_min"] == pytest.approx(1.0, abs=1e-4)
        assert m["ratio_max"] == pytest.approx(1.0, abs=1e-4)
        assert abs(m["kl_old"]) < 1e-5
        assert m["drafted_tokens"] > 0 and m["accepted_tokens"] > 0
        assert 0.0 < m["acceptance_rate"] <= 1.0
        assert np.isfinite(m["loss"])
    rollout = trainer.generate(TASK.sample(np.random.default_rng(5), 3), seed=3)
    for resp in rollout.responses:  # each row stops at its first EOS or at the limit
        eos = np.flatnonzero(resp == EOS)
        assert len(resp) == (eos[0] + 1 if len(eos) else CFG.max_new_tokens)


def test_speculation_is_refused_where_it_cannot_run() -> None:
    model = _models()["gpt2"]
    with pytest.raises(InputError, match=r"--speculate.*system 'padded'"):
        RLTrainer(model, TASK.reward, CFG, system="padded")
    with pytest.raises(InputError, match=r"speculate=-1 \(--speculate\)"):
        replace(CFG, speculate=-1)


def test_train_cli_reports_acceptance(tmp_path, capsys) -> None:
    metrics = tmp_path / "m.jsonl"
    assert train_main(["train", "--task", "reverse", "--max-digits", "2", "--steps", "1",
                       "--prompts", "2", "--group", "2", "--speculate", "2",
                       "--eval-prompts", "4", "--metrics", str(metrics), "--no-progress",
                       "--json"]) == 0
    import json

    row = json.loads(metrics.read_text().splitlines()[0])
    assert row["drafted_tokens"] > 0 and 0.0 <= row["acceptance_rate"] <= 1.0
    capsys.readouterr()
