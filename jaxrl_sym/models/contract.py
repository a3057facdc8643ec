"""The one contract a model follows, checked once, with errors that state it.

A model is any ``nnx.Module`` called as ``model(tokens, positions, segment_ids) -> logits``:
int32 ``[B, T]`` tokens and positions (position < 0 = padding), int32 ``[B, T]`` segment ids,
float logits ``[B, T, V]``; its only sequence-mixing op is :func:`jaxrl_sym.attend`, which gets
the segment ids unchanged (ids >= 2**16 are child segments of a shared prefix,
:func:`jaxrl_sym.ops.attention.child_segment`). Nothing else is read from it — no config
attribute, no cache arguments: vocabulary, layers, head shapes and attention patterns come from
the traced program.

:func:`check_model` evaluates the model abstractly (``jax.eval_shape``: no FLOPs, no memory) on a
``[1, 2]`` batch, so a model that breaks the contract fails here, before any tracing or compiling,
with a sentence about the contract instead of a symbolic-shape error from deep inside JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError

CONTRACT = ("model(tokens, positions, segment_ids) -> logits, with int32 [B, T] tokens, "
            "positions (< 0 = padding) and segment ids, and float logits [B, T, vocab]")


@dataclass(frozen=True)
class ModelInfo:
    """What the library needs to know about a model, read from an abstract evaluation."""

    vocab_size: int
    logits_dtype: str
    name: str  # the model's class, for messages and checkpoint fingerprints


def check_model(model: Any) -> ModelInfo:
    """Check ``model`` against the contract; return its vocabulary size and logits dtype."""
    name = type(model).__qualname__
    if not callable(model):
        raise InputError(f"{name} is not callable; a model is {CONTRACT}")
    spec = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    try:
        out = _abstract(model, lambda m, t, p, s: m(t, p, s), spec, spec, spec)
    except TypeError as err:
        raise InputError(f"{name} cannot be called as {CONTRACT}: {err}. Wrap it in a module "
                         "whose __call__ takes exactly these three arrays.") from err
    if isinstance(out, tuple | list) or not hasattr(out, "shape"):
        raise InputError(f"{name} returned {type(out).__name__}, not one logits array; a model "
                         f"is {CONTRACT}")
    if len(out.shape) != 3 or tuple(out.shape[:2]) != (1, 2):
        raise InputError(f"{name} returned logits of shape {tuple(out.shape)} for [1, 2] "
                         f"tokens; want [1, 2, vocab]: a model is {CONTRACT}")
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise InputError(f"{name} returned {out.dtype} logits; want a float dtype")
    return ModelInfo(int(out.shape[-1]), str(out.dtype), name)


def _abstract(model: Any, call: Any, *args: Any) -> Any:
    """``jax.eval_shape`` of ``call(model, *args)`` with the model's state as an argument,
    merged inside the trace as the tracer does: a model whose layers use Flax transforms
    (``nnx.scan``, ``nnx.remat``, ``nnx.vmap``) cannot be closed over by a JAX transform
    ("Cannot mutate Param from a different trace level"). Not an nnx module: called as is."""
    if not isinstance(model, nnx.Module):
        return jax.eval_shape(lambda *a: call(model, *a), *args)
    graphdef, state = nnx.split(model)
    return jax.eval_shape(lambda st, *a: call(nnx.merge(graphdef, st), *a), state, *args)


SPLIT = ("model.features(tokens, positions, segment_ids) -> [B, T, D] final hidden states and "
         "model.head(features) -> logits, with model(...) == model.head(model.features(...))")


def check_features(model: Any) -> str | None:
    """The optional ``features``/``head`` split of the contract: None when ``model`` has it,
    else why not (a sentence for the step's stats).

    Why optional: a model is only required to produce logits, but at a 150k vocabulary the
    ``[tokens x vocab]`` logits dominate an RL update's memory; a model that also exposes its
    final hidden states and its (position-wise) head lets the step apply the head to a chunk of
    tokens at a time (:mod:`jaxrl_sym.rl.step.logprobs`). A model without the split still trains,
    unchunked. One that has both methods but whose composition disagrees with ``__call__`` on
    an abstract ``[1, 2]`` batch (shape or dtype) is a broken model: :class:`InputError`.
    """
    name = type(model).__qualname__
    if not (callable(getattr(model, "features", None)) and callable(getattr(model, "head", None))):
        return f"{name} has no features/head"
    spec = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    try:
        feats = _abstract(model, lambda m, t, p, s: m.features(t, p, s), spec, spec, spec)
        split = _abstract(model, lambda m, f: m.head(f), feats)
    except TypeError as err:
        raise InputError(f"{name}.features/head cannot be called as {SPLIT}: {err}") from err
    whole = jax.eval_shape(lambda t, p, s: model(t, p, s), spec, spec, spec)
    if not hasattr(feats, "shape") or len(feats.shape) != 3 or tuple(feats.shape[:2]) != (1, 2):
        raise InputError(f"{name}.features returned {getattr(feats, 'shape', type(feats))} for "
                         f"[1, 2] tokens; want [1, 2, D]: {SPLIT}")
    if (getattr(split, "shape", None), getattr(split, "dtype", None)) != (whole.shape,
                                                                          whole.dtype):
        raise InputError(f"{name}.head(features) gives {getattr(split, 'shape', split)} "
                         f"{getattr(split, 'dtype', '')} but {name}(...) gives {whole.shape} "
                         f"{whole.dtype}: {SPLIT}")
    return None


def model_fingerprint(model: nnx.Module) -> dict[str, Any]:
    """What identifies a model's architecture for checkpoints: its class, its config if it
    keeps a dataclass one (any attribute name), and every parameter's path, shape and dtype."""
    fp: dict[str, Any] = {"class": f"{type(model).__module__}.{type(model).__qualname__}"}
    for attr, val in vars(model).items():
        if dataclasses.is_dataclass(val) and not isinstance(val, type | nnx.Module | nnx.Variable):
            fp[f"config.{attr}"] = {f.name: repr(getattr(val, f.name))
                                    for f in dataclasses.fields(val)}
    state = nnx.state(model, nnx.Param)
    fp["params"] = {jax.tree_util.keystr(path): [list(np.shape(x)), str(jnp.result_type(x))]
                    for path, x in jax.tree_util.tree_flatten_with_path(
                        state, is_leaf=lambda x: isinstance(x, jax.Array | np.ndarray))[0]}
    return fp
