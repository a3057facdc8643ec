"""A full disk never loses a run or leaves a broken file (issue 29): on a filesystem with no
space left, an export is refused naming its output with nothing left behind, a plot that
cannot be written comes after the run's summary (and leaves no empty image), and a metrics
line that cannot be appended stops the run naming ``--metrics`` with the step saved for
``--resume``. The full filesystem is a 64 kB tmpfs (skipped where mounting is not allowed).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from jaxrl_sym.errors import InputError

pytestmark = pytest.mark.share_compiles
QWEN = Path(__file__).parent / "fixtures" / "hf" / "qwen2_tied"
RUN = ["train", "--task", "reverse", "--steps", "2", "--prompts", "2", "--group", "2",
       "--eval-prompts", "4", "--no-progress", "--json"]


@contextmanager
def _tmpfs(where: Path, size_kb: int, free_kb: int) -> Iterator[Path]:
    """A ``size_kb`` tmpfs mounted at ``where``, filled to ``free_kb`` (0: full), unmounted
    after; skips the test where mounting is not allowed."""
    where.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs",
                            str(where)], capture_output=True)
    if mount.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        fd = os.open(where / "ballast", os.O_WRONLY | os.O_CREAT)
        try:
            while os.fstat(fd).st_size < (size_kb - free_kb) * 1024 or not free_kb:
                if not os.write(fd, b"\0" * 512):
                    break
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False, capture_output=True)


@pytest.fixture
def full_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a filesystem with no space left."""
    with _tmpfs(tmp_path / "full", 64, 0) as where:
        yield where


@pytest.fixture
def nearly_full_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory with 16 kB left: room for small files, not for a checkpoint."""
    with _tmpfs(tmp_path / "nearly", 256, 16) as where:
        yield where


def _train(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, str]:
    from jaxrl_sym.cli import main

    rc = main([*RUN, *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_an_export_to_a_full_disk_is_refused_and_leaves_nothing(full_dir: Path) -> None:
    from jaxrl_sym.models.hf import load_pretrained
    from jaxrl_sym.models.hf.export import export_pretrained

    model, _, _ = load_pretrained(QWEN)
    with pytest.raises(InputError, match=r"out_dir .*full/out: writing the checkpoint failed "
                                         r"\(No space left on device\); nothing was written"):
        export_pretrained(model, full_dir / "out", source_dir=QWEN)
    assert sorted(p.name for p in full_dir.iterdir()) == ["ballast"]


def test_a_plot_that_cannot_be_written_comes_after_the_summary(
        full_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _train(capsys, "--plot", str(full_dir / "run.png"))
    assert rc == 1
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2  # the run is not lost
    assert f"error: --plot: could not write {full_dir / 'run.png'} (No space left on device)" \
        in err
    assert sorted(p.name for p in full_dir.iterdir()) == ["ballast"]  # no empty image


def test_metrics_that_cannot_be_written_stop_the_run_saved_for_resume(
        full_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "run"
    rc, _, err = _train(capsys, "--metrics", str(full_dir / "m.jsonl"),
                        "--checkpoint-dir", str(ckpt))
    assert rc == 2
    assert (f"--metrics {full_dir / 'm.jsonl'}: could not append step 1 (No space left on "
            f"device); the run stopped after step 1, saved in {ckpt}") in err
    rc, out, _ = _train(capsys, "--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir",
                        str(ckpt), "--resume")
    summary = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and summary["steps"] == 2 and summary["resumed_from"] == 1


def test_a_checkpoint_dir_on_a_full_disk_is_refused_before_any_step(
        full_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _train(capsys, "--checkpoint-dir", str(full_dir / "run"))
    assert rc == 2 and (f"--checkpoint-dir {full_dir / 'run'}: cannot write its lock file (No "
                        "space left on device)") in err


def test_a_checkpoint_that_cannot_be_saved_names_the_directory_and_step(
        nearly_full_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before orbax starts (whose threads would print pages of their own errors)."""
    rc, _, err = _train(capsys, "--checkpoint-dir", str(nearly_full_dir / "run"))
    assert rc == 2
    assert f"error: --checkpoint-dir {nearly_full_dir / 'run'}: step 2 needs at least " in err
    assert "MB are free; nothing was written, the steps already there are untouched" in err
    assert "Traceback" not in err and "orbax" not in err


def test_a_save_that_fails_anyway_names_the_directory_and_step(
        nearly_full_dir: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk filling between the space check and the write (another process): orbax's
    error, wrapped in its own types, still ends as one error naming the directory and step."""
    from jaxrl_sym.rl.run.checkpoint import Checkpointer

    monkeypatch.setattr(Checkpointer, "_check_space", lambda self, step, state: None)
    rc, _, err = _train(capsys, "--checkpoint-dir", str(nearly_full_dir / "run"))
    assert rc == 2
    assert f"error: --checkpoint-dir {nearly_full_dir / 'run'}: saving step 2 failed (" in err
    assert err.strip().splitlines()[-1].startswith("error: --checkpoint-dir")
