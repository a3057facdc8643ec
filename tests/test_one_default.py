"""One default per knob (issue 48 item 5): a knob's default lives in its config dataclass, and
``jaxrl-sym train``'s flags and :func:`jaxrl_sym.rl.run.train.train`'s keywords read it from there.

Why: the same knob was given a default in up to three places (the dataclass field, the flag,
``train()``'s signature), and they drifted. The test walks the dataclasses, the CLI's parser and
``train()``'s signature: every flag or keyword that sets a field has that field's default (or
None: "the library decides"), and its source spells no literal of its own — a literal equal to
the field's default today is the next drift. Every field has at most one flag.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest

from jaxrl_sym.rl.config import CheckpointConfig, PartialConfig, RLConfig, RunConfig
from jaxrl_sym.rl.run.trackers import ReportConfig

ROOT = Path(__file__).parent.parent
# flags that set a field of a config other than RLConfig/RunConfig (train.FLAGS names those)
OTHER_FLAGS: dict[str, tuple[type, str]] = {
    "--checkpoint-dir": (CheckpointConfig, "directory"),
    "--checkpoint-every": (CheckpointConfig, "every"), "--keep": (CheckpointConfig, "keep"),
    "--partial-segment": (PartialConfig, "segment"),
    "--partial-max-carry": (PartialConfig, "max_carry"),
    "--log-completions-every": (ReportConfig, "completions_every"),
    "--log-dir": (ReportConfig, "log_dir"),
}
# train() keywords named otherwise than their field
OTHER_KEYWORDS: dict[str, tuple[type, str]] = {
    "checkpoint_dir": (CheckpointConfig, "directory"),
    "checkpoint_every": (CheckpointConfig, "every"), "keep": (CheckpointConfig, "keep"),
}


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def _owners() -> dict[str, tuple[type, str]]:
    """flag -> (dataclass, field) for every flag that sets one config field."""
    from jaxrl_sym.rl.run.train import FLAGS

    out = dict(OTHER_FLAGS)
    for name, flag in FLAGS.items():
        if "/" in flag or " " in flag:  # several flags, or a file's contents
            continue
        for cls in (RLConfig, RunConfig):
            if name in {f.name for f in dataclasses.fields(cls)}:
                out[flag] = (cls, name)
    return out


def _train_parser() -> argparse.ArgumentParser:
    from jaxrl_sym.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _literal(node: ast.expr | None) -> bool:
    """A default spelled as a constant of its own (None/False say "unset", not a value)."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and node.value not in (None, False)


def test_every_flag_that_sets_a_field_has_the_fields_default() -> None:
    actions = {o: a for a in _train_parser()._actions for o in a.option_strings}
    owners = _owners()
    assert len(owners) >= 30
    for flag, (cls, name) in owners.items():
        assert flag in actions, f"{flag} (for {cls.__name__}.{name}) is not a train flag"
        default, field = actions[flag].default, _field(cls, name)
        if default is None or isinstance(actions[flag], argparse._StoreTrueAction):
            continue
        assert default == field.default and type(default) is type(field.default), (
            f"{flag} defaults to {default!r}, {cls.__name__}.{name} to {field.default!r}")


def test_no_flag_spells_a_default_of_its_own() -> None:
    owners = _owners()
    bad = []
    tree = ast.parse((ROOT / "jaxrl_sym/rl/run/cli.py").read_text())
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
                and node.args and isinstance(node.args[0], ast.Constant)):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        if node.args[0].value in owners and _literal(kw.get("default")):
            bad.append(f"{node.args[0].value}: default={ast.unparse(kw['default'])}")
    assert not bad, "flags with a default of their own (read it from the dataclass): " + str(bad)


def test_train_keywords_read_their_fields_defaults() -> None:
    from jaxrl_sym.rl.run import train as train_module

    sig = inspect.signature(train_module.train)
    fn = next(n for n in ast.walk(ast.parse(inspect.getsource(train_module)))
              if isinstance(n, ast.FunctionDef) and n.name == "train")
    args = [*fn.args.args, *fn.args.kwonlyargs]
    defaults = dict(zip([a.arg for a in fn.args.args][-len(fn.args.defaults):],
                        fn.args.defaults, strict=True))
    defaults |= {a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True)}
    checked = 0
    for a in args:
        owner = OTHER_KEYWORDS.get(a.arg) or next(
            ((cls, a.arg) for cls in (RLConfig, RunConfig)
             if a.arg in {f.name for f in dataclasses.fields(cls)}), None)
        if owner is None:
            continue
        cls, name = owner
        field = _field(cls, name)
        value = sig.parameters[a.arg].default
        assert value is None or value == field.default, (a.arg, value, field.default)
        assert not _literal(defaults[a.arg]), (
            f"train({a.arg}={ast.unparse(defaults[a.arg])}): read {cls.__name__}.{name}")
        checked += 1
    assert checked >= 10


def test_each_field_has_at_most_one_flag() -> None:
    owners = _owners()
    seen: dict[tuple[str, str], str] = {}
    for flag, (cls, name) in owners.items():
        key = (cls.__name__, name)
        assert key not in seen, f"{cls.__name__}.{name} has two flags: {seen[key]}, {flag}"
        seen[key] = flag


@pytest.mark.parametrize("cls", [RLConfig, RunConfig, CheckpointConfig, PartialConfig])
def test_a_config_built_without_arguments_is_valid(cls: type) -> None:
    """Each dataclass's defaults are a valid config (the one default is a usable one)."""
    if cls is PartialConfig:
        cls(0.5)  # its fraction has no default: it is the switch
    else:
        cls()
