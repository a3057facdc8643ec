"""Signals and concurrent runs (issue 29): SIGTERM / SIGINT at random moments of a training
run end it cleanly — the step under way finishes (a second signal abandons it), the last
finished step is saved where there is a checkpoint directory (also with the default
``checkpoint_every=0``), one line says where, the exit code is 128 + signal — and ``--resume``
then ends exactly where the uninterrupted run ends (``params_sha256``). Two runs on one
checkpoint directory: the second is refused naming the first.

Trials: 2 per signal here (CI); ``SIGNAL_TRIALS=10`` runs the issue's 10 each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.run.run_files import RunLock
from jaxrl_sym.rl.run.train import train

pytestmark = pytest.mark.share_compiles
TINY = dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16, ffn_dim=64)
RUN: dict[str, Any] = dict(prompts_per_step=4, group_size=4, beta=0.04, model=TINY,
                           max_digits=2, progress=False, eval_prompts=0)
SEED, STEPS = 5, 16
TRIALS = int(os.environ.get("SIGNAL_TRIALS", "2"))

# the child: the library's loop, with the handlers and the ending of the CLI's run_train
_CHILD = """
import sys
sys.path.insert(0, {tests!r})
from jaxrl_sym.rl.run.interrupt import Interrupted, install
from jaxrl_sym.rl.run.train import train
install()
from test_faults_signals import RUN, SEED, STEPS
try:
    train("grpo", "reverse", steps=STEPS, seed=SEED, checkpoint_dir={d!r}, checkpoint_every={every},
          keep=100, metrics_file={m!r}, **RUN)
except Interrupted as e:
    print(e.message, file=sys.stderr)
    sys.exit(e.exit_code)
"""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("straight") / "run"
    return train("grpo", "reverse", steps=STEPS, seed=SEED, checkpoint_dir=str(d), **RUN)[
        "params_sha256"]


def _interrupt(tmp: Path, sig: int, every: int, delay: float, twice: bool,
               cache_env: dict[str, str]) -> tuple[int, str, Path]:
    """Start a checkpointed run, wait for its first metrics line, then ``delay`` seconds,
    then send ``sig`` (again at once when ``twice``). Returns (exit code, stderr, run dir)."""
    d, m = tmp / "run", tmp / "m.jsonl"
    code = _CHILD.format(tests=str(Path(__file__).parent), d=str(d), m=str(m), every=every)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **cache_env}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (
            m.exists() and m.read_text().count("\n") >= 1):
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(sig)
    if twice:
        time.sleep(0.05)
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err, d


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_at_a_random_moment_saves_and_resume_matches_the_uninterrupted_run(
        sig: int, uninterrupted: str, tmp_path: Path, child_compile_env: dict[str, str]
) -> None:
    rng = np.random.default_rng(int(sig))
    interrupted = 0
    for trial in range(TRIALS):
        # every=0: only the end would be saved, so the interruption's save is the only one
        every, twice = int(rng.choice([0, 3])), bool(trial % 2)
        tmp = tmp_path / str(trial)
        tmp.mkdir()
        rc, err, d = _interrupt(tmp, sig, every, float(rng.uniform(0, 0.5)), twice,
                               child_compile_env)
        done = (tmp / "m.jsonl").read_text().count("\n") == STEPS
        if done and rc in (0, -sig):  # the run ended (and saved) before the signal landed
            continue
        assert rc == 128 + sig, (trial, every, twice, err)
        last = err.strip().splitlines()[-1]
        name = signal.Signals(sig).name
        assert last.startswith(f"{name}: stopped after step ") and str(d) in last, err
        assert "Traceback" not in err, err
        step = int(last.split("after step ")[1].split(";")[0])
        lines = (tmp / "m.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(1, step + 1))  # none torn
        out = train("grpo", "reverse", steps=STEPS, seed=SEED, checkpoint_dir=str(d),
                    checkpoint_every=every, resume=True, keep=100, **RUN)
        assert out["resumed_from"] == step
        assert out["params_sha256"] == uninterrupted, (trial, every, twice, step)
        interrupted += 1
    # not vacuous: the children load their programs from the module's compile cache, so a
    # step takes ~0.1 s and 16 outlast the signal's delay of at most 0.5 s after the first
    assert interrupted >= 1, "every run ended before its signal: nothing was interrupted"


def test_a_second_run_on_a_locked_directory_is_refused_naming_the_holder(tmp_path: Path
                                                                       ) -> None:
    d = tmp_path / "run"
    d.mkdir()
    holder = RunLock(str(d)).acquire()
    try:
        with pytest.raises(InputError, match=r"is in use by a running training \(pid \d+ on "):
            train("grpo", "reverse", steps=1, seed=SEED, checkpoint_dir=str(d), **RUN)
    finally:
        holder.release()
    assert train("grpo", "reverse", steps=1, seed=SEED, checkpoint_dir=str(d), **RUN)["steps"] == 1


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    """The kernel drops an flock when its process dies, even by SIGKILL."""
    d = tmp_path / "run"
    d.mkdir()
    code = (f"import sys, time; sys.path.insert(0, {str(Path(__file__).parent.parent)!r})\n"
            "from jaxrl_sym.rl.run.run_files import RunLock\n"
            f"lock = RunLock({str(d)!r}).acquire(); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    with pytest.raises(InputError, match=f"pid {proc.pid} on"):
        RunLock(str(d)).acquire()
    proc.kill()
    proc.wait()
    RunLock(str(d)).acquire().release()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1],
                         ids=["SIGTERM", "SIGHUP", "SIGUSR1"])
def test_cli_signal_is_one_line_and_exit_128_plus_signal(tmp_path: Path, sig: int,
                                                         child_compile_env: dict[str, str]
                                                         ) -> None:
    """The command line as a scheduler (SIGTERM, Slurm's SIGUSR1 notice) or a closed terminal
    (SIGHUP) sees it: one line naming the checkpoint, exit code 128 + signal, no traceback;
    --resume continues from the step it names."""
    d, m = tmp_path / "run", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "jaxrl_sym.cli", "train", "--task", "reverse", "--steps", "40",
           "--prompts", "2", "--group", "2", "--max-digits", "2", "--eval-prompts", "0",
           "--checkpoint-dir", str(d), "--metrics", str(m), "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **child_compile_env})
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (
            m.exists() and m.read_text().count("\n") >= 2):
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err
    lines = [x for x in err.strip().splitlines() if x.startswith(signal.Signals(sig).name)]
    assert len(lines) == 2 and "Traceback" not in err, err  # the request, then where it saved
    step = int(lines[1].split("after step ")[1].split(";")[0])
    assert step >= 2 and str(d) in lines[1]
    assert len(m.read_text().splitlines()) == step
