# Two entry points; both set up .venv first (scripts/bootstrap.sh).
.PHONY: setup demo test test-fast lint

setup:
	@scripts/bootstrap.sh

# The main job: a small padding-vs-symbolic decoding comparison on CPU (same model, same weights).
demo: setup
	.venv/bin/jaxrl-sym decode --attention window --window 32 --tokens 256 --batch 4 --systems sym,padded

# Two pytest workers (CI has 2 cores; most tests are compile-bound, one core each); whole files
# go to one worker so module fixtures are built once. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
		--durations=20 tests

# The inner loop: everything but the tests marked slow (each is redundant with a faster test of
# the same property, or a long end-to-end run); CI runs them all with `make test`.
test-fast: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
		-m "not slow" --durations=10 tests

lint: setup
	.venv/bin/ruff check .
