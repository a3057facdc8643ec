"""Fault injection on checkpoints and resume: nothing silent, nothing lost.

Each test damages a copy of one finished tiny run (4 steps, checkpoints at steps 2 and 4, β > 0 so
the reference weights are saved too) the way a crash, a bad disk or a user would, and asserts the
outcome: a damaged step is detected, named in a warning and skipped for the newest good one (and
the run then ends where an uninterrupted run ends), or a clear error before any work — and never
garbage loaded, nothing good destroyed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_sym.cli import main as cli_main
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
from jaxrl_sym.rl.config import CheckpointConfig
from jaxrl_sym.rl.run.checkpoint import (
    Checkpointer,
    NoGoodCheckpointError,
    NonFiniteStateError,
    fingerprint,
    tree_sha256,
)
from jaxrl_sym.rl.run.cli import add_train_parser
from jaxrl_sym.rl.run.run_files import LOCK_FILE, open_checkpoints
from jaxrl_sym.rl.run.train import (
    TASK_MODEL,
    TASK_RECIPE,
    ResumeMismatchError,
    train,
)
from jaxrl_sym.rl.tasks.token_tasks import EOS

# every train() here rebuilds the same tiny trainer: its programs are compiled once per session
pytestmark = pytest.mark.share_compiles
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, ffn_dim=64)
RUN: dict[str, Any] = dict(prompts_per_step=4, group_size=4, beta=0.04, model=TINY,
                           max_digits=2, progress=False, eval_prompts=0)
SEED, STEPS, EVERY = 7, 4, 2


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """An uninterrupted run: its checkpoint directory (steps 2 and 4) and final digest."""
    d = tmp_path_factory.mktemp("finished") / "run"
    out = train("grpo", "reverse", steps=STEPS, seed=SEED, checkpoint_dir=str(d),
                checkpoint_every=EVERY, **RUN)
    assert steps_in(d) == ["2", "4"]
    return d, out["params_sha256"]


@pytest.fixture(scope="module")
def trainer() -> RLTrainer:
    """A trainer built as ``train`` builds it for RUN (same fingerprint), without tracing."""
    task = get_task("reverse", max_digits=RUN["max_digits"])
    cfg = RLConfig.of(algo="grpo", group_size=RUN["group_size"], beta=RUN["beta"],
                      max_new_tokens=task.max_new_tokens, eos_id=EOS, **TASK_RECIPE)  # lr 1e-3
    model = init_model(preset("tiny", **{**TASK_MODEL, **TINY}), SEED)
    return RLTrainer(model, task.reward, cfg, system="padded")


def steps_in(d: Path) -> list[str]:
    """The checkpoint directory's entries but the run lock (a dot-file that stays)."""
    return sorted(n for n in os.listdir(d) if n != LOCK_FILE)


def copy_run(finished: tuple[Path, str], dst: Path) -> Path:
    shutil.copytree(finished[0], dst)
    return dst


def files_of(step_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())


def array_files(step_dir: Path) -> list[Path]:
    """The files holding array data (orbax's OCDBT data files)."""
    return sorted(p for p in (step_dir / "state").rglob("*")
                  if p.is_file() and p.parent.name == "d")


def damage(path: Path, how: str) -> None:
    """2,000 random bytes in the middle (size kept), cut to half, or removed."""
    size = path.stat().st_size
    if how == "random":
        n = min(2000, size)
        with open(path, "r+b") as f:
            f.seek((size - n) // 2)
            f.write(np.random.default_rng(0).bytes(n))
    elif how == "truncate":
        os.truncate(path, size // 2)
    else:
        path.unlink()


def warnings_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


# --------------------------------------------------------------------------- corrupted arrays


def test_random_bytes_in_newest_arrays_fall_back_and_end_like_an_uninterrupted_run(
        finished: tuple[Path, str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = copy_run(finished, tmp_path / "run")
    for p in array_files(d / "4"):
        damage(p, "random")
    with caplog.at_level(logging.WARNING):
        out = train("grpo", "reverse", steps=STEPS, seed=SEED, checkpoint_dir=str(d),
                    checkpoint_every=EVERY, resume=True, **RUN)
    assert out["resumed_from"] == 2 and [s["step"] for s in out["skipped_checkpoints"]] == [4]
    said = warnings_text(caplog)
    assert f"{d}/4 is unusable and was skipped" in said and "resuming from step 2" in said
    assert out["params_sha256"] == finished[1]  # replayed 3..4 exactly
    # the damaged step was kept aside for inspection, and step 4 was written again — verified
    assert steps_in(d) == ["2", "4", "4.corrupt"]
    again = train("grpo", "reverse", steps=STEPS, seed=SEED, checkpoint_dir=str(d),
                  resume=True, **RUN)
    assert again["resumed_from"] == 4 and again["skipped_checkpoints"] == []
    assert again["params_sha256"] == finished[1]


def restored_step(finished: tuple[Path, str], trainer: RLTrainer, d: Path, rel: str,
                  how: str) -> int:
    """Damage one file of step 4 in a copy, restore, and return the step that was loaded —
    after checking that what was loaded is exactly what that step saved (never garbage) and
    that a rejected step 4 was moved aside so the resumed run can write it again."""
    copy_run(finished, d)
    damage(d / "4" / rel, how)
    ck = Checkpointer(d, create=False)
    meta = ck.restore(trainer, fingerprint(trainer))
    assert trainer.params_sha256() == meta["digests"]["params"], rel
    assert tree_sha256(jax.tree_util.tree_leaves(trainer.opt_state)) == \
        meta["digests"]["opt_state"], rel
    assert tree_sha256(trainer.ref_leaves) == meta["digests"]["ref"], rel
    if meta["step"] == 2:
        assert [s for s, _ in ck.skipped] == [4] and (d / "4.corrupt").is_dir(), rel
        assert ck.steps() == [2], rel
    else:
        assert meta["step"] == 4 and ck.skipped == [], rel
    return int(meta["step"])


@pytest.fixture(scope="module")
def used_files(finished: tuple[Path, str], trainer: RLTrainer,
               tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The files of step 4 a restore reads: deleting any one of them makes step 4 unusable.
    (OCDBT leaves superseded tree nodes and a per-process manifest that nothing reads.)"""
    base = tmp_path_factory.mktemp("used")
    return {rel for i, rel in enumerate(files_of(finished[0] / "4"))
            if restored_step(finished, trainer, base / f"c{i}", rel, "delete") == 2}


def test_deleting_any_file_that_is_read_is_caught(finished: tuple[Path, str],
                                                  used_files: set[str]) -> None:
    step4 = finished[0] / "4"
    largest = max(array_files(step4), key=lambda p: p.stat().st_size)
    assert {"meta/metadata", str(largest.relative_to(step4))} <= used_files


@pytest.mark.parametrize("how", ["random", "truncate"])
def test_random_bytes_or_truncation_in_any_file_is_caught_or_provably_unused(
        finished: tuple[Path, str], trainer: RLTrainer, used_files: set[str], tmp_path: Path,
        how: str) -> None:
    """Every file of the newest step, damaged alone: restore rejects step 4 and loads step 2, or
    the bytes damaged were not read and step 4 loads with verified digests — never garbage
    (``restored_step`` checks both). The metadata and the array data are caught.

    Why not "every file a restore reads is caught": an OCDBT data file holds tree nodes and
    array chunks, and a restore reads byte ranges of it, not all of it. Whether the second half
    of a file (``truncate``) or its middle 2,000 bytes (``random``) is read depends on the
    layout the asynchronous writer chose that run; CI once drew a file whose second half held
    nothing the restore read, and step 4 loaded with its digests verified, which is correct."""
    step4 = finished[0] / "4"
    caught = {rel for i, rel in enumerate(files_of(step4))
              if restored_step(finished, trainer, tmp_path / f"c{i}", rel, how) == 2}
    arrays = {str(p.relative_to(step4)) for p in array_files(step4)}
    assert "meta/metadata" in caught and caught & arrays, (caught, used_files)


def test_edited_metadata_is_caught(finished: tuple[Path, str], trainer: RLTrainer,
                                   tmp_path: Path) -> None:
    """A metadata edit that still parses (here: the learning rate) fails the metadata digest."""
    d = copy_run(finished, tmp_path / "run")
    path = d / "4" / "meta" / "metadata"
    text = path.read_text()
    assert '"lr": 0.001' in text
    path.write_text(text.replace('"lr": 0.001', '"lr": 0.002'))
    ck = Checkpointer(d, create=False)
    assert ck.restore(trainer, fingerprint(trainer))["step"] == 2
    assert "does not match the digest written with it" in ck.skipped[0][1]


def test_all_checkpoints_corrupt_is_a_clear_error_that_changes_nothing(
        finished: tuple[Path, str], tmp_path: Path) -> None:
    d = copy_run(finished, tmp_path / "run")
    damage(max(array_files(d / "4"), key=lambda p: p.stat().st_size), "random")
    damage(d / "2" / "meta" / "metadata", "truncate")
    with pytest.raises(NoGoodCheckpointError,
                       match=r"no usable checkpoint in .*step 4: .*step 2: .*metadata cannot "
                             r"be read.*Nothing was loaded or changed"):
        train("grpo", "reverse", steps=STEPS, seed=SEED, checkpoint_dir=str(d), resume=True,
              **RUN)
    assert steps_in(d) == ["2", "4"]  # nothing moved aside when nothing is good


# --------------------------------------------------------------------------- non-finite state


def test_save_refuses_non_finite_parameters_and_optimiser_state(
        trainer: RLTrainer, tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck")
    meta = {"fingerprint": fingerprint(trainer), "hparams": {}}
    ck.save(1, trainer, meta)
    good_params, good_opt = trainer.params, trainer.opt_state
    try:
        lm = list(good_params["lm"])
        lm[0] = jnp.full_like(lm[0], jnp.nan)
        trainer.params = {**good_params, "lm": lm}
        with pytest.raises(NonFiniteStateError, match=r"refusing to save step 2 .*: found "
                                                      r"\d+ non-finite values .* in the "
                                                      r"parameters"):
            ck.save(2, trainer, meta)
        trainer.params = good_params
        trainer.opt_state = jax.tree_util.tree_map(
            lambda x: x * jnp.inf if jnp.issubdtype(x.dtype, jnp.floating) else x, good_opt)
        with pytest.raises(NonFiniteStateError, match="in the optimiser state"):
            ck.save(2, trainer, meta)
    finally:
        trainer.params, trainer.opt_state = good_params, good_opt
    assert ck.steps() == [1]  # nothing written, the good step untouched
    assert isinstance(NonFiniteStateError("x"), InputError)


def test_keep_k_newest(trainer: RLTrainer, tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck", max_to_keep=2)
    for s in range(1, 5):
        ck.save(s, trainer, {"fingerprint": fingerprint(trainer), "hparams": {}})
    assert ck.steps() == [3, 4]
    with pytest.raises(InputError, match=r"keep=0 \(--keep\)"):
        train("grpo", "reverse", steps=1, keep=0, checkpoint_dir=str(tmp_path / "k"), **RUN)


# --------------------------------------------------------------------------- same run


def test_resume_with_changed_settings_is_refused_unless_overridden(
        finished: tuple[Path, str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = copy_run(finished, tmp_path / "run")
    changed = {**RUN, "prompts_per_step": 8, "config": {"entropy_coef": 0.05}}
    with pytest.raises(ResumeMismatchError) as err:
        train("grpo", "reverse", steps=STEPS + 1, seed=SEED, checkpoint_dir=str(d),
              resume=True, **changed)
    assert err.value.diffs == [("--entropy-coef (entropy_coef)", 0.01, 0.05),
                               ("--prompts (prompts_per_step)", 4, 8)]
    msg = str(err.value)
    assert ("--entropy-coef (entropy_coef): checkpoint 0.01, given 0.05" in msg
            and "--resume-anyway" in msg)
    assert steps_in(d) == ["2", "4"]
    with caplog.at_level(logging.WARNING):
        out = train("grpo", "reverse", steps=STEPS + 1, seed=SEED, checkpoint_dir=str(d),
                    resume=True, resume_anyway=True, **changed)
    assert out["resumed_from"] == 4 and out["steps"] == 5
    assert out["changed_on_resume"][0] == {"flag": "--entropy-coef (entropy_coef)",
                                           "checkpoint": 0.01, "given": 0.05}
    assert "no longer the run that was checkpointed" in warnings_text(caplog)
    # the new checkpoint carries the new settings and the record of the change
    meta = json.loads((d / "5" / "meta" / "metadata").read_text())
    assert meta["hparams"]["algorithm"]["entropy_coef"] == 0.05
    assert meta["lineage"][0]["step"] == 4
    with pytest.raises(ResumeMismatchError, match=r"--entropy-coef \(entropy_coef\): "
                                                  r"checkpoint 0.05, given 0.01"):
        train("grpo", "reverse", steps=STEPS + 1, seed=SEED, checkpoint_dir=str(d),
              resume=True, **RUN)
    with pytest.raises(InputError, match=r"--resume-anyway .* only applies when resuming"):
        train("grpo", "reverse", steps=1, resume_anyway=True, **RUN)


def test_cli_resume_names_the_changed_flag(tmp_path: Path, capsys: pytest.CaptureFixture
                                           ) -> None:
    d = str(tmp_path / "ck")
    base = ["train", "--steps", "1", "--prompts", "2", "--group", "2", "--max-digits", "1",
            "--eval-prompts", "0", "--no-progress", "--checkpoint-dir", d]
    assert cli_main(base) == 0
    capsys.readouterr()
    assert cli_main([*base, "--resume", "--group", "3", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "error: --checkpoint-dir" in err and "Traceback" not in err
    assert "--group (group_size): checkpoint 2, given 3" in err
    assert "--seed (seed): checkpoint 0, given 5" in err
    assert cli_main([*base, "--resume", "--group", "3", "--resume-anyway", "--json"]) == 0
    out = capsys.readouterr()
    assert "warning: resuming" in out.err and "--group (group_size)" in out.err
    assert json.loads(out.out.strip().splitlines()[-1])["changed_on_resume"][0]["given"] == 3


# --------------------------------------------------------------------------- paths


def test_resume_on_a_missing_or_empty_directory_is_an_error(
        finished: tuple[Path, str], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    typo = tmp_path / "chekpoints"
    with pytest.raises(InputError, match=r"--resume: --checkpoint-dir .*chekpoints does not "
                                         r"exist.*--resume-or-start"):
        train("grpo", "reverse", steps=1, checkpoint_dir=str(typo), resume=True, **RUN)
    assert not typo.exists()  # a typo is not turned into a fresh run
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no checkpoint"):
        train("grpo", "reverse", steps=1, checkpoint_dir=str(tmp_path / "empty"), resume=True,
              **RUN)
    with pytest.raises(InputError, match="need --checkpoint-dir"):
        train("grpo", "reverse", steps=1, resume=True, **RUN)
    # --resume-or-start: a new run where there is nothing yet, the old one where there is
    with caplog.at_level(logging.WARNING):
        ckpt, resuming, lock = open_checkpoints(CheckpointConfig(str(typo),
                                                                 resume_or_start=True))
    assert ckpt is not None and not resuming and typo.is_dir() and lock is not None
    lock.release()
    assert "starting a new run" in warnings_text(caplog)
    ckpt, resuming, lock = open_checkpoints(CheckpointConfig(str(finished[0]),
                                                             resume_or_start=True))
    assert resuming and lock is not None
    lock.release()


def test_unwritable_outputs_fail_before_the_first_step(
        tmp_path: Path, unwritable_dir: Path) -> None:
    ro = unwritable_dir

    def never(m: dict[str, Any]) -> None:
        raise AssertionError("a training step ran before the path check")

    cases = [
        (dict(checkpoint_dir=str(ro)), r"--checkpoint-dir \(checkpoint_dir\) .*cannot write"),
        (dict(checkpoint_dir=str(ro / "ck")), r"--checkpoint-dir .*cannot write"),
        (dict(checkpoint_dir=str(tmp_path / "no" / "ck")), r"parent directory .* does not exist"),
        (dict(metrics_file=str(ro / "m.jsonl")), r"--metrics \(metrics_file\) .*cannot write"),
        (dict(metrics_file=str(tmp_path / "no" / "m.jsonl")), r"--metrics .*does not exist"),
        (dict(metrics_file=str(tmp_path)), r"--metrics .* is a directory"),
    ]
    try:
        for kwargs, pattern in cases:
            with pytest.raises(InputError, match=pattern):
                train("grpo", "reverse", steps=1, on_step=never, **RUN, **kwargs)
        assert not (tmp_path / "no").exists()
    finally:
        (tmp_path / "ro").chmod(0o755)


def test_cli_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_train_parser(p.add_subparsers(dest="cmd"))
    a = p.parse_args(["train", "--keep", "5", "--resume-or-start", "--resume-anyway"])
    assert (a.keep, a.resume_or_start, a.resume_anyway, a.resume) == (5, True, True, False)
    assert p.parse_args(["train"]).keep == 3
    assert cli_main(["train", "--steps", "1", "--no-progress",
                     "--plot", str(tmp_path / "no" / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "error: --plot" in err and "does not exist" in err


_CHILD = """
import sys
from jaxrl_sym.rl.run.train import train
sys.path.insert(0, {tests!r})
from test_faults_checkpoint import RUN, SEED
train("grpo", "reverse", steps={steps}, seed=SEED, checkpoint_dir={d!r}, checkpoint_every=1,
      keep=100, **RUN)
"""


def test_sigkill_during_saves_resumes_to_the_uninterrupted_run(
        finished: tuple[Path, str], tmp_path: Path, child_compile_env: dict[str, str]) -> None:
    """A training process killed with SIGKILL while it writes checkpoints (every step) loses at
    most the step being written: resume skips any half-written step and the run ends with the
    digest of the uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    d = tmp_path / "run"
    code = _CHILD.format(tests=str(Path(__file__).parent), steps=STEPS, d=str(d))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, **child_compile_env})
    deadline = time.time() + 300
    try:  # kill as soon as a save of step >= 2 is under way (or the second step dir appears)
        while time.time() < deadline and proc.poll() is None:
            names = steps_in(d) if d.exists() else []
            if "1" in names and any(n != "1" for n in names):  # step 1 done, step 2 begun
                break
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    out = train("grpo", "reverse", steps=STEPS, seed=SEED, checkpoint_dir=str(d),
                checkpoint_every=EVERY, resume=True, **RUN)
    assert out["params_sha256"] == finished[1]
