"""``jaxrl-sym train --model DIR`` on a text task: checkpoints that resume bit-identically and
know their source model, so they export back to a Hugging Face directory.

The tiny transformers-made Qwen2 of ``tests/fixtures/text/chatml_qwen2`` (byte-level BPE, ChatML
template, two EOS ids) is fine-tuned on a JSONL file of short problems for 5 steps, once straight
through (via the CLI) and once interrupted after step 3 and resumed (via the API); both must end
with the same ``params_sha256``. The checkpoint then exports to a directory our loader reads
back into exactly the trained policy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_sym.cli import main
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf import load_pretrained
from jaxrl_sym.rl.run.export import export_checkpoint, restore_policy
from jaxrl_sym.rl.run.train import ResumeMismatchError, train

# every train() here rebuilds the same tiny trainer: its programs are compiled once per session
pytestmark = pytest.mark.share_compiles
MODEL = Path(__file__).parent / "fixtures" / "text" / "chatml_qwen2"
STEPS = 5
RUN = dict(prompts_per_step=2, group_size=2, config={"max_new_tokens": 6}, progress=False,
           eval_prompts=0, seed=3)
# Short problems keep the run to a few shapes (template word problems are 150-300 tokens each
# with this tokenizer: every step would compile new shapes on a CPU).
PROBLEMS = [{"prompt": f"What is {a} + {b}?", "answer": a + b} for a, b in
            [(3, 4), (12, 5), (7, 7), (20, 1), (9, 30), (2, 2)]]


@pytest.fixture
def task(tmp_path: Path) -> str:
    f = tmp_path / "sums.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return f"jsonl:{f}"


def forward(model, prompt: list[int]) -> np.ndarray:
    toks = jnp.asarray([prompt], jnp.int32)
    pos = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    return np.asarray(model(toks, pos, jnp.zeros_like(pos)))[0]


def test_text_task_needs_a_model_and_a_model_needs_a_text_task(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"--task word-problems is a text task: it needs --model"):
        train("grpo", "word-problems", 1, progress=False)
    with pytest.raises(InputError, match=r"--task reverse is a token task .* word-problems"):
        train("grpo", "reverse", 1, model_dir=str(MODEL), progress=False)
    with pytest.raises(InputError, match=r"--model .*: not a Hugging Face checkpoint"):
        train("grpo", "word-problems", 1, model_dir=str(tmp_path), progress=False)


@pytest.mark.slow
def test_train_resume_identical_and_export(tmp_path: Path, task: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    straight = tmp_path / "straight"
    rc = main(["train", "--model", str(MODEL), "--task", task, "--steps", str(STEPS),
               "--prompts", "2", "--group", "2", "--max-new-tokens", "6", "--seed", "3",
               "--checkpoint-dir", str(straight), "--eval-prompts", "0", "--no-progress",
               "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    want = json.loads(out.out.strip().splitlines()[-1])["params_sha256"]

    cut = tmp_path / "cut"
    first = train("grpo", task, 3, checkpoint_dir=str(cut), model_dir=str(MODEL),
                  **RUN)
    assert first["params_sha256"] != want
    resumed = train("grpo", task, STEPS, checkpoint_dir=str(cut), resume=True,
                    model_dir=str(MODEL), **RUN)
    assert resumed["resumed_from"] == 3 and resumed["params_sha256"] == want

    # the checkpoint knows its source model: another directory is a changed setting
    other = tmp_path / "same_weights_elsewhere"
    shutil.copytree(MODEL, other)
    with pytest.raises(ResumeMismatchError, match=r"model_dir"):
        train("grpo", task, STEPS + 1, checkpoint_dir=str(cut), resume=True,
              model_dir=str(other), **RUN)

    policy, meta = restore_policy(cut)
    assert meta["step"] == STEPS and meta["hparams"]["model_dir"] == str(MODEL.resolve())
    files, info = export_checkpoint(cut, tmp_path / "exported")
    assert info == {"source_model": str(MODEL.resolve()), "step": STEPS, "params_sha256": want}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            "generation_config.json"} <= set(files)
    again, _, _ = load_pretrained(tmp_path / "exported")
    source, _, _ = load_pretrained(MODEL)
    prompt = [54, 286, 265, 67, 85, 295]
    assert np.array_equal(forward(again, prompt), forward(policy, prompt))  # exactly the policy
    assert not np.array_equal(forward(again, prompt), forward(source, prompt))  # it trained
    assert json.loads((tmp_path / "exported" / "config.json").read_text()) == json.loads(
        (MODEL / "config.json").read_text())

    rc = main(["export", "--checkpoint-dir", str(straight), "--out", str(tmp_path / "cli"),
               "--dtype", "bfloat16", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    rep = json.loads(out.out.strip().splitlines()[-1])
    assert rep["step"] == STEPS and rep["params_sha256"] == want
    cast, _, _ = load_pretrained(tmp_path / "cli")
    assert cast.model.embed_tokens.embedding[...].dtype == jnp.bfloat16

    # destructive overlaps are refused by resolved path before anything is written (issue 29):
    # --out as the run itself, inside it, or holding it; the run is left as it was
    before = sorted(p.relative_to(straight) for p in straight.rglob("*"))
    for out_dir, how in ((straight, "is"), (straight / "x", "lies inside"),
                         (tmp_path / "cli" / ".." / "straight", "is"), (tmp_path, "holds")):
        rc = main(["export", "--checkpoint-dir", str(straight), "--out", str(out_dir),
                   "--overwrite"])
        err = capsys.readouterr().err
        assert rc == 2 and f"{how} --checkpoint-dir" in err, err
    assert sorted(p.relative_to(straight) for p in straight.rglob("*")) == before


def test_export_refuses_checkpoints_without_a_source_model(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    train("grpo", "reverse", 1, checkpoint_dir=str(tmp_path / "ck"), prompts_per_step=2,
          group_size=2, progress=False, eval_prompts=0)
    with pytest.raises(InputError, match=r"records no model_dir"):
        export_checkpoint(tmp_path / "ck", tmp_path / "out")
    rc = main(["export", "--checkpoint-dir", str(tmp_path / "empty"), "--out",
               str(tmp_path / "out")])
    assert rc == 2 and "no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    rc = main(["export", "--checkpoint-dir", str(tmp_path / "empty"), "--out",
               str(tmp_path / "out")])
    assert rc == 2 and "holds no checkpoint" in capsys.readouterr().err


def test_token_task_rewards_decoded_responses() -> None:
    """Word problems through the checkpoint's chat template; the reward decodes the response
    and scores it against the answer of that prompt (not another one's)."""
    from jaxrl_sym.models.hf.text import HFText
    from jaxrl_sym.rl.run.pretrained import setup

    run = setup(str(MODEL), "word-problems", max_new_tokens=32)
    text = HFText(MODEL)
    assert run.eos_id == text.eos_ids()[0] and run.rl_config(False)["max_new_tokens"] == 32
    assert run.hparams["model_dir"] == str(MODEL.resolve()) and run.hparams["chat_template"]
    rng = np.random.default_rng(0)
    problems = run.task.task.sample(np.random.default_rng(0), 3)
    prompts = run.task.sample(rng, 3)
    for p, ids in zip(problems, prompts, strict=True):
        assert ids.tolist() == text.encode_chat([{"role": "user", "content": p.prompt}])
        right = text.encode(f"so #### {p.answer}<|im_end|>")
        wrong = text.encode(f"so #### {p.answer + 1}")
        assert run.task.reward(ids, right) == 1.0 and run.task.exact_match(ids, right) == 1.0
        assert run.task.reward(ids, wrong) == 0.0  # the format pays only with the answer
        bare = text.encode(f"so it is {p.answer}")
        assert run.task.reward(ids, bare) == pytest.approx(0.8)
    with pytest.raises(InputError, match=r"did not sample last"):
        run.task.reward(np.asarray([1, 2, 3]), np.asarray([4]))
