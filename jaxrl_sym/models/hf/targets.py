"""Where each checkpoint tensor lives in a model: HF tensor name → parameter path.

One table, derived from the model's own parameter paths, shared by every reader (safetensors
in :mod:`~jaxrl_sym.models.hf.loader`, GGUF in :mod:`~jaxrl_sym.models.hf.gguf_model`) and
the writer (:mod:`~jaxrl_sym.models.hf.export`), so a name can never mean one parameter on the
way in and another on the way out. A leaf module: it imports no other reader or writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flax import nnx


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor goes: parameter path, HF-layout shape, transpose or not."""

    path: tuple[Any, ...]
    hf_shape: tuple[int, ...]
    transpose: bool


def parameter_targets(model: nnx.Module) -> dict[str, Target]:
    """HF tensor name → parameter target, derived from the model's own parameter paths."""
    targets: dict[str, Target] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = tuple(var.get_value().shape)
        leaf = path[-1]
        hf_leaf = {"kernel": "weight", "embedding": "weight"}.get(str(leaf), str(leaf))
        name = ".".join([*(str(p) for p in path[:-1]), hf_leaf])
        transpose = leaf == "kernel"
        targets[name] = Target(tuple(path), shape[::-1] if transpose else shape, transpose)
    return targets


def variable_at(model: nnx.Module, path: tuple[Any, ...]) -> nnx.Variable:
    """The parameter variable at ``path`` (a path from ``nnx.to_flat_state``)."""
    node: Any = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node
