"""A :class:`~jaxrl_sym.weights.precision.Precision` applied to a model's leaves: which weights
the update trains, which ones every forward reads, which ones the reference keeps.

Why one object: "the weights" mean three things in a mixed-precision run — the float32 master
the optimiser updates, the bf16 copy generation and scoring read (refreshed on the device after
each update, never through the host), and the frozen reference — and every consumer used to
read ``params["lm"]`` directly. The trainer holds one :class:`WeightView` and asks it.

Casting the leaves is not enough for the forward to *compute* in bf16: flax.nnx's layers keep a
``dtype`` attribute (in the graph definition, not in the leaves) and promote their inputs and
weights to it, so a model built in float32 fed bf16 weights computes in float32.
:meth:`WeightView.compute_model` therefore also sets that attribute on every module holding one
(every nnx layer: Linear, Embed, RMSNorm, …). A contract model with its own explicit casts keeps
them (e.g. an fp32 softmax or head), which is what such casts are for.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.weights.precision import Precision

__all__ = ["WeightView", "cast_floating", "check_precision"]


def cast_floating(leaves: Sequence[Any], dtype: Any) -> list[Any]:
    """``leaves`` with every floating array in ``dtype`` (an array already in it is returned
    as is, not copied); integer and other leaves pass through. Traceable."""
    dt = jnp.dtype(dtype)
    return [x.astype(dt) if _floating(x) and x.dtype != dt else x for x in leaves]


def check_precision(precision: Precision, devices: Sequence[Any] | None = None) -> None:
    """An :class:`InputError` when the devices cannot compute in ``precision``'s dtypes: bf16
    matrix units need an NVIDIA GPU of compute capability 8.0 (Ampere) or newer; older ones
    emulate it far below fp32 speed, which is never what a user asking for bf16 wants."""
    if precision.compute != "bfloat16":
        return
    for d in devices if devices is not None else jax.devices():
        cc = getattr(d, "compute_capability", None)
        if d.platform == "gpu" and cc is not None and float(cc) < 8.0:
            raise InputError(f"precision={precision.name!r} (--precision): {d.device_kind} "
                             f"(compute capability {cc}) has no bf16 matrix units (8.0+, "
                             "Ampere, needed); use --precision fp32")


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


class WeightView:
    """The precision policy over one model's leaves (flattened from ``nnx.split(model)[1]``).

    master(leaves): copies in the master dtype (what the optimiser updates).
    compute(leaves): the forward's weights (the same arrays where the dtypes agree; a traceable
      cast inside a program; :meth:`compute_copy` on the device between programs).
    reference(leaves): copies in the compute dtype (the frozen KL reference: bf16 in a mixed run).
    original(leaves): copies in the dtypes the model came with (what ``RLTrainer.model()`` and
      export return).
    """

    def __init__(self, precision: Precision, leaves: Sequence[Any]) -> None:
        self.precision = precision
        self.original_dtypes = [getattr(x, "dtype", None) for x in leaves]

    def master(self, leaves: Sequence[Any]) -> list[Any]:
        return [jnp.array(x, copy=True) for x in cast_floating(leaves, self.precision.master)]

    def compute(self, leaves: Sequence[Any]) -> list[Any]:
        return cast_floating(leaves, self.precision.compute)

    def reference(self, leaves: Sequence[Any]) -> list[Any]:
        return [jnp.array(x, copy=True) for x in cast_floating(leaves, self.precision.compute)]

    def original(self, leaves: Sequence[Any]) -> list[Any]:
        return [jnp.array(x, dtype=d, copy=True) if d is not None and _floating(x) else x
                for x, d in zip(leaves, self.original_dtypes, strict=True)]

    @cached_property
    def _cast(self) -> Any:
        return jax.jit(self.compute)

    def compute_copy(self, leaves: Sequence[Any]) -> list[Any]:
        """The forward's weights as device arrays: ``leaves`` themselves when no cast is needed
        (fp32 and bf16 policies), else one compiled cast on the device (bf16-mixed: a fresh bf16
        copy after each update, the old one freed when the systems drop it)."""
        if all(not _floating(x) or x.dtype == jnp.dtype(self.precision.compute) for x in leaves):
            return list(leaves)
        return self._cast(list(leaves))

    def compute_model(self, graphdef: Any, treedef: Any, leaves: Sequence[Any]) -> nnx.Module:
        """A model over ``compute_copy(leaves)`` whose modules compute in the compute dtype
        (see the module docstring)."""
        model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef,
                                                                 self.compute_copy(leaves)))
        dt = jnp.dtype(self.precision.compute)
        for _, module in nnx.iter_modules(model):
            for attr in ("dtype", "param_dtype"):
                value = getattr(module, attr, None)
                if value is not None and _is_float_dtype(value):
                    setattr(module, attr, dt)
        return model


def _is_float_dtype(value: Any) -> bool:
    try:
        return jnp.issubdtype(jnp.dtype(value), jnp.floating)
    except TypeError:
        return False
