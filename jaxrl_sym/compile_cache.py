"""JAX's persistent compilation cache, on by default for every ``jaxrl-sym`` process.

Why: the symbolic runtime compiles a handful of programs per shape bucket (prefill, decode
tiles, growth, compaction, the packed forward); on a warm cache a second process loads them from
disk instead of recompiling — which is most of a short run's first-call time. JAX owns the
cache; this module only chooses where it lives and makes every program eligible (JAX's default
skips programs that compiled in under a second, which is most of ours on CPU).

Where: ``$JAXRL_SYM_COMPILE_CACHE`` if set (a directory, or ``off``), else
``$XDG_CACHE_HOME/jaxrl_sym/xla`` (``~/.cache/jaxrl_sym/xla``). A user who already set JAX's own
``JAX_COMPILATION_CACHE_DIR`` keeps it. The CLI sets the environment before JAX is imported, so
the decode and estimate child processes inherit it; library users call :func:`enable`.

This module imports JAX only inside :func:`enable` (the CLI must stay JAX-free at import).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

ENV = "JAXRL_SYM_COMPILE_CACHE"
_JAX_DIR = "JAX_COMPILATION_CACHE_DIR"
_JAX_THRESHOLDS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def default_dir(environ: MutableMapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/jaxrl_sym/xla``, or ``~/.cache/jaxrl_sym/xla``."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxrl_sym" / "xla"


def chosen_dir(environ: MutableMapping[str, str] | None = None) -> Path | None:
    """The cache directory this process should use, or None when the user turned it off."""
    env = os.environ if environ is None else environ
    value = env.get(ENV, "").strip()
    if value.lower() in ("off", "0", "false", "none"):
        return None
    if env.get(_JAX_DIR):
        return Path(env[_JAX_DIR])
    return Path(value).expanduser() if value else default_dir(env)


def configure_environment(environ: MutableMapping[str, str] | None = None) -> Path | None:
    """Set JAX's cache variables in ``environ`` (default: this process's) unless the user set
    them or turned the cache off; call before JAX is imported. Returns the directory used."""
    env = os.environ if environ is None else environ
    path = chosen_dir(env)
    if path is None:
        return None
    env.setdefault(_JAX_DIR, str(path))
    for key, value in _JAX_THRESHOLDS.items():
        env.setdefault(key, value)
    return path


def enable(path: str | os.PathLike[str] | None = None) -> Path:
    """Turn the persistent cache on for this process (library use, e.g. in a notebook).

    Call it before the first compile: JAX initialises its cache once per process.
    """
    import jax

    where = Path(path).expanduser() if path is not None else (chosen_dir() or default_dir())
    jax.config.update("jax_compilation_cache_dir", str(where))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where
