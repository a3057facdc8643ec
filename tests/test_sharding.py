"""Meshes and sharding rules (issue 15): flags, the FSDP rule, and multi-device runs.

The multi-device checks run in a child process with 8 virtual CPU devices
(``tests/sharding_checks.py``): XLA reads ``--xla_force_host_platform_device_count`` once, when
JAX initialises, and this process has one device. They compare against single-device runs in
the same child, so "same samples" and "same weights" hold by construction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_sym.errors import InputError
from jaxrl_sym.sharding import MeshConfig, param_spec, round_up
from jaxrl_sym.sizes import parse_bytes

ROOT = Path(__file__).resolve().parents[1]


def child_env(devices: int, **extra: str) -> dict[str, str]:
    """A child's environment: ``devices`` virtual CPU devices, on top of this process's
    XLA_FLAGS (tests/conftest.py's compile settings), and no persistent compilation cache."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu",
            "JAXRL_SYM_COMPILE_CACHE": "off", **extra}


def run_checks(*checks: str, devices: int = 8, timeout: int = 900) -> dict[str, Any]:
    """Run named checks of ``tests/sharding_checks.py`` on ``devices`` virtual CPU devices, in
    one child; a check that failed there is ``{"error": its traceback}``."""
    env = child_env(devices)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "sharding_checks.py"), *checks],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def eight_devices() -> dict[str, Any]:
    """Every 8-device check, run once in one child for the tests below (one JAX start-up;
    the checkpoint check saves the trainer the rl_step check stepped)."""
    return run_checks("generation", "rl_step", "checkpoint", "memory")


def check(results: dict[str, Any], name: str) -> dict[str, Any]:
    """One check's outcome; its traceback from the child if it failed there."""
    out = results[name]
    assert "error" not in out, out.get("error")
    return out


# ---------------------------------------------------------------------- flags (no devices)
def test_mesh_flag_parses_and_names_the_flag_when_wrong() -> None:
    cfg = MeshConfig.parse("data=4,model=2")
    assert cfg.axes == (("data", 4), ("model", 2)) and cfg.size == 8
    for bad, words in (("data=4,model", "NAME=SIZE"), ("data=0", "positive"),
                       ("data=x", "positive"), ("rows=2", "unknown axis 'rows'"),
                       ("data=2,data=2", "twice"), ("model=8", "data-parallel axis")):
        with pytest.raises(InputError, match="--mesh") as e:
            MeshConfig.parse(bad)
        assert words in str(e.value), bad
    with pytest.raises(InputError) as e:
        cfg.check(4)
    assert "--mesh data=4,model=2" in str(e.value) and "4 device(s)" in str(e.value)
    cfg.check(8)


class _Mesh:
    """Just what the rule reads from a mesh (its axis sizes)."""

    def __init__(self, **shape: int) -> None:
        self.shape = shape


def test_param_rule_shards_the_largest_divisible_axis_and_replicates_small_ones() -> None:
    m = _Mesh(data=4, model=2)
    assert param_spec((64, 256), m) == ("model", "data")  # 256 over data, 64 over model
    assert param_spec((6, 512), m) == ("model", "data")
    assert param_spec((100, 64, 3), m) == ("data", "model", None)
    assert param_spec((30, 50), m) == (None, "model")  # nothing divisible by 4
    assert param_spec((16,), m) == (None,)  # small: replicated
    assert param_spec((), m) == ()
    assert param_spec((4096,), _Mesh(data=2, fsdp=2)) == (("data", "fsdp"),)
    assert param_spec((128, 64), _Mesh(fsdp=8)) == ("fsdp", None)
    assert round_up(7, 8) == 8 and round_up(16, 8) == 16 and round_up(3, 1) == 3


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10**6), st.sampled_from([("B", 1), ("KB", 10**3), ("MiB", 2**20),
                                               ("gb", 10**9), ("GiB", 2**30), ("", 1)]))
def test_budget_sizes_parse_with_units_and_refuse_nonsense(n: int, unit: tuple[str, int]) -> None:
    assert parse_bytes(f"{n}{unit[0]}", "--device-memory") == n * unit[1]
    assert parse_bytes(f"{n} {unit[0]}") == n * unit[1]
    for bad in ("0GB", "-3MB", "12 parsecs", "", "GB", "1.2.3G"):
        with pytest.raises(InputError, match=r"^--device-memory must be a byte count >= 1"):
            parse_bytes(bad, "--device-memory")


def test_budget_refuses_a_program_over_it_naming_the_program() -> None:
    """One device, a budget the state fits but the update program does not: the step fails
    when that program compiles, before it runs, naming it; generation's programs were checked
    and admitted first."""
    import numpy as np

    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
    from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE

    task = get_task("reverse", max_digits=3)
    # update_tokens: micro-batches of the batch's own size (sym's default, 4096 slots, puts
    # even the reference program over this budget)
    cfg = RLConfig.of(algo="grpo", group_size=4, beta=0.1, eos_id=EOS,
                      max_new_tokens=task.max_new_tokens, update_tokens=128)
    model = init_model(preset("tiny", vocab_size=VOCAB_SIZE), 0)
    with pytest.raises(InputError, match=r"on one device, over the device_memory budget.*fsdp="):
        RLTrainer(model, task.reward, cfg, device_memory="10KB")
    # state ~0.3 MiB fits; generation's programs (<= 0.16 MB), the reference's (0.22 MB) fit;
    # the update's (0.82 MB since attention recomputes its scores in the backward) does not
    tr = RLTrainer(model, task.reward, cfg, device_memory="500KB")
    with pytest.raises(InputError, match=r"program 'update-sym' needs .* KiB"):
        tr.step(task.sample(np.random.default_rng(1), 2), seed=4)
    assert tr.engine.cache.device_bytes and max(tr.engine.cache.device_bytes.values()) < 500_000


# ---------------------------------------------------------------------- 8 virtual devices
@pytest.mark.slow
def test_sharded_generation_tokens_equal_single_device(eight_devices: dict[str, Any]) -> None:
    out = check(eight_devices, "generation")
    assert set(out) == {"data=8,T=1.0", "data=4,model=2,T=0.0"}
    for res in out.values():
        assert res["programs_with_split_stores"] >= 1 and res["weights_sharded"] >= 1


@pytest.mark.slow
def test_sharded_rl_step_loss_and_grads_equal_single_device(
        eight_devices: dict[str, Any]) -> None:
    out = check(eight_devices, "rl_step")
    for key in ("data=8,padded", "data=4,model=2,sym"):
        assert out[key]["max_grad_diff"] <= 1e-5
        assert abs(out[key]["loss"] - out[key]["loss_single"]) <= 1e-5
        assert out[key]["kl"] > 1e-6  # the KL term is exercised
    # the rows were padded to a multiple of the data axis with empty rows
    assert out["data=4,model=2,sym"]["rows_single_vs_mesh"][1] % 4 == 0
    assert out["data=8,padded"]["rows_single_vs_mesh"] == [20, 24]


@pytest.mark.slow
def test_checkpoint_saved_on_8_devices_restores_on_2_and_on_1(
        eight_devices: dict[str, Any]) -> None:
    out = check(eight_devices, "checkpoint")
    assert out["saved_on"] == "data=4,model=2" and out["steps"] == 1
    assert out["restored_on_data=2"] == out["restored_on_one device"]


@pytest.mark.slow
def test_a_state_over_one_devices_budget_trains_on_8_devices(
        eight_devices: dict[str, Any]) -> None:
    out = check(eight_devices, "memory")
    assert out["total_bytes"] > out["limit"]  # does not fit one device ...
    assert "device_memory budget" in out["refused"] and "fsdp=" in out["refused"]
    assert out["max_per_device"] <= out["total_bytes"] / 8 + out["replicated_bytes"]
    assert out["fraction"] <= 0.13  # ... and an eighth of it fits each of 8
    assert out["largest_program"] <= out["limit"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _two_processes(args: list[str]) -> list[tuple[str, str]]:
    """Run a CLI command as processes 0 and 1 of a two-process run (2 CPU devices each)."""
    port = str(_free_port())
    env = child_env(2)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxrl_sym.cli", *args, "--coordinator", f"localhost:{port}",
         "--num-processes", "2", "--process-id", str(i)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    # (gloo's connection lines go to stdout from C++; the report is the JSON line)
    assert not any(ln.startswith("{") for ln in outs[1][0].splitlines())
    return outs


@pytest.mark.slow
def test_two_processes_generate_and_train_as_one_device_and_restore_on_one(
        tmp_path: Path) -> None:
    """Two processes x 2 virtual devices under ``jax.distributed`` (the several-hosts path):
    arrays have shards a process cannot read, programs run SPMD across processes. Generation,
    loss and gradients equal one device's (checked in each process); the checkpoint the
    cross-process mesh wrote restores here, on one device of one process, bit-identical."""
    env = child_env(2)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "multihost_checks.py"),
                               str(i), "2", port, str(tmp_path)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert (out["processes"], out["devices"], out["local_devices"]) == (2, 4, 2)
    assert set(out["generation"]) == {"data=2,model=2,T=1.0"}
    assert all(g["weights_across_processes"] > 0 for g in out["generation"].values())
    for key in ("data=4,sym", "data=2,model=2,padded"):
        assert out["rl_step"][key]["max_grad_diff"] <= 1e-5 and out["rl_step"][key]["kl"] > 1e-6
    # process 0 checked its results against one device; process 1 saw the same results
    other = json.loads((tmp_path / "p1.json").read_text())
    for part in ("generation", "rl_step"):
        for key in set(out[part]) - {"saved"}:
            assert other[part][key]["digest"] == out[part][key]["digest"], (part, key)

    from sharding_checks import CFG, MODEL, TASK

    from jaxrl_sym.models.lm import init_model
    from jaxrl_sym.rl import RLTrainer
    from jaxrl_sym.rl.run.checkpoint import Checkpointer, fingerprint
    from jaxrl_sym.rl.step.state import params_sha256

    one = RLTrainer(init_model(MODEL, 2), TASK.reward, CFG)
    Checkpointer(tmp_path / "ckpt", create=False).restore(one, fingerprint(one))
    saved = out["rl_step"]["saved"]
    assert params_sha256(one.params) == saved["params_sha256"]
    assert params_sha256(one.opt_state) == saved["opt_sha256"] and one.steps_done == 1


def _cli(args: list[str], devices: int, **extra: str) -> subprocess.CompletedProcess[str]:
    env = child_env(devices, **extra)
    return subprocess.run([sys.executable, "-m", "jaxrl_sym.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_cli_refuses_a_bad_mesh_before_importing_jax(tmp_path: Path) -> None:
    # a jax that cannot be imported first on the path: the flag must be refused without it
    (tmp_path / "jax").mkdir()
    (tmp_path / "jax" / "__init__.py").write_text("raise ImportError('jax imported')\n")
    path = os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = _cli(["train", "--mesh", "data=2,rows=4", "--steps", "1"], devices=1, PYTHONPATH=path)
    assert "jax imported" not in proc.stderr
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --mesh 'data=2,rows=4': unknown axis 'rows'; axes are "
                                   "data, fsdp, model")
    proc = _cli(["train", "--device-memory", "12 parsecs", "--steps", "1"], devices=1,
                PYTHONPATH=path)
    assert "jax imported" not in proc.stderr and proc.returncode == 2
    assert proc.stderr.strip() == ("error: --device-memory must be a byte count >= 1 like 40e9, "
                                   "16G or 8GiB, got '12 parsecs'")


@pytest.mark.slow
def test_cli_trains_on_a_mesh_and_resumes_on_another(tmp_path: Path) -> None:
    run = ["train", "--prompts", "2", "--group", "4", "--eval-prompts", "0", "--no-progress",
           "--json", "--checkpoint-dir", str(tmp_path / "run")]
    proc = _cli([*run, "--steps", "1", "--mesh", "data=3"], devices=8)
    assert proc.returncode == 2 and "--mesh data=3" in proc.stderr and "8 device(s)" in proc.stderr
    proc = _cli([*run, "--steps", "2", "--mesh", "data=4,model=2"], devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first["mesh"] == "data=4,model=2" and first["steps"] == 2
    proc = _cli([*run, "--steps", "3", "--resume", "--mesh", "data=2"], devices=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert second["resumed_from"] == 2 and second["mesh"] == "data=2"
    assert second["changed_on_resume"] == []  # the mesh is not part of the run's identity


def test_cli_distributed_flags_are_checked_before_jax() -> None:
    base = ["train", "--steps", "1"]
    for extra, msg in (
            (["--num-processes", "2"], "need --coordinator HOST:PORT"),
            (["--coordinator", "node0"], "give HOST:PORT of process 0"),
            (["--coordinator", "node0:1234", "--num-processes", "2"], "also give"),
            (["--coordinator", "node0:1234", "--num-processes", "2", "--process-id", "2"],
             "--process-id 2 with --num-processes 2"),
            (["--coordinator", "auto", "--process-id", "0"], "--coordinator auto takes"),
            (["--coordinator", "auto"], "give a --mesh over every process's devices")):
        proc = _cli([*base, *extra], devices=1)
        assert proc.returncode == 2 and msg in proc.stderr, (extra, proc.stderr[-500:])
    # well-formed, but no cluster to detect: JAX's own error, under the flag, no traceback
    proc = _cli([*base, "--coordinator", "auto", "--mesh", "data=1"], devices=1)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--coordinator auto (no cluster JAX knows was detected)" in proc.stderr


@pytest.mark.slow
def test_cli_trains_on_two_processes_and_resumes_on_one(tmp_path: Path) -> None:
    """``train --coordinator`` on two processes (2 virtual devices each, one mesh over all 4):
    process 0 alone writes the metrics and the summary; the checkpoint resumes in a single
    process on one device."""
    run = ["train", "--prompts", "2", "--group", "4", "--eval-prompts", "0", "--no-progress",
           "--checkpoint-dir", str(tmp_path / "run")]
    outs = _two_processes([*run, "--steps", "2", "--mesh", "data=4", "--json", "--metrics",
                           str(tmp_path / "m.jsonl")])
    first = json.loads(outs[0][0].strip().splitlines()[-1])
    assert first["mesh"] == "data=4" and first["steps"] == 2
    assert "2 steps done; process 0 reports" in outs[1][1]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2  # one writer
    proc = _cli([*run, "--steps", "3", "--resume", "--json"], devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert second["resumed_from"] == 2 and second["mesh"] == "single device"


GEN = ["generate", "--model", str(ROOT / "tests" / "fixtures" / "hf" / "qwen2_sliding_sharded"),
       "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--prompt-ids", "7", "--max-new-tokens",
       "6", "--ignore-eos", "--temperature", "1.0", "--seed", "3", "--json"]


def test_generate_mesh_flag_is_checked_before_jax() -> None:
    proc = _cli([*GEN, "--mesh", "data=2", "--system", "padded"], devices=1)
    assert proc.returncode == 2 and "--mesh applies to --system sym" in proc.stderr
    proc = _cli([*GEN, "--mesh", "data"], devices=1)
    assert proc.returncode == 2 and "--mesh 'data': each entry is NAME=SIZE" in proc.stderr


@pytest.fixture(scope="module")
def single_device_tokens() -> list[list[int]]:
    """``generate GEN`` on one device: the oracle of both tests below, run once."""
    proc = _cli(GEN, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["tokens"] for r in json.loads(proc.stdout.strip().splitlines()[-1])["rows"]]


@pytest.mark.slow
def test_generate_on_a_mesh_gives_the_single_device_tokens(
        single_device_tokens: list[list[int]]) -> None:
    proc = _cli([*GEN, "--mesh", "data=4,model=2"], devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    want = single_device_tokens
    assert [r["tokens"] for r in out["rows"]] == want and out["mesh"] == "data=4,model=2"
    assert len({t for r in want for t in r}) > 3  # sampled, varied


@pytest.mark.slow
def test_generate_on_two_processes_gives_the_single_device_tokens(
        single_device_tokens: list[list[int]]) -> None:
    want = single_device_tokens
    outs = _two_processes([*GEN, "--mesh", "data=4"])
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert [r["tokens"] for r in got["rows"]] == want and got["mesh"] == "data=4"


def test_decode_mesh_flag_is_checked_before_jax() -> None:
    proc = _cli(["decode", "--mesh", "data=2", "--systems", "padded"], devices=1)
    assert proc.returncode == 2
    assert "--mesh shards the sym systems; --systems 'padded' has none" in proc.stderr
    proc = _cli(["decode", "--mesh", "rows=2"], devices=1)
    assert proc.returncode == 2 and "unknown axis 'rows'" in proc.stderr


@pytest.mark.slow
def test_decode_on_a_mesh_checks_sym_against_single_device_padded() -> None:
    proc = _cli(["decode", "--mesh", "data=2", "--tokens", "12", "--batch", "3", "--json",
                 "--no-warm"], devices=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["systems"]["sym"]["mesh"] == "data=2" and "mesh" not in out["systems"]["padded"]
    assert out["check"]["tokens_equal"] and out["check"]["rows"] == 3
    assert out["check"]["max_abs_logit_diff"] < 1e-4
