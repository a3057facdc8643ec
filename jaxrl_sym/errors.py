"""Errors that name the user's thing and say what to do.

Every error the library raises for bad input derives from :class:`SymError`, so callers can catch
one type; each message names the offending primitive / dimension / argument and, where the tracer
knows it, the user's source line (taken from the jaxpr equation's ``source_info``).
"""

from __future__ import annotations


class SymError(ValueError):
    """Base class for jaxrl_sym input errors."""


class UnsupportedPrimitiveError(SymError):
    """A primitive touches the sequence dimension and the tracer has no rule for it."""


class NonCausalMixingError(SymError):
    """An op mixes positions along the sequence axis in a way that cannot run incrementally."""


class SymbolError(SymError):
    """Symbols/dimensions are inconsistent (mismatched, unknown, or violating a constraint)."""


class PatternError(SymError):
    """An attention pattern was given invalid parameters (e.g. window < 1)."""


class InputError(SymError):
    """A runtime input (prompt, limit, dtype, shape) is invalid."""


def source_line(eqn: object, *, installed: bool = True) -> str:
    """Best-effort 'file:line (function)' of the user code that produced a jaxpr equation.

    JAX's own frames are skipped, and so are this library's op layer (``jaxrl_sym/ops/``): for
    the attention primitive the innermost non-JAX frame is ``attend`` itself, and the user needs
    the line in their model that called it. ``installed=False`` also skips installed packages
    (``site-packages``: Flax's ``Embed``), for a message about the model's own line.
    """
    try:
        import os

        from jax._src import source_info_util  # private but stable for 0.11; one place only

        ops_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops") + os.sep
        si = eqn.source_info  # type: ignore[attr-defined]
        for frame in source_info_util.user_frames(si.traceback):
            path = os.path.abspath(frame.file_name)
            if not path.startswith(ops_dir) and (installed or "site-packages" not in path):
                return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
        return "<unknown source>"
    except Exception:  # pragma: no cover - defensive: never fail while building an error
        return "<unknown source>"
