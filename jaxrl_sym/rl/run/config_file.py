"""``train --config run.toml`` and ``--print-config``: a run described in a file.

The file's keys are the command's flag names (``lora-rank = 16``; ``lora_rank`` too), its values
what the flag takes (a list for a repeatable flag such as ``reward``, true/false for a switch).
A flag on the command line overrides the file's value. Why the flags and not a second schema:
one name per knob — the file is read into the same parser, so every check and default is the
flag's, and ``--print-config`` writes the effective values under the same names (only those that
are set: TOML has no null, and an unset flag means its default).
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomli_w

from jaxrl_sym.errors import InputError

NOT_IN_FILES = ("config", "print_config", "help")  # the file itself, and what ends the command


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Long-option actions by their key (the flag without ``--``)."""
    out = {}
    for a in parser._actions:
        longs = [s for s in a.option_strings if s.startswith("--") and not s.startswith("--no-")]
        if longs and a.dest not in NOT_IN_FILES:
            out[longs[0][2:]] = a
    return out


def _given(argv: Sequence[str]) -> set[str]:
    """The long flags on the command line (``--x`` and ``--x=v``)."""
    return {t[2:].split("=", 1)[0] for t in argv if t.startswith("--")}


def _tokens(key: str, action: argparse.Action, value: Any, where: str) -> list[str]:
    flag = f"--{key}"
    if isinstance(action, argparse.BooleanOptionalAction):
        _expect(isinstance(value, bool), where, "true or false")
        return [flag if value else f"--no-{key}"]
    if isinstance(action, argparse._StoreTrueAction):
        _expect(isinstance(value, bool), where, "true or false")
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction):
        values = value if isinstance(value, list) else [value]
        return [t for v in values for t in (flag, _checked(action, _scalar(v, where), where))]
    return [flag, _checked(action, _scalar(value, where), where)]


def _checked(action: argparse.Action, token: str, where: str) -> str:
    """``token`` as the flag's own type and choices take it, else an error naming the file's
    key (argparse would name the flag alone, and the user typed no flag)."""
    try:
        value = action.type(token) if callable(action.type) else token
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        kind = getattr(action.type, "__name__", "value")
        raise InputError(f"{where}: {token!r} is not a valid {kind}") from None
    if action.choices is not None and value not in action.choices:
        raise InputError(f"{where}: {token!r} is not one of "
                         f"{', '.join(map(str, action.choices))}")
    return token


def _scalar(value: Any, where: str) -> str:
    if isinstance(value, list):  # e.g. reward-weights = [1, 0.5] for "1,0.5"
        return ",".join(_scalar(v, where) for v in value)
    _expect(isinstance(value, str | int | float) and not isinstance(value, bool), where,
            "a string or a number")
    return str(value)


def _expect(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise InputError(f"{where}: give {what}")


def with_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with the ``--config FILE`` values before it (so the command line wins): a key
    that is not a flag of the command, a value of the wrong kind or a file that is not TOML is
    an error naming the file and the key."""
    argv = list(argv)
    path = next((argv[i + 1] for i, t in enumerate(argv[:-1]) if t == "--config"), None)
    path = path or next((t.split("=", 1)[1] for t in argv if t.startswith("--config=")), None)
    if path is None:
        return argv
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise InputError(f"--config {path}: cannot be read ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"--config {path}: not a TOML file ({e})") from None
    actions, given, front = _actions(parser), _given(argv), []
    for raw, value in data.items():
        key = raw.replace("_", "-")
        if key not in actions:
            near = difflib.get_close_matches(key, actions, n=1)
            raise InputError(f"--config {path}: {raw!r} is not a flag of this command"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + "; keys are the flag names, e.g. steps = 200")
        if key in given or f"no-{key}" in given:
            continue  # the command line overrides the file
        front += _tokens(key, actions[key], value, f"--config {path}: {raw}")
    return front + argv


def effective(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The values ``args`` holds for the command's flags, as a TOML file ``--config`` reads
    back to the same values (unset flags — None — left out; switches as true/false)."""
    out: dict[str, Any] = {}
    for key, action in _actions(parser).items():
        value = getattr(args, action.dest, None)
        if value is None or (isinstance(action, argparse._StoreTrueAction) and not value):
            continue
        out[key] = value
    return tomli_w.dumps(out)
