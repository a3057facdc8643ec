"""The training loop: reward rises, metrics are logged, checkpoints resume bit-exactly."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from jaxrl_sym.cli import main as cli_main
from jaxrl_sym.errors import InputError
from jaxrl_sym.rl import CheckpointError
from jaxrl_sym.rl.run.cli import add_train_parser
from jaxrl_sym.rl.run.train import train

# Small enough that three runs (uninterrupted, interrupted, resumed) compile and run in seconds.
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, ffn_dim=64)
RUN = dict(prompts_per_step=4, group_size=4, model=TINY, max_digits=2, progress=False)
STAGES = ("generation", "reference", "reward", "update")


def test_every_step_logs_finite_metrics(tmp_path) -> None:
    """One metrics line per step with the stage timings and finite signals. (That the reward
    rises is tests/test_learning.py's job: 100 steps against a bar the old recipe misses.)"""
    path = tmp_path / "m.jsonl"
    out = train("grpo", "reverse", steps=3, seed=0, metrics_file=str(path), eval_prompts=0,
                **RUN)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] == [m["step"] for m in out["history"]]
    for m in lines:
        for key in ("reward", "exact_match", "useful_tokens_per_s", "padding_fraction",
                    "peak_bytes", "entropy", "grad_norm"):
            assert np.isfinite(m[key]), key
        assert m["kl"] is None  # beta = 0: no reference pass, no KL to report
        assert all(m["seconds"][s] >= 0 for s in STAGES)
    assert lines[0]["entropy"] > 0 and lines[0]["grad_norm"] > 0


def test_interrupted_run_resumes_to_the_same_parameters(tmp_path) -> None:
    full = train("grpo", "reverse", steps=5, seed=7, checkpoint_dir=str(tmp_path / "a"),
                 checkpoint_every=2, **RUN)

    def interrupt(m: dict) -> None:
        if m["step"] == 3:  # after the checkpoint of step 2, before the one of step 4
            raise KeyboardInterrupt

    ckpt, log = str(tmp_path / "b"), tmp_path / "b.jsonl"
    with pytest.raises(KeyboardInterrupt):
        train("grpo", "reverse", steps=5, seed=7, checkpoint_dir=ckpt, checkpoint_every=2,
              metrics_file=str(log), on_step=interrupt, **RUN)
    assert len(log.read_text().splitlines()) == 3
    # a new run must not silently continue (or overwrite) the old one
    with pytest.raises(InputError, match=r"already holds a checkpoint of step 2.*resume=True"):
        train("grpo", "reverse", steps=5, seed=7, checkpoint_dir=ckpt, **RUN)
    resumed = train("grpo", "reverse", steps=5, seed=7, checkpoint_dir=ckpt, checkpoint_every=2,
                    metrics_file=str(log), resume=True, **RUN)
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 5
    assert len(resumed["history"]) == 3
    assert resumed["params_sha256"] == full["params_sha256"]
    assert resumed["final_exact_match"] == full["final_exact_match"]  # greedy: params only
    # the log holds every step once: step 3's line from the interrupted run was replaced
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3, 4, 5]
    # a finished run resumed again does nothing and reports the same digest
    again = train("grpo", "reverse", steps=5, seed=7, checkpoint_dir=ckpt, resume=True, **RUN)
    assert again["history"] == [] and again["params_sha256"] == full["params_sha256"]

    # a checkpoint of another model is refused before any step runs, naming the difference
    other = {**RUN, "model": {**TINY, "d_model": 48}}
    with pytest.raises(CheckpointError, match=r"different run.*model\.d_model: checkpoint 32 vs "
                                              r"this run 48"):
        train("grpo", "reverse", steps=6, seed=7, checkpoint_dir=ckpt, resume=True, **other)
    with pytest.raises(CheckpointError, match="algo: checkpoint 'grpo' vs this run 'rloo'"):
        train("rloo", "reverse", steps=6, seed=7, checkpoint_dir=ckpt, resume=True, **RUN)


def test_ppo_and_rloo_steps_run_through_the_same_loop() -> None:
    for algo, extra in (("ppo", {"epochs": 2}), ("rloo", {"beta": 0.05})):
        out = train(algo, "sort", steps=2, seed=1, **RUN, **extra)
        assert out["steps"] == 2
        for m in out["history"]:
            assert np.isfinite(m["loss"])
        if algo == "ppo":
            assert all("v_loss" in m for m in out["history"])
        else:
            assert out["history"][-1]["seconds"]["reference"] > 0
            assert all(np.isfinite(m["kl"]) and m["kl"] >= 0 for m in out["history"])


def test_unknown_task_and_bad_arguments() -> None:
    with pytest.raises(InputError, match="unknown task 'parity'"):
        train("grpo", "parity", steps=1, progress=False)
    with pytest.raises(InputError, match="algo='sac'"):
        train("sac", "reverse", steps=1, progress=False)


def test_cli_parser() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd")
    add_train_parser(sub)
    a = p.parse_args(["train", "--algo", "rloo", "--task", "sort", "--steps", "3",
                      "--checkpoint-dir", "/tmp/x", "--checkpoint-every", "1", "--beta", "0.1",
                      "--resume", "--metrics", "m.jsonl", "--json"])
    assert (a.algo, a.task, a.steps, a.checkpoint_every, a.beta) == ("rloo", "sort", 3, 1, 0.1)
    assert a.resume and a.json and a.metrics == "m.jsonl"


def test_cli_train_json_metrics_and_plot(tmp_path, capsys) -> None:
    metrics = tmp_path / "run.jsonl"
    args = ["train", "--steps", "2", "--prompts", "4", "--group", "4", "--max-digits", "2",
            "--eval-prompts", "8", "--metrics", str(metrics), "--json", "--no-progress"]
    assert cli_main(args) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(last["params_sha256"]) == 64 and 0.0 <= last["final_exact_match"] <= 1.0
    assert last["steps"] == 2 and (tmp_path / "run.png").stat().st_size > 10_000
    assert len(metrics.read_text().splitlines()) == 2
    # bad input: one clear line on stderr and exit code 2, no traceback
    assert cli_main(["train", "--task", "parity", "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error: --task parity: unknown task 'parity'" in err and "Traceback" not in err


def test_progress_line_shows_the_mean_step_time_and_what_is_left(capsys) -> None:
    """Under pytest stderr is no terminal: one plain line per step (what a log file keeps)."""
    from jaxrl_sym.rl.run.progress import Bar

    with Bar(True, total=6, done=1, title="t") as bar:  # resumed after step 1
        for sec in (3.0, 1.0):  # a compile-heavy first step, then a fast one
            bar.advance({"reward": 0.5, "seconds": {"total": sec}, "health": None})
        bar.advance({"reward": 0.0, "seconds": {"total": 2.0}, "health": "no learning signal"})
        bar.stage("generation", None, 0)  # step 5's stages, as the step runs them
        bar.stage("generation", 2.5, 500)
        bar.stage("pack", 0.01, 0)  # too short for a line of its own
    lines = capsys.readouterr().err.splitlines()
    assert lines[3] == "t step 5/6: generation 2.5 s, 200 tokens/s" and len(lines) == 4
    lines = lines[:3]
    assert lines[0] == "t step 2/6: reward 0.500  3.00s/step (mean of 1), ~12s left"
    assert lines[1] == "t step 3/6: reward 0.500  2.00s/step (mean of 2), ~6s left"  # 3 x 2 s
    assert lines[2].endswith("~4s left  NO LEARNING SIGNAL")


def test_health_flags_entropy_collapse_with_flat_reward_and_non_finite() -> None:
    from jaxrl_sym.rl.run.progress import RunHealth

    h = RunHealth()
    flags = [h.check({"reward": 0.46, "entropy": 0.02, "loss": 0.0, "grad_norm": 0.1})
             for _ in range(RunHealth.window)]
    assert flags[:-1] == [None] * (RunHealth.window - 1)  # needs a full window first
    assert flags[-1].startswith("entropy collapse: entropy 0.020 < 0.05, reward flat")
    # low entropy while the reward still climbs is learning, not a stall
    h = RunHealth()
    rising = [h.check({"reward": 0.3 + 0.01 * i, "entropy": 0.02, "loss": 0.0,
                       "grad_norm": 0.1}) for i in range(RunHealth.window)]
    assert rising == [None] * RunHealth.window
    assert RunHealth().check({"reward": 0.1, "entropy": float("nan"), "loss": 1.0,
                              "grad_norm": float("inf")}) == \
        "diverged: non-finite entropy, grad_norm"


def test_a_diverging_run_stops_and_says_so(tmp_path, capsys) -> None:
    from jaxrl_sym.rl.run.progress import Bar
    from jaxrl_sym.rl.step.stages import DivergedError

    # an absurd learning rate overflows the weights on the first update; the next update's
    # loss is non-finite, is not applied, and the run stops naming the step
    with pytest.raises(DivergedError, match=r"non-finite .* step 2; the step was not applied") \
            as e:
        train("grpo", "reverse", steps=4, seed=0, lr=1e38, eval_prompts=0,
              config={"max_grad_norm": None}, **RUN)
    assert e.value.step == 2
    capsys.readouterr()
    with Bar(True, total=4, done=0, title="t") as bar:  # stderr is no terminal: plain lines
        bar.alert(f"DIVERGED at step {e.value.step}: {e.value}")
        bar.advance({"reward": 0.4, "entropy": 0.01, "seconds": {"total": 1.0},
                     "health": "entropy collapse: entropy 0.010 < 0.05"})
    alert, step = capsys.readouterr().err.splitlines()
    assert alert.startswith("t: DIVERGED at step 2: non-finite")
    assert step.startswith("t step 1/4: reward 0.400") and step.endswith(
        "ENTROPY COLLAPSE: ENTROPY 0.010 < 0.05")


def test_resume_takes_changed_execution_settings_and_refuses_the_rest(tmp_path, caplog) -> None:
    """``--update-tokens`` (and the other execution knobs) decide how a step is computed, not
    what (their equivalence: test_remat, test_rl_step): a run that ran out of memory resumes
    with a smaller one and is told what changed; an algorithm knob (``--epochs``) is still
    refused."""
    import logging

    from jaxrl_sym.rl.run.train import ResumeMismatchError

    ckpt = str(tmp_path / "b")
    train("grpo", "reverse", steps=2, seed=5, checkpoint_dir=ckpt, eval_prompts=0, **RUN)
    small = {"update_tokens": 16, "logprob_chunk": 8, "remat": False}
    with caplog.at_level(logging.WARNING):
        resumed = train("grpo", "reverse", steps=3, seed=5, checkpoint_dir=ckpt, resume=True,
                        eval_prompts=0, config=small, **RUN)
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 3
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "with changed execution settings: " in said
    assert "--update-tokens (update_tokens): checkpoint None, given 16" in said
    assert "--logprob-chunk (logprob_chunk): checkpoint 256, given 8" in said
    assert {c["flag"] for c in resumed["changed_on_resume"]} == {
        "--update-tokens (update_tokens)", "--logprob-chunk (logprob_chunk)",
        "--remat/--no-remat (remat)"}
    with pytest.raises(ResumeMismatchError, match=r"--epochs \(epochs\): checkpoint 1, given 2"):
        train("grpo", "reverse", steps=6, seed=5, checkpoint_dir=ckpt, resume=True,
              eval_prompts=0, epochs=2, **RUN)


def test_health_flags_steps_without_a_learning_signal() -> None:
    """Three steps in a row where every group's rewards were identical (or the gradient was
    exactly 0) is a run that cannot learn: flagged from the third on, cleared by a step with a
    signal; PPO (a critic) is not flagged for identical group rewards."""
    from jaxrl_sym.rl.run.progress import RunHealth

    flat = {"reward": 0.0, "entropy": 1.0, "loss": 0.0, "grad_norm": 0.3, "zero_var_frac": 1.0}
    h = RunHealth("grpo")
    flags = [h.check(flat) for _ in range(4)]
    assert flags[:2] == [None, None]
    assert flags[2].startswith("no learning signal: for 3 steps in a row every group's rewards "
                               "were identical (reward 0.000)") and flags[3] is not None
    assert h.check({**flat, "zero_var_frac": 0.5}) is None  # a signal: the count restarts
    assert h.check(flat) is None
    zero = {**flat, "zero_var_frac": 0.0, "grad_norm": 0.0}
    h = RunHealth("grpo")
    assert [h.check(zero) for _ in range(3)][-1].endswith(
        "raise --group or --temperature") and "gradient was exactly 0" in h.check(zero)
    h = RunHealth("ppo")
    assert [h.check(flat) for _ in range(5)] == [None] * 5
