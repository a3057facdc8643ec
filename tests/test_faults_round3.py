"""Faults new users reported (issue 50): each case fails on the code before the fix.

* **Signals during export**: SIGINT, SIGHUP, SIGTERM while ``jaxrl-sym export`` writes end it
  with one line and exit 128 + signal (as ``train``), leaving no hidden temporary directory and
  ``--out`` as it was; the no-exchange swap puts the old ``--out`` back when interrupted.
* **A source without a tokenizer**: refused naming ``tokenizer.json`` and ``--no-tokenizer``.
* **``--peft --dtype``**: the adapters are written in that dtype, range-checked.
* **Checks before work**: ``python -m bench rlft_step`` refuses bad flag values before JAX is
  imported (``--lora-rank 0`` names full fine-tuning); a directory, ``config.json`` or
  ``tokenizer.json`` this user may not read is named with the permission it needs. As root,
  chmod denies nothing: the denial is then simulated by patching ``os.listdir``/``os.stat``/
  ``open`` in this process (every permission case here runs in-process).
* **Errors name the user's thing**: ``--resume`` with another ``--lora-rank`` names the flag
  (the run's settings are compared before the checkpoint's parameter shapes).
"""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from jaxrl_sym.cli import main
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.hf import export as hf_export
from jaxrl_sym.models.hf.safetensors_io import read_header, read_tensor

pytestmark = pytest.mark.share_compiles
TEXT = Path(__file__).parent / "fixtures" / "text" / "chatml_qwen2"
PROBLEMS = [{"prompt": f"What is {a} + {b}?", "answer": a + b} for a, b in [(3, 4), (12, 5)]]

# --------------------------------------------------------------------------- signals

# the CLI, each tensor's write slowed (patched in the child once the export imports it: the
# handlers are installed before JAX is imported, as in the real command)
_SLOW_EXPORT = """
import sys, time
import jaxrl_sym.hf_export_cli as cli
run_export = cli.run_export
def patched(args):
    import jaxrl_sym.models.hf.export as export
    host = export._host_tensor
    def slow(*a):
        if not getattr(slow, "said", False):
            slow.said = True
            print("WRITING", file=sys.stderr, flush=True)
        time.sleep(0.1)
        return host(*a)
    export._host_tensor = slow
    return run_export(args)
cli.run_export = patched
from jaxrl_sym.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig,overwrite", [(signal.SIGINT, False), (signal.SIGHUP, True),
                                           (signal.SIGTERM, False)],
                         ids=["SIGINT", "SIGHUP-overwrite", "SIGTERM"])
def test_signal_during_export_exits_cleanly_leaving_nothing(sig: int, overwrite: bool,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    if overwrite:  # an existing --out must come through unchanged
        out.mkdir()
        (out / "old.txt").write_text("old")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_EXPORT, "export", "--model", str(TEXT), "--out", str(out),
         *(["--overwrite"] if overwrite else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # until the export is writing its temporary directory
        seen.append(line)
        if "WRITING" in line:
            break
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert partial, ("no temporary directory while writing", seen)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err, err
    state = "is unchanged" if overwrite else "was not created"
    assert err.strip().splitlines()[-1] == (
        f"{name}: export stopped before it finished; {out} {state} and no partial copy was "
        "left"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if overwrite else [])
    if overwrite:
        assert [p.name for p in out.iterdir()] == ["old.txt"]


def test_swap_without_exchange_puts_the_old_out_back_when_interrupted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where renameat2 cannot exchange, ``--out`` is moved aside before the new one is renamed
    in: a signal between the two renames left no ``--out`` and the old one hidden."""
    out, tmp = tmp_path / "out", tmp_path / ".out.tmp-x"
    out.mkdir()
    (out / "old.txt").write_text("old")
    tmp.mkdir()
    (tmp / "new.txt").write_text("new")
    monkeypatch.setattr(hf_export, "_exchange", lambda a, b: False)
    rename = os.rename

    def interrupted(a: Any, b: Any) -> None:
        if Path(a) == tmp:
            raise KeyboardInterrupt
        rename(a, b)

    monkeypatch.setattr(os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hf_export.swap_into_place(tmp, out)
    assert (out / "old.txt").read_text() == "old"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]


def test_stopped_export_cleanup_finishes_or_rolls_back_the_swap(tmp_path: Path) -> None:
    """What the handler does wherever the signal lands: an ``--out`` moved aside by the
    no-exchange swap goes back; after the new ``--out`` is in place the line says it is
    complete; every ``.OUT.tmp-*``/``.OUT.old-*`` the export made is gone."""
    from jaxrl_sym.hf_export_cli import _abandon, _identity

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    old = _identity(str(out))
    aside, tmp = tmp_path / ".out.old-1", tmp_path / ".out.tmp-1"
    aside.mkdir()
    tmp.mkdir()
    (out).rename(aside / "out")  # the signal came between the fallback's two renames
    line = _abandon(signal.SIGTERM, str(out), [str(aside), str(tmp)], old)
    assert line == (f"SIGTERM: export stopped before it finished; {out} is unchanged and no "
                    "partial copy was left")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (out / "old.txt").read_text() == "old"
    new = tmp_path / ".out.tmp-2"
    new.mkdir()
    shutil.rmtree(out)
    new.rename(out)  # the new --out is in place, the signal came after
    line = _abandon(signal.SIGINT, str(out), [], old)
    assert line == f"SIGINT: stopped as the export finished; {out} holds the complete export"


# --------------------------------------------------------------------------- tokenizer


@pytest.fixture
def no_tokenizer_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(TEXT, src)
    (src / "tokenizer.json").unlink()
    return src


def test_export_from_a_source_without_tokenizer_is_refused_naming_the_flag(
        no_tokenizer_source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["export", "--model", str(no_tokenizer_source), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"--model {no_tokenizer_source} has no tokenizer.json" in err
    assert "pass --no-tokenizer" in err and not (tmp_path / "o").exists()
    rc = main(["export", "--model", str(no_tokenizer_source), "--out", str(tmp_path / "o"),
               "--no-tokenizer"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "o" / "model.safetensors").is_file()
    assert not (tmp_path / "o" / "tokenizer.json").exists()


def test_no_tokenizer_beside_a_tokenizer_is_refused(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The export would copy it anyway: the flag would be ignored."""
    rc = main(["export", "--model", str(TEXT), "--out", str(tmp_path / "o"), "--no-tokenizer"])
    err = capsys.readouterr().err
    assert rc == 2 and "has a tokenizer.json, which the export copies; drop --no-tokenizer" in err
    rc = main(["export", "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "o"),
               "--peft", "--no-tokenizer"])
    assert rc == 2 and "a --peft adapter directory holds no tokenizer" in capsys.readouterr().err


# --------------------------------------------------------------------------- a LoRA run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(checkpoint dir, its source model — a copy, so a test may take its tokenizer away —,
    task file) of a one-step LoRA run of rank 2."""
    from jaxrl_sym.rl.run.train import train

    tmp = tmp_path_factory.mktemp("lora")
    src, tasks, run = tmp / "src", tmp / "sums.jsonl", tmp / "run"
    shutil.copytree(TEXT, src)
    tasks.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    train("grpo", f"jsonl:{tasks}", 1, model_dir=str(src), checkpoint_dir=str(run),
          prompts_per_step=2, group_size=2, progress=False, eval_prompts=0, seed=3,
          config={"max_new_tokens": 4, "lr": 1e-2}, lora={"rank": 2, "alpha": 4.0})
    return run, src, tasks


def test_checkpoint_export_whose_source_lost_its_tokenizer_is_refused(
        lora_run: tuple[Path, Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    run, src, _ = lora_run
    (src / "tokenizer.json").rename(tmp_path / "tokenizer.json")
    try:
        rc = main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "o")])
    finally:
        (tmp_path / "tokenizer.json").rename(src / "tokenizer.json")
    err = capsys.readouterr().err
    assert rc == 2 and f"the run's source model {src}" in err, err
    assert "has no tokenizer.json" in err and "--no-tokenizer" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("dtype,code", [("float16", "F16"), ("bfloat16", "BF16")])
def test_peft_export_writes_the_adapters_in_dtype(
        dtype: str, code: str, lora_run: tuple[Path, Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import ml_dtypes
    from safetensors.numpy import load_file

    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.weights.peft import load_peft

    run, src, _ = lora_run
    assert main(["export", "--checkpoint-dir", str(run), "--peft", "--out",
                 str(tmp_path / "f32")]) == 0
    assert main(["export", "--checkpoint-dir", str(run), "--peft", "--dtype", dtype, "--out",
                 str(tmp_path / "cast")]) == 0, capsys.readouterr().err
    _, header = read_header(tmp_path / "cast" / "adapter_model.safetensors")
    header.pop("__metadata__")
    assert header and {e["dtype"] for e in header.values()} == {code}
    want = load_file(tmp_path / "f32" / "adapter_model.safetensors")
    target = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    start, _ = read_header(tmp_path / "cast" / "adapter_model.safetensors")
    with open(tmp_path / "cast" / "adapter_model.safetensors", "rb") as fh:
        for name, entry in header.items():
            got = read_tensor(fh, start, entry, name)
            assert np.array_equal(got, want[name].astype(target)), name
    cfg, _, adapters = load_peft(tmp_path / "cast", load_pretrained(src)[0])  # PEFT reads it
    assert cfg.rank == 2 and len(adapters) == len(header) // 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cast", "f32"]  # nothing hidden left


def test_peft_export_overflowing_the_dtype_is_refused_naming_the_tensor(
        lora_run: tuple[Path, Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Adapters scaled past float16's ±65504 as they are read (a diverging run's)."""
    import jax

    from jaxrl_sym.rl.run.checkpoint import Checkpointer
    from jaxrl_sym.rl.run.export import export_checkpoint

    restore = Checkpointer.restore_params

    def huge(self: Checkpointer, step: int, expected: dict) -> tuple[dict, dict]:
        meta, params = restore(self, step, expected)
        params["lm"] = jax.tree_util.tree_map(lambda x: np.asarray(x) * 1e9, params["lm"])
        return meta, params

    monkeypatch.setattr(Checkpointer, "restore_params", huge)
    run = lora_run[0]
    with pytest.raises(InputError, match=r"adapter being exported with --dtype float16: tensor "
                       r"'base_model\.model\..*lora_.\.weight' holds a weight of magnitude .* "
                       r"beyond the range of float16"):
        export_checkpoint(run, tmp_path / "o", peft=True, dtype="float16")
    assert list(tmp_path.iterdir()) == []  # neither --out nor a staging directory
    export_checkpoint(run, tmp_path / "o", peft=True, dtype="bfloat16")  # in bfloat16's range


def test_resume_with_another_lora_rank_names_the_flag(lora_run: tuple[Path, Path, Path]) -> None:
    """Settings are compared before parameter shapes, so the flag that changed them is named
    (it said "parameter shapes differ (28 arrays …)")."""
    from jaxrl_sym.rl.run.train import train

    run, src, tasks = lora_run
    with pytest.raises(InputError, match=r"--lora-rank.*2.*4"):
        train("grpo", f"jsonl:{tasks}", 2, model_dir=str(src), checkpoint_dir=str(run),
              prompts_per_step=2, group_size=2, progress=False, eval_prompts=0, seed=3,
              config={"max_new_tokens": 4, "lr": 1e-2}, lora={"rank": 4, "alpha": 4.0},
              resume=True)


def test_an_edited_jsonl_task_file_is_named_on_resume(lora_run: tuple[Path, Path, Path],
                                                      tmp_path: Path) -> None:
    """The checkpoint records a digest of the ``jsonl:`` task file's contents: the same path
    holding other problems is another run's data (it was trained on without a word), named on
    ``--resume``."""
    from jaxrl_sym.rl.run.train import ResumeMismatchError, train

    run, src, tasks = lora_run
    keep = tasks.read_text()
    kw = dict(model_dir=str(src), checkpoint_dir=str(run), prompts_per_step=2, group_size=2,
              progress=False, eval_prompts=0, seed=3,
              config={"max_new_tokens": 4, "lr": 1e-2}, lora={"rank": 2, "alpha": 4.0})
    try:
        tasks.write_text(keep + json.dumps({"prompt": "What is 40 + 2?", "answer": 42}) + "\n")
        with pytest.raises(ResumeMismatchError,
                           match=r"--task jsonl:FILE \(its contents\) \(task_sha256\)"):
            train("grpo", f"jsonl:{tasks}", 2, resume=True, **kw)
    finally:
        tasks.write_text(keep)


def test_a_base_whose_weights_changed_is_refused_on_resume_and_merged_export(
        lora_run: tuple[Path, Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint records the digest of the base weights the run loaded: one weight of the
    base changed afterwards (same path, same shapes) is named on ``--resume`` and refused by a
    merged export (it would merge the adapters into weights nobody trained them on); the
    ``--peft`` adapters alone still export."""
    from safetensors.numpy import load_file, save_file

    from jaxrl_sym.rl.run.train import ResumeMismatchError, train

    run, src, tasks = lora_run
    weights, keep = src / "model.safetensors", tmp_path / "keep.safetensors"
    shutil.copyfile(weights, keep)
    try:
        tensors = load_file(weights)
        name = sorted(tensors)[0]
        tensors[name] = (tensors[name] * 1.5).astype(tensors[name].dtype)
        save_file(tensors, weights, metadata={"format": "pt"})
        with pytest.raises(ResumeMismatchError, match=r"--model \(its weights\) \(base_sha256\)"):
            train("grpo", f"jsonl:{tasks}", 2, model_dir=str(src), checkpoint_dir=str(run),
                  prompts_per_step=2, group_size=2, progress=False, eval_prompts=0, seed=3,
                  config={"max_new_tokens": 4, "lr": 1e-2}, lora={"rank": 2, "alpha": 4.0},
                  resume=True)
        assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "o")]) == 2
        assert "holds other weights than the run trained on" in capsys.readouterr().err
        assert main(["export", "--checkpoint-dir", str(run), "--out", str(tmp_path / "p"),
                     "--peft"]) == 0
    finally:
        shutil.copyfile(keep, weights)


# --------------------------------------------------------------------------- bench flags

# one child runs every case (one interpreter start): each line is the case's exit code,
# whether JAX was imported, and stderr's last line
_BENCH = """
import contextlib, io, json, sys
from bench.__main__ import main
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as e:
        code = e.code
    lines = err.getvalue().strip().splitlines()
    print(json.dumps([code, "jax" in sys.modules, lines[-1] if lines else ""]))
"""
BENCH_CASES = {
    "prompts-0": (["--prompts", "0"], "argument --prompts: must be >= 1, got 0"),
    "prompts-negative": (["--prompts", "-4"], "argument --prompts: must be >= 1, got -4"),
    "group-1": (["--group", "1"], "argument --group: must be >= 2, got 1 (GRPO compares"),
    "scale-0": (["--scale", "0"], "argument --scale: must be >= 1, got 0"),
    "steps-negative": (["--steps", "-1"], "argument --steps: must be >= 1, got -1"),
    "steps-text": (["--steps", "two"], "argument --steps: must be an integer >= 1, got 'two'"),
    "engine-malformed": (["--engine", "{min_capacity: 16}"], "argument --engine: is not valid "
                                                              "JSON"),
    "engine-list": (["--engine", "[16]"], "argument --engine: must be a JSON object"),
    "engine-unknown-field": (["--engine", '{"capacity": 16}'],
                             "argument --engine: EngineOptions has no field capacity"),
    "engine-bad-value": (["--engine", '{"min_capacity": 0}'],
                         "argument --engine: EngineOptions.min_capacity=0"),
    "precision-unknown": (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    "systems-unknown": (["--systems", "sym,fast"], "argument --systems: unknown system 'fast'"),
    "seed-negative": (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    "sigma-nan": (["--sigma", "nan"], "argument --sigma: must be finite and >= 0, got nan"),
    "lora-rank-0": (["--lora-rank", "0"], "argument --lora-rank: must be >= 1, got 0; omit "
                                          "--lora-rank to measure full fine-tuning"),
    "lora-rank-negative": (["--lora-rank", "-8"], "argument --lora-rank: must be >= 1, got -8; "
                                                  "omit --lora-rank"),
}


@pytest.fixture(scope="module")
def bench_results() -> dict[str, list[Any]]:
    cases = [["rlft_step", *argv] for argv, _ in BENCH_CASES.values()]
    proc = subprocess.run([sys.executable, "-c", _BENCH, json.dumps(cases)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    return dict(zip(BENCH_CASES, rows, strict=True))


@pytest.mark.parametrize("case", list(BENCH_CASES))
def test_bench_bad_flag_refused_before_jax(case: str, bench_results: dict[str, list[Any]]
                                           ) -> None:
    code, jax_imported, last = bench_results[case]
    assert code == 2 and not jax_imported, (case, last)
    assert last.startswith("python -m bench rlft_step: error: ") and BENCH_CASES[case][1] in last


# --------------------------------------------------------------------------- permissions


def _chmod_denies(tmp: Path) -> bool:
    """Whether chmod 000 stops this user reading (not as root: CAP_DAC_OVERRIDE reads on)."""
    probe = tmp / "probe"
    probe.write_text("x")
    probe.chmod(0)
    try:
        probe.read_text()
    except PermissionError:
        return True
    finally:
        probe.chmod(0o600)
    return False


@pytest.fixture
def deny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``deny(path, listable=False)``: make ``path`` unreadable — a file: mode 000; a directory:
    000, or with ``listable`` r-- (its names can be listed, nothing inside opened) — with chmod
    where it denies, else by raising PermissionError where this process would list, stat inside
    or open it, as the kernel would."""
    real = _chmod_denies(tmp_path)
    unlistable: list[str] = []
    closed: list[str] = []  # directories: nothing inside may be stat'ed or opened
    files: list[str] = []
    chmodded: list[Path] = []

    def refuse(path: Any, opening: bool) -> None:
        """Opening a 000 file, or stat'ing or opening anything inside a closed directory (a
        000 file itself can still be stat'ed: that needs x on its directory, not r on it)."""
        p = os.path.abspath(os.fspath(path)) if isinstance(path, str | os.PathLike) else ""
        if (opening and p in files) or any(p.startswith(d + os.sep) for d in closed):
            raise PermissionError(13, "Permission denied", p)

    if not real:
        listdir, stat, open_ = os.listdir, os.stat, io.open

        def listdir_denied(path: Any = ".") -> list[str]:
            p = os.path.abspath(os.fspath(path))
            if p in unlistable:
                raise PermissionError(13, "Permission denied", p)
            return listdir(path)

        def stat_denied(path: Any, *args: Any, **kw: Any) -> Any:
            refuse(path, opening=False)
            return stat(path, *args, **kw)

        def open_denied(file: Any, *args: Any, **kw: Any) -> Any:
            refuse(file, opening=True)
            return open_(file, *args, **kw)

        monkeypatch.setattr(os, "listdir", listdir_denied)
        monkeypatch.setattr(os, "stat", stat_denied)
        monkeypatch.setattr(io, "open", open_denied)
        monkeypatch.setattr(builtins, "open", open_denied)

    def add(path: Path, listable: bool = False) -> None:
        is_dir = path.is_dir()
        where = os.path.abspath(path)
        if not is_dir:
            files.append(where)
        else:
            closed.append(where)
            if not listable:
                unlistable.append(where)
        if real:
            path.chmod(0o444 if is_dir and listable else 0)
            chmodded.append(path)

    yield add
    for p in chmodded:
        p.chmod(0o700)


@pytest.fixture
def model_copy(tmp_path: Path) -> Path:
    src = tmp_path / "model"
    shutil.copytree(TEXT, src)
    return src


NEEDS_DIR = "needs read and execute permission (r-x) on that directory"
NEEDS_FILE = "needs read permission (r) on that file"


NEEDS_ENTRY = "execute permission (x) on every directory above it"


@pytest.mark.parametrize("cmd", ["export", "generate"])
@pytest.mark.parametrize("listable", [False, True], ids=["mode-000", "mode-r--"])
def test_unreadable_model_directory_named_by_the_cli(
        cmd: str, listable: bool, model_copy: Path, deny: Any, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """000: ``os.listdir`` raised a PermissionError traceback; r--: its config.json could not
    be seen, and the directory was called "not a Hugging Face checkpoint directory"."""
    deny(model_copy, listable=listable)
    extra = ["--out", str(tmp_path / "o")] if cmd == "export" else ["--prompt", "hi"]
    rc = main([cmd, "--model", str(model_copy), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    where, needs = ((f"{model_copy / 'config.json'}", NEEDS_ENTRY) if listable
                    else (f"{model_copy};", NEEDS_DIR))
    assert f"cannot read --model {model_copy}: permission denied on {where}" in err, err
    assert needs in err, err


def test_unreadable_model_directory_named_by_train_setup(model_copy: Path, deny: Any) -> None:
    """r--: ``Path.is_file`` said "no config.json" for a directory that has one."""
    from jaxrl_sym.rl.run.pretrained import setup

    deny(model_copy, listable=True)
    with pytest.raises(InputError, match=re.escape(
            f"cannot read --model {model_copy}: permission denied on {model_copy / 'config.json'}"
            f"; loading it needs read permission (r) on that file and {NEEDS_ENTRY}")):
        setup(str(model_copy), "word-problems")


def test_unreadable_config_file_named(model_copy: Path, deny: Any, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    from jaxrl_sym.models.hf.text import read_json

    config = model_copy / "config.json"
    deny(config)
    rc = main(["export", "--model", str(model_copy), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and f"permission denied on {config}" in err and NEEDS_FILE in err, err
    with pytest.raises(InputError, match=re.escape(
            f"cannot read config {config}: permission denied on {config}; loading it "
            f"{NEEDS_FILE}")):
        read_json(config, "config")


def test_unreadable_tokenizer_file_named(model_copy: Path, deny: Any) -> None:
    from jaxrl_sym.models.hf.text import HFText

    tok = model_copy / "tokenizer.json"
    deny(tok)
    with pytest.raises(InputError, match=re.escape(
            f"cannot read tokenizer {tok}: permission denied on {tok}; loading it "
            f"{NEEDS_FILE}")):
        HFText(model_copy)


def test_lora_targets_no_peft_adapter_can_name_are_reported_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """LoRA on the embedding trains and exports merged, but ``export --peft`` refused it only
    after the run: the warning now comes when the model loads, before any step (issue 50)."""
    import logging

    from jaxrl_sym.rl.run.pretrained import setup
    from jaxrl_sym.weights.lora_config import LoraConfig

    tasks = tmp_path / "sums.jsonl"
    tasks.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    run = setup(str(TEXT), f"jsonl:{tasks}", max_new_tokens=4)
    with caplog.at_level(logging.WARNING):
        run.load_model(LoraConfig(rank=2, targets=r".*(embed_tokens\.embedding|q_proj\.kernel)"))
    text = caplog.text
    assert "--lora-targets matches 1 weight(s) that are not Linear layers" in text, text
    assert "model.embed_tokens.embedding" in text and "export --peft" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run.load_model(LoraConfig(rank=2))  # all-linear: every target a PEFT module
    assert "not Linear layers" not in caplog.text
