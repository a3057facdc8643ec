"""Test-wide settings.

On a GPU, XLA's default float32 matmul precision is TF32 (about 1e-3 relative error), so the
XLA oracles these tests compare against (padded baseline, masked reference) would be less exact
than the Triton kernels, which use ``tf32x3`` (~fp32) for fp32 operands; the first H100 run failed
``test_gpu_packed_attention_fwd_bwd[f32]`` and the triton runtime test at ~2e-3 for that reason
alone. Oracles must be fp32-exact, so GPU runs of the suite use ``"highest"``. On CPU XLA already
computes fp32 dots in fp32 and nothing changes.

On a CPU-only machine (CI) XLA compiles with LLVM at -O0 and without its expensive passes
(:data:`FAST_COMPILE`): the suite is compile-bound (tiny models, a few steps, many shapes), and
this cuts its CPU time by ~30-45% per file (measured: test_oracle_plain_model 101 -> 56 s,
test_model 64 -> 43 s, the learning run 187 -> 131 s). The HLO XLA optimises is the same; only
machine code differs, so results may differ in the last bits from a default build, and every
test compares programs built the same way (or to oracles with tolerances). Child processes
inherit it through the environment. ``JAXRL_SYM_TEST_XLA_DEFAULTS=1`` runs the suite with XLA's
defaults.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import shards
from hypothesis import settings

# CLI processes the tests start would share the user's persistent compilation cache and report
# compile counts that depend on earlier runs; tests that need the cache set their own directory.
os.environ.setdefault("JAXRL_SYM_COMPILE_CACHE", "off")

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _cpu_only() -> bool:
    """No GPU runtime installed or asked for (decided before JAX starts its backends)."""
    import importlib.util

    if any(p in os.environ.get("JAX_PLATFORMS", "") for p in ("cuda", "gpu", "rocm")):
        return False
    return not any(importlib.util.find_spec(m) for m in (
        "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin"))


if os.environ.get("JAXRL_SYM_TEST_XLA_DEFAULTS") != "1" and _cpu_only() and \
        FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402  (after XLA_FLAGS: the CPU client reads them when it starts)

# Hypothesis' 200 ms deadline measures wall time, which a loaded 2-core CI machine (its workers
# compiling at once) blows through on tests that never set their own; the example counts stay
# the tests' own (an explicit @settings wins over a profile).
settings.register_profile("ci", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", SHARE_COMPILES_DOC)
    if any(d.platform == "gpu" for d in jax.devices()):
        jax.config.update("jax_default_matmul_precision", "highest")


SHARE_COMPILES_DOC = (
    "share_compiles: (module-level pytestmark) the module's programs go through JAX's "
    "persistent compilation cache in a directory of this test session, so a program another "
    "trainer or engine of the session already compiled is loaded, not compiled again. Only for "
    "modules that never count compiles or compile time (xla_compiles, compile_cache_hits, "
    "compile_seconds): there a cache hit would hide a compile.")


@pytest.fixture(scope="module", autouse=True)
def _share_compiles(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """JAX's persistent cache on for a ``share_compiles`` module, off again after it.

    Why: the library compiles its programs per trainer/engine, so every ``train()`` or
    ``RLTrainer`` of a test recompiles programs an earlier one of the same model and shapes
    compiled (~12 s of CPU each for the tiny task model). The cache directory is this
    session's (per xdist worker), never the user's, so a run starts cold and only shares what
    it compiled itself; executables are the same, so are the results. Module-scoped and
    autouse, so it is on before the module's own module fixtures run.
    """
    if request.node.get_closest_marker("share_compiles") is None:
        yield
        return
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    before = {k: getattr(jax.config, k) for k in keys}
    where = tmp_path_factory.getbasetemp() / "shared_compiles"
    where.mkdir(exist_ok=True)
    for k, v in zip(keys, (str(where), 0.0, 0), strict=True):
        jax.config.update(k, v)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


@pytest.fixture
def child_compile_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """Environment variables that give a child process (a CLI run, a ``python -c`` child) the
    persistent compilation cache of a ``share_compiles`` module, so a child that runs the
    programs the test process or an earlier child compiled loads them instead of compiling them
    again (most of a small training child's time). Empty outside such modules: there a child
    compiles from scratch, as compile-counting tests need."""
    if request.node.get_closest_marker("share_compiles") is None:
        return {}
    from jaxrl_sym import compile_cache

    env = {compile_cache.ENV: str(jax.config.jax_compilation_cache_dir)}
    compile_cache.configure_environment(env)  # the library's own variables and thresholds
    return env


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


# The longest files first: `make test` gives whole files to its workers (pytest-xdist
# --dist loadfile --no-loadscope-reorder), and a long file started last would run alone at the
# end. Without --no-loadscope-reorder xdist sorts files by their number of tests instead, which
# put the one-test learning run last. Measured with --durations on the CI machine, except the
# notebooks (each a kernel of its own) and the plain-model oracle (~90 s of CPU on its own),
# placed by estimate; the order only changes scheduling, never what runs.
LONGEST_FIRST = ("test_long_packed_update.py", "test_sharding.py", "test_learning.py",
                 "test_gpu_plan.py", "test_notebooks.py", "test_pallas_decode.py",
                 "test_hf_families.py", "test_tunix.py", "test_oracle_plain_model.py",
                 "test_prefill.py", "test_rl_train.py", "test_hf_train.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: file order otherwise
    _take_shard(config, items)


def _shard() -> shards.Shard:
    try:
        return shards.Shard.parse(os.environ.get(shards.ENV))
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


def _module_fixture_users(items: list[pytest.Item]) -> list[list[str]]:
    """The tests of each module-, class- or package-scoped fixture defined in a test module:
    they rotate together, since the fixture runs wherever one of them runs."""
    users: dict[tuple[str, str], list[str]] = {}
    for it in items:
        info = getattr(it, "_fixtureinfo", None)  # pytest's own record of the item's fixtures
        for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
            d = defs[-1]
            if d.scope != "function" and d.baseid.endswith(".py"):
                users.setdefault((d.baseid, name), []).append(it.nodeid)
    return list(users.values())


def _take_shard(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the heavy tests of other shards (``tests/shards.py``: CI's rotation)."""
    shard = _shard()
    if shard.count == 0:
        return
    skipped = shards.Table.load().skipped((it.nodeid for it in items), shard,
                                          _module_fixture_users(items))
    if skipped:
        config.hook.pytest_deselected(items=[it for it in items if it.nodeid in skipped])
        items[:] = [it for it in items if it.nodeid not in skipped]


def pytest_report_header() -> str:
    return f"jaxrl_sym: {_shard().describe()}"
