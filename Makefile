# Two entry points; both set up .venv first (scripts/bootstrap.sh).
.PHONY: setup demo test lint

setup:
	@scripts/bootstrap.sh

# The main job: a small padding-vs-symbolic decoding comparison on CPU (same model, same weights).
demo: setup
	.venv/bin/jaxrl-sym decode --attention window --window 32 --tokens 256 --batch 4 --systems sym,padded

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -p no:cacheprovider tests

lint: setup
	.venv/bin/ruff check .
