"""Speculative decoding inside the RL step (``RLTrainer(speculation=...)``, ``--speculate``), on
models unlike DecoderLM, on sym and on the padded baseline (its fixed-k speculative decoding).

Oracle: the step's own first-epoch importance ratio. Its "old" log-probs are the ones the
rollout reported; its new ones come from the packed training forward of the same weights. A
speculative rollout whose log-probs were the draft's, or belonged to other tokens, would move
the ratio away from 1 — so ``ratio_min == ratio_max == 1`` (and ``kl_old == 0``) checks every
emitted token's log-prob against an independent forward. Rows must also end where the task's
EOS or the limit says, and the drafts must have been exercised (drafted and accepted > 0).
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from zoo import GemmaishConfig, GemmaishLM, GPT2Like, GPTConfig

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
from jaxrl_sym.rl.config import speculation_of, task_rl_config
from jaxrl_sym.rl.run.cli import main as train_main
from jaxrl_sym.rl.run.train import hparam_diffs, run_hparams
from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE
from jaxrl_sym.runtime.options import Speculation

TASK = get_task("reverse", max_digits=3)
CFG = RLConfig.of(algo="grpo", group_size=4, epochs=1, eos_id=EOS, lr=1e-2,
                  max_new_tokens=TASK.max_new_tokens)


def _models() -> dict[str, nnx.Module]:
    return {"gpt2": GPT2Like(GPTConfig(vocab=VOCAB_SIZE, n_layer=2), rngs=nnx.Rngs(0)),
            "gemmaish": GemmaishLM(GemmaishConfig(num_embed=VOCAB_SIZE), rngs=nnx.Rngs(0))}


@pytest.mark.parametrize(("name", "system", "adaptive"), [
    ("gpt2", "sym", False), ("gemmaish", "sym", True), ("gpt2", "padded", False)])
def test_speculative_rollouts_carry_the_policys_logprobs(name: str, system: str,
                                                         adaptive: bool) -> None:
    trainer = RLTrainer(_models()[name], TASK.reward, CFG, system=system,
                        speculation=Speculation(3, adaptive))
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
        assert len(resp) == (eos[0] + 1 if len(eos) else CFG.algorithm.max_new_tokens)


def test_speculation_is_refused_where_it_cannot_run() -> None:
    model = _models()["gpt2"]
    with pytest.raises(InputError, match=r"--speculate-adaptive.*system 'padded'"):
        RLTrainer(model, TASK.reward, CFG, system="padded", speculation=Speculation(2, True))
    with pytest.raises(InputError, match=r"speculation=3 \(--speculate\)"):
        RLTrainer(model, TASK.reward, CFG, speculation=3)
    with pytest.raises(InputError, match=r"speculate=-1 \(--speculate\)"):
        speculation_of(-1)
    with pytest.raises(InputError, match=r"--speculate-adaptive.*give --speculate K"):
        speculation_of(0, True)
    assert speculation_of(0) is None and speculation_of(2, True) == Speculation(2, True)


def test_former_rlconfig_fields_are_refused_naming_their_new_home() -> None:
    """Speculation and the engine's padding knob left RLConfig (the algorithm and optimiser):
    a caller's config naming them is told where they went."""
    for key, home in (("speculate", r"train\(speculate=K\)"),
                      ("speculate_adaptive", "--speculate-adaptive"),
                      ("gen_max_pad_fraction", r"EngineOptions\(max_pad_fraction")):
        with pytest.raises(InputError, match=rf"config\['{key}'\] is no longer.*{home}"):
            task_rl_config(10, 8, EOS, {key: 1})


def test_a_checkpoint_written_with_the_former_fields_still_resumes() -> None:
    """A resume compares the checkpoint's hyper-parameters with the run's: ``speculate`` and
    ``speculate_adaptive`` keep their keys (now the run's, not RLConfig's), so a changed value
    is still refused by its flag; ``gen_max_pad_fraction`` only the old checkpoint has, so it
    is not a difference (the engine's options decide grouping, not the sampled tokens)."""
    now = run_hparams(CFG, task="reverse", seed=0, speculate=0, speculate_adaptive=False)
    old = {**now, "gen_max_pad_fraction": 0.3}  # what RLConfig.to_dict() stored before
    assert hparam_diffs(old, now) == []
    assert hparam_diffs({**old, "speculate": 4}, now) == [("--speculate (speculate)", 4, 0)]


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
