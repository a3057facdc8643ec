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
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.weights.lora import LoraPlan, init_adapters, merged_leaves
from jaxrl_sym.weights.lora_model import lora_leaves, lora_model, zero_adapters
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
    """The precision policy (and LoRA, when a plan is given) over one model's leaves (flattened
    from ``nnx.split(model)[1]``). ``lm`` below is what the optimiser trains — the model's
    leaves, or LoRA adapters — and ``frozen`` what it never changes (LoRA's base; else None).

    trainable(leaves, key): step-0 ``lm`` in the master dtype (copies; fresh adapters).
    frozen(leaves): LoRA's base in its dtype (``LoraConfig.base_dtype``, else the compute
      dtype), copied; None without LoRA.
    reference(leaves, frozen): the frozen KL reference: LoRA's base itself (adapters off: no
      second copy), else a copy of the leaves in the compute dtype.
    forward(lm, frozen): the leaves every forward reads, cast to the compute dtype; with LoRA
      the leaves of the unmerged :class:`~jaxrl_sym.weights.lora_model.LoraModel` (adapters,
      then the frozen base itself): no merged copy of the model is ever formed. Traceable.
    reference_leaves(ref): the same for the reference's leaves (LoRA: the base, adapters off).
    forward_copy(lm, frozen): shapes of the forward's leaves that are new arrays (casts,
      adapters) rather than the trainer's own: what the forward holds beyond the state.
    original(lm, frozen): the policy's leaves in the dtypes the model came with, LoRA merged
      (export).
    """

    def __init__(self, precision: Precision, leaves: Sequence[Any],
                 lora: LoraPlan | None = None) -> None:
        self.precision = precision
        self.lora = lora
        self.original_dtypes = [getattr(x, "dtype", None) for x in leaves]
        self.n_params = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves)

    def trainable(self, leaves: Sequence[Any], key: jax.Array | None = None) -> Any:
        if self.lora is None:
            return [jnp.array(x, copy=True) for x in cast_floating(leaves, self.precision.master)]
        key = jax.random.key(0) if key is None else key
        dt = jnp.dtype(self.precision.master)
        return [{k: v.astype(dt) for k, v in a.items()} for a in init_adapters(self.lora, key)]

    def frozen(self, leaves: Sequence[Any]) -> list[Any] | None:
        if self.lora is None:
            return None
        dt = self.lora.cfg.base_dtype or self.precision.compute
        return [jnp.array(x, copy=True) for x in cast_floating(leaves, dt)]

    def reference(self, leaves: Sequence[Any], frozen: list[Any] | None) -> list[Any]:
        if self.lora is not None:
            assert frozen is not None
            return frozen
        return [jnp.array(x, copy=True) for x in cast_floating(leaves, self.precision.compute)]

    def forward(self, lm: Any, frozen: Any = None) -> list[Any]:
        dt = self.precision.compute
        if self.lora is None:
            return cast_floating(lm, dt)
        adapters = [dict(zip(ad, cast_floating(list(ad.values()), dt), strict=True)) for ad in lm]
        return lora_leaves(adapters, cast_floating(frozen, dt))

    def reference_leaves(self, ref: Any) -> list[Any]:
        """The leaves the reference's forward reads (traceable): ``ref`` itself, or with LoRA
        the frozen base under adapters that add exactly nothing (``A = B = 0``)."""
        if self.lora is None:
            return ref
        return lora_leaves(zero_adapters(self.lora, jnp.dtype(self.precision.compute)),
                           cast_floating(ref, self.precision.compute))

    def forward_copy(self, lm: Any, frozen: Any = None) -> list[jax.ShapeDtypeStruct]:
        """Shapes of the forward's leaves that are arrays of their own (a dtype cast, LoRA's
        adapters); the frozen base in the compute dtype is read in place."""
        dt = jnp.dtype(self.precision.compute)
        own = list(lm) if self.lora is None else list(frozen)
        extra = [] if self.lora is None else [x for ad in lm for x in ad.values()]
        moved = [x for x in own if _floating(x) and x.dtype != dt]
        if self.lora is None and not moved:
            return []
        return [jax.ShapeDtypeStruct(np.shape(x), dt if _floating(x) else x.dtype)
                for x in moved + extra]

    def original(self, lm: Any, frozen: Any = None) -> list[Any]:
        leaves = lm if self.lora is None else merged_leaves(self.lora, frozen, lm)
        return [jnp.array(x, dtype=d, copy=True) if d is not None and _floating(x) else x
                for x, d in zip(leaves, self.original_dtypes, strict=True)]

    @property
    def copies(self) -> bool:
        """Whether the forward reads arrays of its own (a cast to the compute dtype, LoRA's
        adapters) rather than only the trainer's leaves themselves."""
        return self.lora is not None or self.precision.mixed

    @cached_property
    def _forward(self) -> Any:
        return jax.jit(self.forward)

    def compute_copy(self, lm: Any, frozen: Any = None) -> list[jax.Array]:
        """The forward's weights as device arrays: ``lm`` itself when no cast is needed (fp32
        and bf16 policies without LoRA), else cast by one compiled program on the device (a
        fresh copy after each update, the old one freed when the systems drop it). LoRA's
        frozen base is passed through as it is (cast only if stored in another dtype)."""
        dt = jnp.dtype(self.precision.compute)
        if self.lora is not None:
            # the adapters cast on the device (flat, as lora_leaves orders them), then the
            # frozen base itself when it is already in the compute dtype
            return list(self._forward(lm, [])) + cast_floating(frozen, dt)
        if all(not _floating(x) or x.dtype == dt for x in lm):
            return list(lm)
        return self._forward(lm, frozen)

    def compute_model(self, graphdef: Any, treedef: Any, lm: Any,
                      frozen: Any = None) -> nnx.Module:
        """A model over ``compute_copy(lm, frozen)`` whose modules compute in the compute dtype
        (see the module docstring)."""
        dt = jnp.dtype(self.precision.compute)
        leaves = self.compute_copy(lm, frozen)
        if self.lora is None:
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
        else:
            n = 2 * len(self.lora.indices)
            base = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves[n:]))
            adapters = [{"a": leaves[i], "b": leaves[i + 1]} for i in range(0, n, 2)]
            model = lora_model(base, self.lora, adapters, dt)
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
