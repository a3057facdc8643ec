"""A command line's choice of systems, checked from the specs alone (JAX-free): which names,
and what stops them from running with these options — so ``jaxrl-sym decode`` refuses a bad
``--systems`` in well under a second, naming the flag to change."""

from __future__ import annotations

from jaxrl_sym.systems.registry import get, names
from jaxrl_sym.systems.spec import BindOptions, SystemSpec


def split(given: str) -> list[str]:
    """``"sym, padded"`` → ``["sym", "padded"]`` (the ``--systems`` syntax)."""
    return [s.strip() for s in given.split(",") if s.strip()]


def refusals(given: str, options: BindOptions, *, attention: str, user_model: bool
             ) -> list[str]:
    """Every problem with ``--systems given`` under these options: unknown or repeated names,
    a missing peer package (systems sharing a reason are named together), each spec's own
    refusals, and options (``mesh``, ``speculate``, a draft model) none or only some of them
    take. ``options.draft``: ``"ngram"`` or the name of a draft model preset."""
    chosen = split(given)
    unknown = [s for s in chosen if s not in names()]
    if not chosen or unknown:
        extra = f" (unknown: {', '.join(unknown)})" if unknown else ""
        return [f"--systems must name systems from {', '.join(names())}, got {given!r}{extra}"]
    if len(set(chosen)) != len(chosen):
        return [f"--systems names a system twice: {given!r}"]
    specs = [get(s) for s in chosen]
    missing: dict[str, list[str]] = {}
    for spec in specs:
        why = spec.unavailable()
        if why:
            missing.setdefault(why, []).append(spec.name)
    errors = [f"--systems {','.join(n)} {why}" for why, n in missing.items()]
    for spec in specs:
        errors += [e for e in spec.refusals(options, attention=attention, user_model=user_model)
                   if e not in errors]
    return errors + _options_taken(given, specs, options)


def _having(capability: str) -> str:
    """``sym and padded``: the registered systems with ``capability``, for a refusal."""
    return " and ".join(names(**{capability: True}))


def _options_taken(given: str, specs: list[SystemSpec], options: BindOptions) -> list[str]:
    """Options that apply to none (mesh, engine options, a draft model) or not all
    (speculation) of them."""
    caps, errors = [s.capabilities for s in specs], []
    if options.mesh is not None and not any(c.shards for c in caps):
        errors.append(f"--mesh shards the {_having('shards')} systems; --systems {given!r} "
                      "has none")
    if options.engine is not None and not any(c.engine for c in caps):
        errors.append(f"--engine sets the runtime of {_having('engine')}; --systems {given!r} "
                      "has none")
    if options.speculate > 0:
        other = [s.name for s in specs if not s.capabilities.speculates]
        if other:
            errors.append(f"--speculate applies to {_having('speculates')}; --systems names "
                          f"{other}")
        if options.draft != "ngram" and not any(c.draft_models for c in caps):
            errors.append(f"--draft {options.draft}: a draft model runs on the "
                          f"{_having('draft_models')} systems; --systems {given!r} has none")
    return errors
