# Two entry points; both set up .venv first (scripts/bootstrap.sh).
.PHONY: setup setup-gpu oracle-venv test-deps demo test test-all test-fast lint

setup:
	@scripts/bootstrap.sh

# On a machine with an NVIDIA GPU (CUDA 12 driver): the same .venv plus jax's CUDA plugin and the
# Triton kernels (pyproject's `gpu` extra). Then `backend="auto"` picks the compiled kernels.
setup-gpu: setup
	.venv/bin/python -m pip install -q -e ".[dev,gpu]"

# The main job: a small padding-vs-symbolic decoding comparison on CPU (same model, same weights).
demo: setup
	.venv/bin/jaxrl-sym decode --attention window --window 32 --tokens 256 --batch 4 --systems sym,padded

# Three pytest workers on CI's 2 cores: two left ~15% of the cores idle (subprocess tests wait on
# their children); the times are in bench/results/cpu/suite_time.md. Whole files go to one worker
# so module fixtures are built once. TEST_WORKERS=0 runs in one process.
# --no-loadscope-reorder keeps tests/conftest.py's longest-files-first order: by default xdist
# hands out files with the most tests first, which left the one-test 2-minute learning run and
# the two-test prefill file to start last, alone on one worker.
TEST_WORKERS ?= 3
PYTEST_XDIST = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The transformers + peft oracle (.venv-oracle, Python 3.11: tests/hf_oracle.py). `make test`
# requires it, so its tests fail rather than skip where it is missing; HF_ORACLE=skip opts out.
HF_ORACLE ?= require
oracle-venv:
	@scripts/oracle_venv.sh

# CI's gate (`make test`): every test under 10 s, the oracle files, and one of TEST_SHARDS shards
# of the heavy tests, picked by the commit (scripts/test_shard.sh: its count of commits modulo
# TEST_SHARDS, so consecutive commits walk through all of them; tests/shards.py).
# `make test-all` runs every test; run it before landing. TEST_SHARD=all or i/K overrides.
TEST_SHARDS ?= 12
TEST_SHARD ?= $(shell scripts/test_shard.sh $(TEST_SHARDS))
PYTEST_ALL = JAXRL_SYM_REQUIRE_HF_ORACLE=$(if $(filter skip,$(HF_ORACLE)),0,1) \
	.venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_XDIST) --durations=20 tests

# The two environments are built side by side (two pip installs; suite_time.md has the times).
test-deps:
	@$(MAKE) --no-print-directory -j2 setup $(if $(filter skip,$(HF_ORACLE)),,oracle-venv)

test: test-deps
	.venv/bin/ruff check .
	JAXRL_SYM_TEST_SHARD=$(TEST_SHARD) $(PYTEST_ALL)

test-all: test-deps
	.venv/bin/ruff check .
	JAXRL_SYM_TEST_SHARD=all $(PYTEST_ALL)

# The inner loop: everything but the tests marked slow (each is redundant with a faster test of
# the same property, or a long end-to-end run); `make test-all` runs them all.
test-fast: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_XDIST) -m "not slow" \
		--durations=10 tests

lint: setup
	.venv/bin/ruff check .
