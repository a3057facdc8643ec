"""Errors of the RL layer. Both derive from :class:`~jaxrl_sym.errors.InputError` (so from
``SymError``): callers that already catch the library's input errors catch these too."""

from __future__ import annotations

from jaxrl_sym.errors import InputError


class RewardError(InputError):
    """The user's reward (or metric) function failed or returned something that is not one
    finite number for a sample. The message names the sample index; the step was not applied."""

    def __init__(self, message: str, sample: int) -> None:
        super().__init__(message)
        self.sample = sample


class CheckpointError(InputError):
    """A checkpoint cannot be resumed by this run (different model, algorithm or task)."""
