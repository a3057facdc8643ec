"""LoRA on any contract model, as pure functions of the model's flat parameter leaves.

A model's state is flattened the way the RL trainer flattens it::

    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)

and :func:`plan_lora` picks, by dotted path (``layers.0.attn.q_proj.kernel``), the 2-D
``kernel`` leaves that get adapters: ``A`` ``[in, r]`` and ``B`` ``[r, out]`` in float32 for a
kernel ``W`` ``[in, out]`` (NNX's layout, ``y = x @ W``). :func:`merged_leaves` returns the
leaves with each target replaced by ``W + (alpha / r) · A @ B``, which the unchanged model code
then runs.

Why merged weights and not a LoRA layer inside the model:

* **Any contract model.** The model is an opaque ``nnx.Module`` (``DecoderLM``, a Hugging Face
  ``CausalLM``, a user's own); it is called, never edited. Replacing a leaf works for every
  model, a layer wrapper only for the module classes someone taught it.
* **Exact at initialisation.** ``B = 0`` makes the merged leaf ``W.astype(f32) + 0`` cast back
  to ``W``'s dtype: bit-identical to the base, so the model's logits equal the base model's
  exactly (==), in float32 and in bfloat16.
* **Free reference policy.** The base leaves themselves are the reference model (adapters off);
  no second copy of the weights exists.

The price of merging: in a gradient program a merged copy of each targeted weight, its
``A @ B`` and its ``[in, out]`` gradient ``dL/dW`` before the reduction to ``dL/dA``,
``dL/dB``; in generation a whole merged model beside the frozen base. So no program of a run
merges: every system runs :class:`jaxrl_sym.weights.lora_model.LoraModel` (the same model,
``x @ W + scale · (x @ A) @ B`` at each matmul that reads a target, via
:func:`jaxrl_sym.weights.lora_apply.lora_call`); merged leaves are what export writes and the
definition the tests check against. The optimiser state is what the adapters save (float32 Adam
moments of ``r · (in + out)`` instead of ``in · out`` numbers per weight).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.weights.lora_config import ALL_LINEAR, LoraConfig

# The output head is left out of "all-linear" (as PEFT leaves out a causal LM's output
# embedding): these are the names models give it. Matched on the module holding the kernel.
HEAD_NAMES = frozenset({"lm_head", "head", "output", "embed_out", "output_layer", "classifier",
                        "score"})
Adapter = dict[str, jax.Array]  # {"a": [in, r] float32, "b": [r, out] float32}


@dataclass(frozen=True)
class LoraPlan:
    """Which flat leaves get adapters, and their shapes. Hashable: a static jit argument.

    ``indices`` index ``jax.tree_util.tree_flatten(nnx.split(model)[1])[0]`` (``n_leaves``
    long); ``names`` are the dotted paths, ``shapes`` the kernels' ``(in, out)``.
    """

    cfg: LoraConfig
    n_leaves: int
    indices: tuple[int, ...]
    names: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor on ``A @ B``."""
        return self.cfg.scale

    @property
    def rank(self) -> int:
        return self.cfg.rank


def dotted_path(path: Sequence[Any]) -> str:
    """``layers.0.attn.q_proj.kernel`` for a ``tree_flatten_with_path`` key path of an NNX state
    (the trailing ``.value`` of the variable is dropped)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        else:
            parts.append(str(getattr(k, "key", k)))
    if len(parts) > 1 and parts[-1] == "value":
        parts.pop()
    return ".".join(parts)


def state_of(state_or_model: Any) -> Any:
    """The state the trainer flattens: ``nnx.split(model)[1]`` for a module, else as given."""
    if isinstance(state_or_model, nnx.Module):
        return nnx.split(state_or_model)[1]
    return state_or_model


def named_leaves(state_or_model: Any) -> list[tuple[str, Any]]:
    """``(dotted path, leaf)`` in the order of ``jax.tree_util.tree_flatten`` of the state."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state_of(state_or_model))
    return [(dotted_path(p), leaf) for p, leaf in flat]


def _floating(leaf: Any) -> bool:
    """A floating array (or ShapeDtypeStruct); RNG keys, counters and Python scalars are not."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _is_linear_kernel(name: str, leaf: Any) -> bool:
    parts = name.split(".")
    return (parts[-1] == "kernel" and len(np.shape(leaf)) == 2
            and not (len(parts) > 1 and parts[-2] in HEAD_NAMES))


def _matches(cfg: LoraConfig, named: list[tuple[str, Any]]) -> list[int]:
    if cfg.targets == ALL_LINEAR:
        return [i for i, (n, leaf) in enumerate(named) if _is_linear_kernel(n, leaf)]
    pattern = re.compile(cfg.targets)
    return [i for i, (n, _) in enumerate(named) if pattern.fullmatch(n)]


def _no_match_error(cfg: LoraConfig, named: list[tuple[str, Any]]) -> InputError:
    big = [f"{n} {list(np.shape(leaf))}" for n, leaf in named if len(np.shape(leaf)) >= 2]
    big = big or [n for n, _ in named]
    shown = ", ".join(big[:8]) + (f" (and {len(big) - 8} more)" if len(big) > 8 else "")
    if cfg.targets == ALL_LINEAR:
        what = ("no 2-D 'kernel' leaf (a Linear weight) outside the output head; pass a "
                "regular expression over dotted parameter paths instead")
    else:
        what = "no parameter path; the regular expression must match a whole dotted path"
    return InputError(f"LoRA targets={cfg.targets!r} match {what}. Parameters with 2 or more "
                      f"dimensions: {shown}")


def plan_lora(state_or_model: Any, cfg: LoraConfig) -> LoraPlan:
    """Select the leaves ``cfg.targets`` names and check each can carry a rank-``r`` adapter.

    Errors (``InputError``): targets that match nothing (a few available paths listed); a
    matched leaf that is not a 2-D floating array (its path and shape); ``rank`` larger than
    ``min(in, out)`` of a matched kernel (its path and shape: a rank-r update of a smaller
    matrix only costs more than training the matrix itself).
    """
    if not isinstance(cfg, LoraConfig):
        raise InputError(f"plan_lora needs a LoraConfig, got {type(cfg).__name__}")
    named = named_leaves(state_or_model)
    hits = _matches(cfg, named)
    if not hits:
        raise _no_match_error(cfg, named)
    shapes = []
    for i in hits:
        name, leaf = named[i]
        shape = tuple(np.shape(leaf))
        if len(shape) != 2 or not _floating(leaf):
            raise InputError(f"LoRA target {name} has shape {list(shape)} and dtype "
                             f"{getattr(leaf, 'dtype', type(leaf).__name__)}; only 2-D floating "
                             "weights ([in, out] kernels) can carry adapters. Narrow targets "
                             r"(e.g. end the pattern with '\.kernel')")
        if cfg.rank > min(shape):
            raise InputError(f"LoRA rank={cfg.rank} is larger than parameter {name} of shape "
                             f"{list(shape)} allows (min(in, out) = {min(shape)}); choose "
                             f"rank <= {min(shape)} or leave this parameter out of targets")
        shapes.append((int(shape[0]), int(shape[1])))
    return LoraPlan(cfg, len(named), tuple(hits), tuple(named[i][0] for i in hits),
                    tuple(shapes))


def init_adapters(plan: LoraPlan, key: jax.Array) -> list[Adapter]:
    """Fresh adapters: ``A`` as PEFT's default (``kaiming_uniform_(a=sqrt(5))`` on its
    ``[r, in]`` weight, i.e. uniform in ``±1/sqrt(in)``), ``B`` zeros; both float32.

    ``B = 0`` is what makes the merged model equal the base exactly at initialisation.
    """
    out = []
    for i, (n_in, n_out) in enumerate(plan.shapes):
        bound = 1.0 / math.sqrt(n_in)
        a = jax.random.uniform(jax.random.fold_in(key, i), (n_in, plan.rank), jnp.float32,
                               -bound, bound)
        out.append({"a": a, "b": jnp.zeros((plan.rank, n_out), jnp.float32)})
    return out


def _check_inputs(plan: LoraPlan, base_leaves: Sequence[Any],
                  adapters: Sequence[Adapter]) -> None:
    """Shapes are static, so this runs at trace time and costs nothing per step."""
    if len(base_leaves) != plan.n_leaves:
        raise InputError(f"merged_leaves got {len(base_leaves)} leaves but the LoRA plan was "
                         f"made for a model with {plan.n_leaves}; plan and leaves must come "
                         "from the same model's state")
    if len(adapters) != len(plan.indices):
        raise InputError(f"merged_leaves got {len(adapters)} adapters for a plan of "
                         f"{len(plan.indices)} targets")
    for name, idx, (n_in, n_out), ad in zip(plan.names, plan.indices, plan.shapes, adapters,
                                            strict=True):
        if tuple(np.shape(base_leaves[idx])) != (n_in, n_out):
            raise InputError(f"leaf {idx} has shape {list(np.shape(base_leaves[idx]))}, but "
                             f"the plan's {name} is {[n_in, n_out]}; not the plan's model")
        want = {"a": (n_in, plan.rank), "b": (plan.rank, n_out)}
        got = {k: tuple(np.shape(ad[k])) if k in ad else None for k in want}
        if got != want:
            raise InputError(f"adapter for {name} has shapes {got}, expected {want}")


def merged_leaves(plan: LoraPlan, base_leaves: Sequence[Any], adapters: Sequence[Adapter],
                  dtype: Any = None) -> list[Any]:
    """The leaves with each target ``W`` replaced by ``(W.f32 + scale · A @ B).astype(dtype
    or W.dtype)``; other leaves pass through (cast to ``dtype`` when given and floating).

    Differentiable w.r.t. ``adapters`` (and ``base_leaves``) and traceable under ``jit``; the
    plan is static. ``A @ B`` is computed at HIGHEST precision: on accelerators the default
    float32 matmul may round its inputs to bf16/tf32, which would make "the adapters' update"
    depend on the device.
    """
    _check_inputs(plan, base_leaves, adapters)
    out = list(base_leaves)
    if dtype is not None:
        out = [x.astype(dtype) if _floating(x) else x for x in out]
    for idx, ad in zip(plan.indices, adapters, strict=True):
        w = base_leaves[idx]
        delta = jnp.matmul(ad["a"].astype(jnp.float32), ad["b"].astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
        merged = w.astype(jnp.float32) + plan.scale * delta
        out[idx] = merged.astype(dtype if dtype is not None else w.dtype)
    return out


def merged_model(model: nnx.Module, plan: LoraPlan, adapters: Sequence[Adapter],
                 dtype: Any = None) -> nnx.Module:
    """A new module of ``model``'s class with merged weights (``model`` itself is unchanged):
    for export, evaluation and generation outside a jitted step."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    merged = merged_leaves(plan, leaves, adapters, dtype)
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, merged))


def frozen_base(plan: LoraPlan, base_leaves: Sequence[Any]) -> list[Any]:
    """The base leaves in ``plan.cfg.base_dtype`` (floating leaves only; None: unchanged): the
    frozen copy a LoRA run keeps, and its reference policy."""
    dt = plan.cfg.base_dtype
    if dt is None:
        return list(base_leaves)
    return [x.astype(dt) if _floating(x) else x for x in base_leaves]


def adapter_params(plan: LoraPlan) -> int:
    """Number of trainable adapter numbers: ``r · (in + out)`` per target."""
    return sum(plan.rank * (i + o) for i, o in plan.shapes)


def adapter_bytes(plan: LoraPlan) -> int:
    """Bytes of the float32 adapters (multiply by 3 for adapters + Adam's two moments)."""
    return 4 * adapter_params(plan)


def base_bytes(leaves: Sequence[Any]) -> int:
    """Bytes of a list of leaves (arrays or ``ShapeDtypeStruct``s), e.g. the frozen base. RNG
    keys count their key data (``key<fry>``: 8 bytes)."""
    return sum(int(np.prod(np.shape(x), dtype=np.int64)) * x.dtype.itemsize for x in leaves)
