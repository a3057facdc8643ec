"""``python -m bench <experiment> [--preset quick|full|gpu] [flags]``; without an experiment,
the list of them. ``python -m bench <experiment> --help`` shows its flags and presets."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench import registry
from jaxrl_sym.errors import InputError


def usage() -> str:
    width = max(len(n) for n in registry.names())
    lines = ["usage: python -m bench <experiment> [--preset quick|full|gpu] [flags]",
             "       python -m bench <experiment> --help", "", "experiments:"]
    lines += [f"  {e.name:<{width}}  {e.summary}" for e in registry.EXPERIMENTS]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    try:
        experiment = registry.get(args[0])
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return experiment.main(args[1:])
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
