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


def source_line(eqn: object) -> str:
    """Best-effort 'file:line (function)' of the user code that produced a jaxpr equation."""
    try:
        from jax._src import source_info_util  # private but stable for 0.11; one place only

        si = eqn.source_info  # type: ignore[attr-defined]
        frame = source_info_util.user_frame(si.traceback)
        if frame is None:
            return "<unknown source>"
        return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
    except Exception:  # pragma: no cover - defensive: never fail while building an error
        return "<unknown source>"
