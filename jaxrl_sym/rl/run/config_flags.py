"""``train``'s flags for a step's knobs and the run's fields, generated from their dataclasses
(JAX-free).

Why generated: a knob written by hand as a field, a flag, a default in the flag's help and a
label in the resume check had four homes, and they drifted. Here each field of
:class:`~jaxrl_sym.rl.knobs.AlgorithmConfig`, :class:`~jaxrl_sym.rl.knobs.OptimizerConfig` and
:class:`~jaxrl_sym.rl.knobs.ExecutionConfig` is one flag (:func:`add_knob_flags`): its name
the field's with ``-`` (or the older one its metadata names: ``--group``, ``--clip-low``,
``--clip-high``), its type the field's annotation, its choices and help the field's metadata,
one argument group per part. A switch is ``--x/--no-x``; a knob that may be None takes ``none``.

Every such flag defaults to None: "not given", so the task's recipe
(:data:`~jaxrl_sym.rl.config.TASK_RECIPE`, a ``--model`` run's
:data:`~jaxrl_sym.rl.run.pretrained.PRETRAINED_RECIPE`) and then the field decide; the help
says which value that is, read from those same objects. :func:`knobs_of` returns the knobs the
command line gave, by field name, for :func:`~jaxrl_sym.rl.config.task_rl_config`.

:class:`~jaxrl_sym.rl.config.RunConfig`'s fields that one flag sets (``--task``, ``--steps``,
``--prompts``, ``--model``...) are generated the same way (:func:`add_run_flags`), except that
each defaults to its field's default (no recipe sets them, and the command reads ``--seed`` and
``--system`` as values) — but for :data:`UNSET`'s; :func:`run_fields_of` returns them by field
name for the ``RunConfig`` the command builds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import Field, fields
from typing import Any

from jaxrl_sym.rl.config import GROUPS, TASK_RECIPE, RunConfig
from jaxrl_sym.rl.knobs import choices_of, flag_of, knob_type
from jaxrl_sym.rl.run.pretrained import PRETRAINED_LORA_LR, PRETRAINED_RECIPE

__all__ = ["NONE", "RUN_TITLE", "UNSET", "add_knob_flags", "add_run_flags", "knob_flags",
           "knobs_of", "run_fields_of", "run_flags"]

NONE = "none"
"""What a knob that may be None takes on the command line (``--max-grad-norm none``)."""

TITLES: dict[str, tuple[str, str]] = {
    "algorithm": ("algorithm", "what a step computes; part of the run's identity: --resume "
                               "refuses a change"),
    "optim": ("optimizer", "how the gradient becomes an update: --resume takes a changed rate, "
                           "schedule, decay or clip and says what changed; another --optimizer "
                           "is refused (the checkpoint's optimiser state is its rule's)"),
    "execution": ("execution and memory", "how a step is computed, not what (the same update "
                                          "up to float rounding): --resume takes a change and "
                                          "says what changed"),
}

RUN_TITLE = ("run", "RunConfig: the task and its prompt stream, the system, the model, the "
                    "devices, partial rollouts and speculation")

UNSET: dict[str, str] = {
    "task": "--dataset takes the task's place, so the command must tell --task given from not "
            "(cli._task: --task, else --dataset's task, else the field's default)",
}
"""RunConfig fields whose flag defaults to None ("not given") instead of the field's default,
and why; the help still names the field's default."""

# Who sets a knob the command line leaves unset, in order (the last that has it wins)
RECIPES: tuple[tuple[dict[str, Any], str], ...] = (
    (TASK_RECIPE, ""), (PRETRAINED_RECIPE, "with --model"),
    ({"lr": PRETRAINED_LORA_LR}, "for its LoRA adapters"))


def knob_flags() -> dict[str, tuple[type, Field[Any]]]:
    """``--flag`` -> (part, field) for every knob that is a flag."""
    out = {}
    for cls in GROUPS.values():
        for f in fields(cls):
            flag = flag_of(cls, f.name)
            if flag is not None:
                out[flag] = (cls, f)
    return out


def add_knob_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per knob of each part, in an argument group per part."""
    groups = {cls: parser.add_argument_group(TITLES[g][0], f"{cls.__name__}: {TITLES[g][1]}")
              for g, cls in GROUPS.items()}
    for flag, (cls, f) in knob_flags().items():
        groups[cls].add_argument(flag, **_argument(cls, f))


def knobs_of(args: argparse.Namespace) -> dict[str, Any]:
    """The knobs the command line (or ``--config``) gave, by field name (``none``: None)."""
    out = {}
    for flag, (_, f) in knob_flags().items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            out[f.name] = None if value == NONE else value
    return out


def run_flags() -> dict[str, Field[Any]]:
    """``--flag`` -> field for every RunConfig field that one flag sets."""
    return {flag: f for f in fields(RunConfig)
            if (flag := flag_of(RunConfig, f.name)) is not None}


def add_run_flags(parser: argparse.ArgumentParser) -> Any:
    """One flag per RunConfig field that is one, in the ``run`` argument group, which is
    returned: the run's hand-made flags (``--lora-*``, ``--partial-*``, ``--speculate*``: each
    one of several that build a field) join it."""
    group = parser.add_argument_group(*RUN_TITLE)
    for flag, f in run_flags().items():
        group.add_argument(flag, **_argument(RunConfig, f))
    return group


def run_fields_of(args: argparse.Namespace) -> dict[str, Any]:
    """The RunConfig fields the command line (or ``--config``) sets, by field name: every one
    of :func:`run_flags`, given or at its default (an :data:`UNSET` one: None when not given)."""
    return {f.name: getattr(args, _dest(flag)) for flag, f in run_flags().items()}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _argument(cls: type, f: Field[Any]) -> dict[str, Any]:
    """``add_argument``'s keywords for field ``f`` of ``cls``: a step's knob defaults to None
    (the recipe, then the field, decide) and takes ``none`` where it may be None; a RunConfig
    field defaults to its field's default (no recipe sets it), and its None is no flag's value
    (the flag is simply not given)."""
    kind, optional = knob_type(cls, f.name)
    meta, run = f.metadata, cls is RunConfig
    default = f.default if run and f.name not in UNSET else None
    kw: dict[str, Any] = {"default": default, "help": meta["help"] + _default_note(f, run)}
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
        return kw
    if kind is not str:
        kw["type"] = _or_none(kind) if optional and not run else kind
    if (choices := choices_of(f)) is not None:
        kw["choices"] = choices
    if "metavar" in meta:
        kw["metavar"] = meta["metavar"]
    return kw


def _or_none(kind: type) -> Callable[[str], Any]:
    """``kind``'s parser that also takes ``none`` (the knob's None)."""
    def parse(token: str) -> Any:
        return NONE if token.strip().lower() == NONE else kind(token)
    parse.__name__ = kind.__name__  # "not a valid int" in argparse's and --config's errors
    return parse


def _default_note(f: Field[Any], run: bool = False) -> str:
    """`` (default: ...)``: the recipe's value where one sets the knob, else the field's; none
    where the help says it already, or for a RunConfig field whose default is None (not a
    value its flag takes: the help says what not giving it means)."""
    if "default:" in f.metadata["help"] or (run and f.default is None):
        return ""
    base = TASK_RECIPE.get(f.name, f.default)
    notes = [_shown(base)] + [f"{_shown(r[f.name])} {where}" for r, where in RECIPES[1:]
                              if f.name in r]
    return f" (default: {'; '.join(notes)})"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return NONE
    return f"{value:g}" if isinstance(value, float) else str(value)
