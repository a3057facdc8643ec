"""Test-wide settings.

On a GPU, XLA's default float32 matmul precision is TF32 (about 1e-3 relative error), so the
XLA oracles these tests compare against (padded baseline, masked reference) would be less exact
than the Triton kernels, which use ``tf32x3`` (~fp32) for fp32 operands; the first H100 run failed
``test_gpu_packed_attention_fwd_bwd[f32]`` and the triton runtime test at ~2e-3 for that reason
alone. Oracles must be fp32-exact, so GPU runs of the suite use ``"highest"``. On CPU XLA already
computes fp32 dots in fp32 and nothing changes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# CLI processes the tests start would share the user's persistent compilation cache and report
# compile counts that depend on earlier runs; tests that need the cache set their own directory.
os.environ.setdefault("JAXRL_SYM_COMPILE_CACHE", "off")

import jax
import pytest
from hypothesis import settings

# Hypothesis' 200 ms deadline measures wall time, which a loaded 2-core CI machine (two workers
# compiling at once) blows through on tests that never set their own; the example counts stay
# the tests' own (an explicit @settings wins over a profile).
settings.register_profile("ci", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: object) -> None:
    if any(d.platform == "gpu" for d in jax.devices()):
        jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (as root, mode 0o555 does not stop
    writes, so pseudo filesystems are tried next); skips when there is none."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for cand in (ro, Path("/sys/fs"), Path("/proc")):
        try:
            fd, name = tempfile.mkstemp(dir=cand)
        except OSError:
            return cand
        os.close(fd)
        os.remove(name)
    pytest.skip("no unwritable directory available")


# The longest files first: `make test` gives whole files to two workers (pytest-xdist
# --dist loadfile --no-loadscope-reorder), and a long file started last would run alone at the
# end. Without --no-loadscope-reorder xdist sorts files by their number of tests instead, which
# put the one-test learning run last. Measured with --durations on the CI machine, except the
# notebooks (each a kernel of its own) and the plain-model oracle (~90 s of CPU on its own),
# placed by estimate; the order only changes scheduling, never what runs.
LONGEST_FIRST = ("test_sharding.py", "test_learning.py", "test_notebooks.py",
                 "test_hf_families.py", "test_tunix.py", "test_oracle_plain_model.py",
                 "test_prefill.py", "test_rl_train.py", "test_hf_train.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: file order otherwise
