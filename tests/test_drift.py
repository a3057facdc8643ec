"""The collapse check of checkpoint runs (:class:`GreedyDrift`), on hand-made responses, and on
a real run whose learning rate wrecks the model in one step.

Oracle for the unit part: bigram counts written out by hand. For the run: a tiny pretrained
chat model (the committed ChatML Qwen2 fixture) updated at lr 1 with an entropy bonus must be
flagged within three steps, and a run at the pretrained recipe's rate must not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxrl_sym.rl.run.progress import GreedyDrift, distinct2
from jaxrl_sym.rl.run.train import train

MODEL = Path(__file__).parent / "fixtures" / "text" / "chatml_qwen2"


def test_distinct_bigrams_by_hand() -> None:
    assert distinct2([1, 2, 3, 4]) == 1.0  # 3 bigrams, all distinct
    assert distinct2([5, 5, 5, 5, 5]) == 0.25  # 4 bigrams, one distinct
    assert distinct2([1, 2, 1, 2, 1]) == 0.5  # (1,2), (2,1) twice each
    assert distinct2([7]) == 1.0 and distinct2([]) == 1.0


def test_a_policy_that_starts_repeating_itself_is_flagged() -> None:
    d = GreedyDrift([[1, 2, 3, 4, 5, 6], [9, 8, 7, 6]])  # distinct: 1.0 at the start
    assert d.due(1) and not d.due(2) and d.due(25)
    assert d.check(1, {"kl": None}, [[1, 2, 3, 9, 9, 8], [9, 8, 7, 6]]) is None
    msg = d.check(1, {"kl": None}, [[3, 3, 3, 3, 3, 3], [4, 4, 4, 4]])
    # (1/5 + 1/3) / 2 = 0.27: each loop keeps one distinct bigram of its 5 and 3
    assert msg is not None and msg.startswith("policy collapse") and "1.00 -> 0.27" in msg
    # a model that repeated itself from the start has not *collapsed* at step 1
    assert GreedyDrift([[3, 3, 3, 3]]).check(1, {}, [[3, 3, 3, 3]]) is None


def test_a_kl_jump_in_the_first_steps_is_flagged() -> None:
    d = GreedyDrift([[1, 2, 3]])
    assert d.check(2, {"kl": 0.02}, None) is None
    assert d.check(2, {"kl": 3.0}, None).startswith("KL jump")
    assert d.check(40, {"kl": 3.0}, None) is None  # later, a far policy may be the point


@pytest.mark.parametrize(("lr", "flagged"), [(1.0, True), (1e-6, False)])
def test_a_wrecking_first_step_is_caught_on_a_pretrained_model(tmp_path: Path, lr: float,
                                                               flagged: bool) -> None:
    tasks = tmp_path / "sums.jsonl"
    tasks.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?", "answer": a + b}) + "\n"
                             for a, b in [(3, 4), (12, 5), (7, 7), (20, 1)]))
    out = train("grpo", f"jsonl:{tasks}", 3, model_dir=str(MODEL), prompts_per_step=2,
                group_size=2, config={"max_new_tokens": 12, "lr": lr, "entropy_coef": 0.5},
                beta=0.04, progress=False, eval_prompts=0, seed=3)
    # the drift checks' flags (a random model's rewards may also all be 0: a stall, not drift)
    flags = [m["health"] for m in out["history"]
             if m["health"] and not m["health"].startswith("no learning signal")]
    assert bool(flags) == flagged, flags
