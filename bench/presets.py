"""An experiment's command line: ``--preset quick|full|gpu`` plus its few meaningful flags.

Why presets: the sizes of a run (model, batch, lengths, repeats, output place) belong together;
before, each script spelled them as flags (109 in all) and every caller re-typed them. Now an
experiment declares ``PRESETS = {"quick": {...}, "full": {...}, "gpu": {...}}`` (settings by
name) and keeps as flags only what a user varies within a size; a flag left out takes its
preset's value, so ``args`` always holds every setting.

* ``quick`` — the smallest run that executes every path (a minute or two on 2 CPU cores);
  writes under the temporary directory, never into ``bench/results``.
* ``full`` — the CPU measurement ``bench/results/cpu`` records.
* ``gpu`` — sized for one H100/H200.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

NAMES = ("quick", "full", "gpu")
Presets = Mapping[str, Mapping[str, Any]]


def quick_dir(experiment: str) -> str:
    """Where a quick run writes: a temporary folder, so smoke runs never pose as results."""
    return os.path.join(tempfile.gettempdir(), "bench-quick", experiment)


def at_least(low: int, hint: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``, else an argparse error on the flag (plus
    ``hint``). Why: an experiment used to take ``--prompts 0`` or ``--steps -1`` and fail with a
    traceback from numpy or the trainer, some after a minute of compiling; argparse refuses
    before any of it (and before JAX is imported)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}"
                                             ) from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}{hint}")
        return n
    return parse


def finite_at_least(low: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number >= ``low`` (NaN compares false everywhere, so an
    unchecked one silently takes a branch)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number >= {low:g}, got {text!r}"
                                             ) from None
        if not math.isfinite(x) or x < low:
            raise argparse.ArgumentTypeError(f"must be finite and >= {low:g}, got {text}")
        return x
    return parse


def ints(low: int) -> Callable[[str], str]:
    """An argparse ``type``: a comma-separated list of integers, each >= ``low`` (kept as the
    text; :func:`csv` reads it), e.g. ``--rows 1,8,32``. Why: a list flag was split and cast
    deep inside the run, so ``--rows 0,x`` failed with a ValueError traceback after JAX started
    (or, for a bad number, ran an empty experiment)."""
    one = at_least(low)

    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",")]
        if not any(items):
            raise argparse.ArgumentTypeError(f"give comma-separated integers >= {low}, got "
                                             f"{text!r}")
        for x in items:
            if x:
                one(x)
        return text
    return parse


def names(known: Sequence[str], what: str = "name", empty: bool = False
          ) -> Callable[[str], str]:
    """An argparse ``type``: a comma-separated list of ``known`` names (kept as the text);
    ``empty``: an empty list is a choice (none of them)."""
    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in known]
        if bad or not (items or empty):
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or repr(text)}; "
                                             f"choose from {', '.join(known)}")
        return text
    return parse


def systems(trains: bool = False) -> Callable[[str], str]:
    """An argparse ``type``: comma-separated registered systems (variants such as ``sym-xla``
    included), or with ``trains`` only systems that train; checked against the registry, which
    is JAX-free, so a typo is refused before any warm-up (kept as the text)."""
    def parse(text: str) -> str:
        from jaxrl_sym import systems as registry
        from jaxrl_sym.errors import InputError

        items = csv(text)
        if not items:
            raise argparse.ArgumentTypeError(f"no system given in {text!r}")
        known = registry.names(trains=True)
        for name in items:
            if trains and name not in known:
                raise argparse.ArgumentTypeError(f"unknown system {name!r} here; choose from "
                                                 f"{', '.join(known)} (the systems that train)")
            try:
                registry.get(name)
            except InputError as err:
                raise argparse.ArgumentTypeError(str(err)) from None
        return text
    return parse


def engine_options(fields: dict[str, Any]) -> None:
    """``--engine``'s check (with :func:`json_object`): the runtime's own
    ``EngineOptions.from_fields`` (JAX-free), so a field it does not have or a value outside its
    domain is refused by name before any warm-up or child starts."""
    from jaxrl_sym.runtime.options import EngineOptions

    EngineOptions.from_fields(fields, flag="")


def truth(text: str) -> bool:
    """An argparse ``type``: yes/no as 1/0, true/false or yes/no (any other word used to
    mean no)."""
    low = text.strip().lower()
    if low in ("1", "true", "yes"):
        return True
    if low in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false (1/0, yes/no), got {text!r}")


def json_object(check: Callable[[dict[str, Any]], object] | None = None
                ) -> Callable[[str], str]:
    """An argparse ``type``: a JSON object (kept as the text, which the experiment records),
    ``check(obj)`` raising ``ValueError``/``TypeError`` for one it cannot use (e.g. building the
    options it names, which say which field is wrong)."""
    def parse(text: str) -> str:
        try:
            obj = json.loads(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"is not valid JSON ({err}); give an object such "
                                             "as '{\"min_capacity\": 16}'") from None
        if not isinstance(obj, dict):
            raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {text!r}")
        if check is not None:
            try:
                check(obj)
            except (ValueError, TypeError) as err:
                raise argparse.ArgumentTypeError(str(err)) from None
        return text
    return parse


def parser(name: str, doc: str | None, presets: Presets) -> argparse.ArgumentParser:
    """The experiment's parser with ``--preset``; the help lists every preset's settings."""
    missing = [n for n in NAMES if n not in presets]
    if missing:
        raise ValueError(f"experiment {name}: presets {missing} missing")
    lines = ["presets (a flag given overrides its setting):"]
    for pname in NAMES:
        items = ", ".join(f"{k}={_show(v)}" for k, v in presets[pname].items())
        lines.append(f"  {pname}: {items}")
    p = argparse.ArgumentParser(prog=f"python -m bench {name}",
                                description=(doc or "").strip().split("\n\n")[0],
                                epilog="\n".join(lines),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=NAMES, default="quick",
                   help="quick: smoke run (temporary output); full: the CPU measurement; "
                        "gpu: one H100/H200 (default: quick)")
    return p


def _show(v: Any) -> str:
    if isinstance(v, list | tuple):
        return ",".join(map(str, v))
    return str(v)


def parse(p: argparse.ArgumentParser, presets: Presets,
          argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; every setting of the chosen preset not given as a flag is filled in."""
    args = p.parse_args(argv)
    for key, value in presets[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def command(name: str, argv: Sequence[str] | None) -> str:
    """The command line that reproduces this run (recorded beside its results), quoted for a
    shell: an ``--engine`` JSON or a ``--runs`` list pastes back as one argument."""
    return shlex.join(["python", "-m", "bench", name, *(argv or [])])


def csv(text: str | Sequence[Any], kind: type = str) -> list[Any]:
    """A comma-separated flag (or a preset's list) as a list of ``kind``."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return [kind(x.strip() if isinstance(x, str) else x) for x in items
            if not isinstance(x, str) or x.strip()]
