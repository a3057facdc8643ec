"""RLConfig by concern (issue 48 item 5): its three parts, the flags generated from their fields,
checkpoints written before the split, and ``--resume`` taking a changed execution or optimiser
knob.

What each part means decides the resume rule: the algorithm defines the run (a change is
refused), the execution knobs only how a step is computed and the optimiser's hyper-parameters
how the gradient becomes an update (a change is taken and reported) — but the optimiser's rule,
whose state the checkpoint holds, is refused. A checkpoint written while the knobs were one flat
dataclass records them flat; it must still resume and compare knob by knob.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.config import (
    FIELD_GROUP,
    GROUPS,
    AlgorithmConfig,
    ExecutionConfig,
    OptimizerConfig,
    RLConfig,
    nest_hparams,
)
from jaxrl_sym.rl.run.config_flags import knobs_of
from jaxrl_sym.rl.run.identity import flat_hparams, hparam_diffs, run_hparams

TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, ffn_dim=64)
RUN = dict(prompts_per_step=4, group_size=4, model=TINY, max_digits=2, progress=False,
           eval_prompts=0)
# the hyper-parameters a checkpoint recorded before RLConfig was split: every knob flat, beside
# the run's own keys (and a field since removed, which only the old side knows)
OLD_FLAT: dict[str, Any] = {
    "task": "reverse", "seed": 5, "max_digits": 2, "system": "sym", "prompts_per_step": 4,
    "partial_weight": 0.5, "partial": None, "speculate": 0, "speculate_adaptive": False,
    "algo": "grpo", "group_size": 4, "temperature": 1.0, "max_new_tokens": 6, "eos_id": 12,
    "lr": 0.001, "optimizer": "adam", "weight_decay": 0.0, "max_grad_norm": 1.0,
    "clip_eps": 0.2, "clip_eps_high": None, "pg_loss": "ppo_clip", "beta": 0.0, "epochs": 1,
    "loss_agg": "seq_mean", "adv_norm": "none", "adv_eps": 1e-06, "drop_zero_var": False,
    "entropy_coef": 0.01, "warmup_steps": 0, "lr_schedule": "constant", "total_steps": None,
    "min_lr_ratio": 0.0, "gamma": 1.0, "lam": 0.95, "vf_coef": 0.5, "vf_clip": 0.2,
    "pack_row_len": None, "share_prompts": True, "overlap_reference": None,
    "update_tokens": None, "logprob_chunk": 256, "remat": True, "tis_cap": None,
    "gen_max_pad_fraction": 0.3, "precision": "fp32", "lora": None,
}


def test_each_knob_lives_in_one_part() -> None:
    """``RLConfig.of`` puts each knob into its part; the parts are what the code takes."""
    cfg = RLConfig.of(algo="ppo", group_size=1, lr=2e-3, optimizer="adamw", weight_decay=0.1,
                      update_tokens=64, remat=False)
    assert cfg.algorithm == AlgorithmConfig(algo="ppo", group_size=1)
    assert cfg.optim == OptimizerConfig(lr=2e-3, optimizer="adamw", weight_decay=0.1)
    assert cfg.execution == ExecutionConfig(update_tokens=64, remat=False)
    assert cfg.replace(update_tokens=None).execution == ExecutionConfig(remat=False)
    assert cfg.replace(beta=0.1).algorithm.beta == 0.1 and cfg.algorithm.beta == 0.0
    assert set(cfg.to_dict()) == set(GROUPS) == {"algorithm", "optim", "execution"}
    assert set(cfg.knobs()) == set(FIELD_GROUP) and len(FIELD_GROUP) == 34
    assert RLConfig.of(**cfg.knobs()) == cfg
    with pytest.raises(InputError, match=r"config\['update_token'\] is not a knob .*"
                                         r"did you mean 'update_tokens'"):
        RLConfig.of(update_token=4)
    with pytest.raises(InputError, match=r"config\['speculate'\] is no longer"):
        RLConfig.of(speculate=2)
    with pytest.raises(InputError, match=r"RLConfig.optim=.*expected the OptimizerConfig part"):
        RLConfig(optim=AlgorithmConfig())  # type: ignore[arg-type]
    # each part checks its own knobs, naming the field and its flag
    with pytest.raises(InputError, match=r"ExecutionConfig.update_tokens=0 \(--update-tokens\)"):
        ExecutionConfig(update_tokens=0)
    with pytest.raises(InputError, match=r"OptimizerConfig.max_grad_norm=-1.0 "
                                         r"\(--max-grad-norm\) must be finite and >= 0"):
        OptimizerConfig(max_grad_norm=-1.0)
    with pytest.raises(InputError, match=r"AlgorithmConfig.group_size=1 \(--group\) grpo"):
        AlgorithmConfig(group_size=1)


def test_an_old_flat_record_maps_onto_the_parts() -> None:
    """A checkpoint's flat hyper-parameters: each knob moves into its part, the run's keys (and
    a removed field) stay; it compares equal to a new run's record of the same settings, and a
    changed knob is told apart by its part."""
    nested = nest_hparams(OLD_FLAT)
    knobs = {k: v for k, v in OLD_FLAT.items() if k in FIELD_GROUP}
    assert {g: nested[g] for g in GROUPS} == RLConfig.of(**knobs).to_dict()
    assert nested["task"] == "reverse" and nested["gen_max_pad_fraction"] == 0.3
    assert not set(nested) & set(FIELD_GROUP)
    assert nest_hparams(nested) == nested  # a new record is already by part
    run = {k: v for k, v in OLD_FLAT.items()
           if k not in FIELD_GROUP and k != "gen_max_pad_fraction"}
    new = run_hparams(RLConfig.of(**knobs), **run)
    assert set(new["execution"]) == {"update_tokens", "logprob_chunk", "remat",
                                     "overlap_reference", "pack_row_len", "share_prompts"}
    assert hparam_diffs(OLD_FLAT, new) == []
    assert flat_hparams(new) == {k: v for k, v in OLD_FLAT.items() if k != "gen_max_pad_fraction"}
    bigger = run_hparams(RLConfig.of(**{**knobs, "update_tokens": 16, "lr": 0.002}), **run)
    assert hparam_diffs(OLD_FLAT, bigger, rule="run") == []
    assert hparam_diffs(OLD_FLAT, bigger, rule="optim") == [("--lr (lr)", 0.001, 0.002)]
    assert hparam_diffs(OLD_FLAT, bigger, rule="execution") == [
        ("--update-tokens (update_tokens)", None, 16)]
    other = run_hparams(RLConfig.of(**{**knobs, "optimizer": "sgd", "beta": 0.1}), **run)
    assert hparam_diffs(OLD_FLAT, other, rule="state") == [
        ("--optimizer (optimizer)", "adam", "sgd")]
    assert hparam_diffs(OLD_FLAT, other, rule="run") == [("--beta (beta)", 0.0, 0.1)]


def _train_args(*flags: str) -> argparse.Namespace:
    from jaxrl_sym.rl.run.cli import add_train_parser

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["train", *flags])


def test_the_generated_flags_set_the_knobs() -> None:
    """One flag per knob, typed from the field; ``none`` for a knob that may be None; a flag
    not given is not a knob given (the recipe's, then the field's, apply)."""
    assert knobs_of(_train_args()) == {}
    given = knobs_of(_train_args("--max-grad-norm", "none", "--update-tokens", "64",
                                 "--no-remat", "--group", "3", "--clip-low", "0.1",
                                 "--pack-row-len", "128", "--total-steps", "9",
                                 "--lr-schedule", "cosine", "--no-overlap-reference"))
    assert given == {"max_grad_norm": None, "update_tokens": 64, "remat": False,
                     "group_size": 3, "clip_eps": 0.1, "pack_row_len": 128, "total_steps": 9,
                     "lr_schedule": "cosine", "overlap_reference": False}
    cfg = RLConfig.of(**given)
    assert cfg.optim.max_grad_norm is None and cfg.execution.update_tokens == 64
    for bad in (("--logprob-chunk", "x"), ("--optimizer", "rmsprop"), ("--gamma", "none")):
        with pytest.raises(SystemExit):
            _train_args(*bad)


def test_none_round_trips_through_a_config_file(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from jaxrl_sym.cli import main

    assert main(["train", "--max-grad-norm", "none", "--logprob-chunk", "512",
                 "--print-config"]) == 0
    text = capsys.readouterr().out
    assert 'max-grad-norm = "none"' in text and "logprob-chunk = 512" in text
    (tmp_path / "run.toml").write_text(text)
    from jaxrl_sym.cli import _parser
    from jaxrl_sym.rl.run.config_file import with_config

    p = _parser(with_train=True)
    args = p.parse_args(["train", *with_config(p.commands["train"],
                                               ["--config", str(tmp_path / "run.toml")])])
    assert knobs_of(args) == {"max_grad_norm": None, "logprob_chunk": 512}


def test_resume_with_a_changed_update_tokens_continues(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's done-when, from the command line: ``--resume --update-tokens N`` continues
    the run, saying what changed; a changed algorithm knob is still refused."""
    from jaxrl_sym.cli import main

    d = str(tmp_path / "ck")
    base = ["train", "--prompts", "2", "--group", "2", "--max-digits", "1", "--eval-prompts",
            "0", "--no-progress", "--checkpoint-dir", d]
    assert main([*base, "--steps", "1"]) == 0
    capsys.readouterr()
    assert main([*base, "--steps", "2", "--resume", "--update-tokens", "16", "--json"]) == 0
    out = capsys.readouterr()
    assert ("with changed execution settings: --update-tokens (update_tokens): checkpoint "
            "None, given 16") in out.err
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert summary["resumed_from"] == 1 and summary["steps"] == 2
    assert summary["changed_on_resume"] == [
        {"flag": "--update-tokens (update_tokens)", "checkpoint": None, "given": 16}]
    assert main([*base, "--steps", "3", "--resume", "--update-tokens", "16",
                 "--entropy-coef", "0.05"]) == 2
    assert ("--entropy-coef (entropy_coef): checkpoint 0.01, given 0.05"
            in capsys.readouterr().err)


def test_a_checkpoint_with_flat_hparams_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint written with the knobs flat (as before the split) resumes: the same settings
    continue silently, a changed execution knob with a warning, a changed algorithm knob is
    refused naming its flag."""
    from jaxrl_sym.rl.run import train as train_module
    from jaxrl_sym.rl.run.checkpoint import Checkpointer
    from jaxrl_sym.rl.run.identity import ResumeMismatchError, hparams_of

    d = str(tmp_path / "old")
    with monkeypatch.context() as m:  # record as the library did before the split
        m.setattr(train_module, "hparams_of", lambda *a: flat_hparams(hparams_of(*a)))
        train_module.train("grpo", "reverse", steps=1, seed=5, checkpoint_dir=d, **RUN)
    ck = Checkpointer(d, create=False)
    saved = ck._read_meta(ck.latest_step())["hparams"]
    assert saved["lr"] == 0.001 and "algorithm" not in saved  # flat, as an old checkpoint
    with pytest.raises(ResumeMismatchError, match=r"--entropy-coef \(entropy_coef\): "
                                                  r"checkpoint 0.01, given 0.05"):
        train_module.train("grpo", "reverse", steps=2, seed=5, checkpoint_dir=d, resume=True,
                           config={"entropy_coef": 0.05}, **RUN)
    with caplog.at_level(logging.WARNING):
        out = train_module.train("grpo", "reverse", steps=2, seed=5, checkpoint_dir=d,
                                 resume=True, config={"logprob_chunk": 8}, **RUN)
    assert out["resumed_from"] == 1 and out["steps"] == 2
    assert [c["flag"] for c in out["changed_on_resume"]] == ["--logprob-chunk (logprob_chunk)"]
    assert "changed execution settings" in caplog.text


def _params(directory: Path, step: int) -> list[np.ndarray]:
    """The policy's arrays a checkpoint holds at ``step`` (host arrays, in tree order)."""
    import jax
    from etils import epath

    from jaxrl_sym.rl.run.checkpoint import read_params

    tree = read_params(epath.Path(directory) / str(step) / "state")
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


def test_resume_with_a_changed_lr_continues_at_the_new_rate(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--resume --lr``: the optimiser's rate is tuned as a run goes, so the run continues,
    warns naming ``--lr``, records the change in the lineage, and the resumed step's update
    uses the new rate (the restored optimiser state does not bring the old one back).

    Oracle: two resumes of the same checkpoint, one at its rate (1e-3) and one at 3e-3, start
    from identical parameters and optimiser state and sample the same rows (each step's prompts
    and samples depend on (seed, step) only), so they take the same gradient; Adam's update
    ``lr * m_hat / (sqrt(v_hat) + eps)`` is linear in the rate (the moments do not depend on
    it), so the resumed step moves every parameter 3x as far. Then a changed ``--optimizer`` is
    refused, with ``--resume-anyway`` too, naming the flag and the state, and nothing moved."""
    from jaxrl_sym.cli import main
    from jaxrl_sym.rl.run.checkpoint import Checkpointer

    base = ["train", "--prompts", "2", "--group", "2", "--max-digits", "1", "--eval-prompts",
            "0", "--no-progress"]
    first, same, faster = (tmp_path / n for n in ("first", "same", "faster"))
    assert main([*base, "--steps", "1", "--checkpoint-dir", str(first)]) == 0
    shutil.copytree(first, same)
    shutil.copytree(first, faster)
    capsys.readouterr()
    assert main([*base, "--steps", "2", "--checkpoint-dir", str(same), "--resume"]) == 0
    assert "changed" not in capsys.readouterr().err
    metrics = tmp_path / "faster.jsonl"
    assert main([*base, "--steps", "2", "--checkpoint-dir", str(faster), "--resume", "--lr",
                 "0.003", "--json", "--metrics", str(metrics)]) == 0
    out = capsys.readouterr()
    assert ("with changed optimiser settings: --lr (lr): checkpoint 0.001, given 0.003 (they "
            "apply from this step on") in out.err
    change = {"flag": "--lr (lr)", "checkpoint": 0.001, "given": 0.003}
    assert json.loads(out.out.strip().splitlines()[-1])["changed_on_resume"] == [change]
    meta = Checkpointer(faster, create=False)._read_meta(2)
    assert meta["lineage"] == [{"step": 1, "optim": [["--lr (lr)", 0.001, 0.003]]}]
    assert meta["hparams"]["optim"]["lr"] == 0.003
    last = json.loads(metrics.read_text().strip().splitlines()[-1])
    assert last["step"] == 2 and last["lr"] == pytest.approx(0.003, rel=1e-6)

    start, slow, fast = _params(first, 1), _params(same, 2), _params(faster, 2)
    d_slow = np.concatenate([(b - a).ravel() for a, b in zip(start, slow, strict=True)])
    d_fast = np.concatenate([(b - a).ravel() for a, b in zip(start, fast, strict=True)])
    assert np.linalg.norm(d_slow) > 1e-3  # the step moved the policy: the oracle is not vacuous
    np.testing.assert_allclose(d_fast, 3 * d_slow, rtol=1e-3, atol=1e-6)

    for anyway in ([], ["--resume-anyway"]):
        assert main([*base, "--steps", "3", "--checkpoint-dir", str(faster), "--resume",
                     "--lr", "0.003", "--optimizer", "adamw", *anyway]) == 2
        err = capsys.readouterr().err
        assert "--optimizer (optimizer): checkpoint 'adam', given 'adamw'" in err, err
        assert "optimiser state is its rule's" in err and "--resume-anyway cannot" in err
    assert sorted(p.name for p in faster.iterdir() if not p.name.startswith(".")) == ["1", "2"]


def test_a_restore_keeps_the_configs_weight_decay(tmp_path: Path) -> None:
    """The optimiser state holds its plain hyper-parameters (``weight_decay``), which optax reads
    back from the state at every update: a restore must put the resuming config's there, not
    bring the checkpoint's back, while the moments and counts stay the checkpoint's."""
    import jax

    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLTrainer
    from jaxrl_sym.rl.run.checkpoint import Checkpointer, fingerprint
    from jaxrl_sym.rl.tasks.token_tasks import get_task

    def trainer(wd: float) -> RLTrainer:
        cfg = RLConfig.of(group_size=2, optimizer="adamw", weight_decay=wd)
        return RLTrainer(init_model(preset("tiny"), 0), get_task("reverse").reward, cfg,
                         system="padded")

    saved, resumed = trainer(0.1), trainer(0.5)
    moved = jax.tree_util.tree_map(lambda x: x + 1, saved.opt_state.inner_state)
    saved.opt_state = saved.opt_state._replace(inner_state=moved)  # moments the fresh lack
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, saved, {"fingerprint": fingerprint(saved), "hparams": {}})
    ck.restore(resumed, fingerprint(resumed))
    hp = resumed.opt_state.hyperparams
    assert float(hp["weight_decay"]) == 0.5
    assert float(hp["learning_rate"]) == float(saved.opt_state.hyperparams["learning_rate"])
    for a, b in zip(jax.tree_util.tree_leaves(resumed.opt_state.inner_state),
                    jax.tree_util.tree_leaves(moved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
