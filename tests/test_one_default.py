"""One name and one default per knob (issue 48 item 5): a knob's default lives in its config
dataclass, and ``jaxrl-sym train``'s flags and :func:`jaxrl_sym.rl.run.train.train`'s keywords
read it from there.

Why: the same knob was given a default in up to three places (the dataclass field, the flag,
``train()``'s signature), and they drifted. The test walks the dataclasses, the CLI's parser and
``train()``'s signature: no knob is defined twice (a field name in two dataclasses has a default
in one at most); every field of RLConfig's parts and of RunConfig has exactly one flag —
generated from the field, its name, default, help and choices read from there — or says why it
has none; a flag or keyword that sets a field has that field's default (or None: "the library
decides"), and its source spells no literal of its own — a literal equal to the field's default
today is the next drift.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from jaxrl_sym.rl.config import (
    GROUPS,
    CheckpointConfig,
    PartialConfig,
    RLConfig,
    RunConfig,
)
from jaxrl_sym.rl.knobs import (
    AlgorithmConfig,
    ExecutionConfig,
    OptimizerConfig,
    choices_of,
    flag_of,
    knob_type,
)
from jaxrl_sym.rl.run.config_flags import RUN_TITLE, UNSET, knob_flags, run_flags
from jaxrl_sym.rl.run.trackers import ReportConfig
from jaxrl_sym.rl.step.sampling import SamplingConfig
from jaxrl_sym.weights.lora_config import LoraConfig

ROOT = Path(__file__).parent.parent
PARTS = tuple(GROUPS.values())
# flags that set a field of a config other than RLConfig's parts and RunConfig
OTHER_FLAGS: dict[str, tuple[type, str]] = {
    "--checkpoint-dir": (CheckpointConfig, "directory"),
    "--checkpoint-every": (CheckpointConfig, "every"), "--keep": (CheckpointConfig, "keep"),
    "--partial-segment": (PartialConfig, "segment"),
    "--partial-max-carry": (PartialConfig, "max_carry"),
    "--log-completions-every": (ReportConfig, "completions_every"),
    "--log-dir": (ReportConfig, "log_dir"),
}
# RunConfig fields no single flag sets (each says why in its metadata)
RUN_NOT_FLAGS = {"model", "partial", "speculation", "engine", "lora"}
# train() keywords named otherwise than their field
OTHER_KEYWORDS: dict[str, tuple[type, str]] = {
    "checkpoint_dir": (CheckpointConfig, "directory"),
    "checkpoint_every": (CheckpointConfig, "every"), "keep": (CheckpointConfig, "keep"),
}
# every dataclass a train run is configured with
DATACLASSES = (*PARTS, RunConfig, CheckpointConfig, PartialConfig, ReportConfig, LoraConfig,
               SamplingConfig)


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def _run_flags() -> dict[str, tuple[type, str]]:
    """flag -> (RunConfig, field) for RunConfig's single-flag fields."""
    return {flag: (RunConfig, f.name) for flag, f in run_flags().items()}


def _owners() -> dict[str, tuple[type, str]]:
    """flag -> (dataclass, field) for every flag that sets one config field."""
    knobs = {flag: (cls, f.name) for flag, (cls, f) in knob_flags().items()}
    return {**OTHER_FLAGS, **_run_flags(), **knobs}


def _train_parser() -> argparse.ArgumentParser:
    from jaxrl_sym.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _literal(node: ast.expr | None) -> bool:
    """A default spelled as a constant of its own (None/False say "unset", not a value)."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and node.value not in (None, False)


def test_no_knob_is_defined_twice() -> None:
    """A field name that two dataclasses share (SamplingConfig's are derived from
    AlgorithmConfig's) has a default in one of them at most; RLConfig's parts share no name, so
    a knob's name says which part it is in (``RLConfig.of``, old flat checkpoints)."""
    defaults: dict[str, list[str]] = defaultdict(list)
    names: dict[str, list[str]] = defaultdict(list)
    for cls in DATACLASSES:
        for f in dataclasses.fields(cls):
            names[f.name].append(cls.__name__)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                defaults[f.name].append(cls.__name__)
    twice = {k: v for k, v in defaults.items() if len(v) > 1}
    assert not twice, f"knobs with a default in two dataclasses: {twice}"
    in_parts = [n for n, owners in names.items()
                if sum(o in {c.__name__ for c in PARTS} for o in owners) > 1]
    assert not in_parts
    assert len(names) > 60  # the walk saw the dataclasses


def test_every_knob_has_exactly_one_flag_or_says_why_not() -> None:
    """RLConfig's parts: each field is one generated flag of the parser (named as the field,
    or as the flag its metadata keeps), or carries the reason it is none."""
    actions = [a for a in _train_parser()._actions if a.option_strings]
    by_flag = {o: a for a in actions for o in a.option_strings}
    flags = knob_flags()
    for cls in PARTS:
        for f in dataclasses.fields(cls):
            flag = flag_of(cls, f.name)
            if flag is None:
                assert len(f.metadata["not_a_flag"]) > 20, f"{cls.__name__}.{f.name}: say why"
                assert "help" not in f.metadata
                continue
            assert flags[flag] == (cls, f), flag
            assert by_flag[flag].help.startswith(f.metadata["help"]), flag
            assert f.metadata.get("flag", f.name.replace("_", "-")) == flag[2:]
    assert len(flags) == sum(flag_of(c, f.name) is not None for c in PARTS
                             for f in dataclasses.fields(c))
    # no hand-written flag sets a knob besides its generated one
    dests = defaultdict(list)
    for a in actions:
        dests[a.dest].append(a.option_strings[0])
    assert all(len(v) == 1 for v in dests.values()), dests
    # the three flags older than their fields keep their names (docs and scripts use them)
    assert {flag_of(AlgorithmConfig, n) for n in ("group_size", "clip_eps", "clip_eps_high")} \
        == {"--group", "--clip-low", "--clip-high"}


def test_every_run_field_is_one_generated_flag_or_says_why_not() -> None:
    """RunConfig's fields as the step's knobs: each is one flag whose name, default, help,
    choices, metavar and type are read from the field (its default is the field's: no recipe
    sets a run's fields; :data:`UNSET`'s, None: "not given", each with its reason), in the
    ``run`` argument group; the five that several flags (or none) build say why."""
    parser = _train_parser()
    by_flag = {o: a for a in parser._actions for o in a.option_strings}
    group = next(g for g in parser._action_groups if g.title == RUN_TITLE[0])
    in_group = {o for a in group._group_actions for o in a.option_strings}
    flagged = set()
    for f in dataclasses.fields(RunConfig):
        flag = flag_of(RunConfig, f.name)
        if flag is None:
            assert len(f.metadata["not_a_flag"]) > 20, f"RunConfig.{f.name}: say why"
            assert "help" not in f.metadata
            continue
        flagged.add(f.name)
        a = by_flag[flag]
        assert flag in in_group and a.dest == flag[2:].replace("-", "_"), flag
        assert f.metadata.get("flag", f.name.replace("_", "-")) == flag[2:]
        assert a.help.startswith(f.metadata["help"]), flag
        want = None if f.name in UNSET else f.default
        assert a.default == want and type(a.default) is type(want), (flag, a.default)
        assert a.choices == choices_of(f) and a.metavar == f.metadata.get("metavar"), flag
        kind = knob_type(RunConfig, f.name)[0]
        assert a.type is (None if kind is str else kind), (flag, a.type)
        if f.default is not None and "default:" not in f.metadata["help"]:
            assert a.help.endswith(f"(default: {f.default})"), flag
    assert flagged == {f.name for f in dataclasses.fields(RunConfig)} - RUN_NOT_FLAGS
    assert all(len(why) > 20 and name in flagged for name, why in UNSET.items())
    # the flags older than their fields keep their names; the choices are the library's sets
    assert {flag_of(RunConfig, n) for n in ("prompts_per_step", "model_dir")} == \
        {"--prompts", "--model"}
    from jaxrl_sym import systems
    from jaxrl_sym.weights.precision import PRECISIONS

    assert by_flag["--system"].choices == systems.names(trains=True)
    assert by_flag["--precision"].choices == PRECISIONS


def test_no_generated_flag_is_spelled_by_hand() -> None:
    """cli.py adds none of the flags generated from a field (RunConfig's or a step part's),
    and the resume check names a field's flag from the field: one name per knob."""
    from jaxrl_sym.rl.run.identity import FLAGS

    generated = set(run_flags()) | set(knob_flags())
    for module in ("cli.py", "config_flags.py"):
        tree = ast.parse((ROOT / "jaxrl_sym/rl/run" / module).read_text())
        spelled = [node.args[0].value for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and getattr(node.func, "attr", "") ==
                   "add_argument" and node.args and isinstance(node.args[0], ast.Constant)]
        assert not set(spelled) & generated, (module, set(spelled) & generated)
    named = {f.name for f in dataclasses.fields(RunConfig) if flag_of(RunConfig, f.name)}
    assert not set(FLAGS) & (named | {f.name for c in PARTS for f in dataclasses.fields(c)})


def test_every_flag_that_sets_a_field_has_the_fields_default() -> None:
    """A generated knob flag defaults to None ("not given": the recipe, then the field); a
    hand-written one to its field's default (or None)."""
    actions = {o: a for a in _train_parser()._actions for o in a.option_strings}
    owners = _owners()
    assert len(owners) >= 45
    knobs = knob_flags()
    for flag, (cls, name) in owners.items():
        assert flag in actions, f"{flag} (for {cls.__name__}.{name}) is not a train flag"
        default, field = actions[flag].default, _field(cls, name)
        if flag in knobs:
            assert default is None, flag
        if default is None or isinstance(actions[flag], argparse._StoreTrueAction):
            continue
        assert default == field.default and type(default) is type(field.default), (
            f"{flag} defaults to {default!r}, {cls.__name__}.{name} to {field.default!r}")


def test_a_knob_flags_help_shows_the_default_that_applies() -> None:
    """The help's default is read from the field, or from the recipe that sets the knob."""
    from jaxrl_sym.rl.config import TASK_RECIPE
    from jaxrl_sym.rl.run.pretrained import PRETRAINED_RECIPE

    helps = {o: a.help for a in _train_parser()._actions for o in a.option_strings}
    assert f"(default: {ExecutionConfig.logprob_chunk})" in helps["--logprob-chunk"]
    assert f"(default: {OptimizerConfig.optimizer})" in helps["--optimizer"]
    assert helps["--remat"].endswith("(default: on)")
    assert f"(default: {TASK_RECIPE['loss_agg']})" in helps["--loss-agg"]
    assert f"none; {PRETRAINED_RECIPE['update_tokens']} with --model" in helps["--update-tokens"]


def test_no_flag_spells_a_default_of_its_own() -> None:
    owners = _owners()
    bad = []
    for module in ("cli.py", "config_flags.py"):
        tree = ast.parse((ROOT / "jaxrl_sym/rl/run" / module).read_text())
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
            ((cls, a.arg) for cls in (*PARTS, RunConfig)
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


@pytest.mark.parametrize("cls", [*PARTS, RLConfig, RunConfig, CheckpointConfig, PartialConfig])
def test_a_config_built_without_arguments_is_valid(cls: type) -> None:
    """Each dataclass's defaults are a valid config (the one default is a usable one)."""
    if cls is PartialConfig:
        cls(0.5)  # its fraction has no default: it is the switch
    else:
        cls()
