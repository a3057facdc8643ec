"""One internal entry point for running a Triton kernel from JAX, on a GPU or on the CPU.

:func:`launch` is the only place that knows how a kernel is run:

* ``"gpu"``: jax has a GPU backend and ``jax_triton`` imports. The kernel goes through
  ``jax_triton.triton_call``. Its keyword for the output shapes changed between releases
  (0.3.x ``out_shape``, 0.4.x ``out_type``); the signature is inspected once, here, so no caller
  depends on the installed version.
* ``"interpreter"``: anything else with ``triton`` installed (a CPU-only jaxlib, where jax-triton
  does not import). The *same kernel source* runs under Triton's interpreter on host copies of the
  arrays, inside ``jax.pure_callback``, so it also works under ``jax.jit``. Slow (Python per
  program instance), meant for correctness tests of the kernels on machines without a GPU.
* ``None``: triton is not installed.

Interpreter constraint: Triton decides whether ``@triton.jit`` builds a compiled or an interpreted
function *when the decorator runs*, from ``TRITON_INTERPRET`` — for our kernels and for
``triton.language``'s own jit helpers (``tl.sum``, ``tl.cdiv``...), which are decorated when
triton is first imported. So the variable must be set before triton's first import. Kernel
modules are only imported through :func:`import_kernels`, which, when jax has no GPU backend and
triton is not imported yet, sets ``TRITON_INTERPRET=1`` first (harmless there: nothing compiled
could run). On a GPU machine the variable is never touched, so other Triton users in the process
are unaffected. If triton was already imported in the other mode, :func:`import_kernels` raises
with what to do instead of failing inside a kernel.

Not thread-safe state in Triton's interpreter (a module-level builder holding the grid index) is
why interpreted launches are serialised by a lock: XLA may run two host callbacks concurrently.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Literal

import jax
import numpy as np

BackendName = Literal["gpu", "interpreter"]

_INTERPRETER_LOCK = threading.Lock()
"""Serialises interpreted launches (Triton's interpreter keeps the grid index in a global)."""


# --------------------------------------------------------------------------- backend detection


def _jax_has_gpu() -> bool:
    try:
        return any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices())
    except RuntimeError:  # pragma: no cover - no backend at all
        return False


@functools.cache
def _jax_triton() -> ModuleType | None:
    """The jax_triton module, or None. Imported only when jax has a GPU: on a CPU-only jaxlib
    jax-triton 0.3.x fails at import (it needs jaxlib's GPU Triton custom-call library)."""
    if not _jax_has_gpu() or importlib.util.find_spec("jax_triton") is None:
        return None
    try:
        return importlib.import_module("jax_triton")
    except Exception:  # any import failure means "not usable here"
        return None


@functools.cache
def backend_name() -> BackendName | None:
    """``"gpu"`` (jax-triton on a GPU), ``"interpreter"`` (Triton's CPU interpreter) or None."""
    if importlib.util.find_spec("triton") is None:
        return None
    if _jax_triton() is not None:
        return "gpu"
    return "interpreter"


def triton_available() -> bool:
    """True when Triton kernels can run here, compiled or interpreted."""
    return backend_name() is not None


def import_kernels(name: str) -> ModuleType:
    """Import ``kernels.<name>`` in the mode :func:`backend_name` chose (see the module docstring).

    Raises RuntimeError, saying what to do, when triton was already imported in the other mode:
    the standard-library functions kernels use (``tl.sum``, ``tl.cdiv``...) are themselves
    ``@triton.jit`` functions fixed at triton's import, so no per-kernel conversion can fix that.
    """
    mode = backend_name()
    if mode is None:
        raise ModuleNotFoundError(
            "triton is not installed: install the 'interp' extra (CPU interpreter) or the 'gpu' "
            "extra (jax-triton) to use the Triton backend"
        )
    if mode == "interpreter" and not _jax_has_gpu() and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    interpreted = _triton_is_interpreted()
    if mode == "interpreter" and not interpreted:
        raise RuntimeError(
            "the Triton kernels must run under Triton's interpreter here (no jax-triton GPU "
            "backend), but triton was imported before TRITON_INTERPRET=1 was set: set it in the "
            "environment, or use a jaxrl_sym Triton op before anything imports triton"
            + (" (or install jax-triton to run them on this GPU)" if _jax_has_gpu() else "")
        )
    if mode == "gpu" and interpreted:
        raise RuntimeError(
            "TRITON_INTERPRET=1 is set, so triton cannot compile the kernels for the GPU; unset "
            "it to run them through jax-triton"
        )
    return importlib.import_module(f"kernels.{name}")


def _triton_is_interpreted() -> bool:
    """Whether triton.language's own jit functions were built for the interpreter."""
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.cdiv, InterpretedFunction)


# --------------------------------------------------------------------------- host tensors


class _HostTensor:
    """A numpy array dressed as the torch tensor Triton's interpreter expects (no torch needed).

    Triton 3.6's ``GridExecutor`` copies each pointer argument "to the host" through
    ``untyped_storage().cpu()``, ``new_empty`` + ``set_`` and copies it back with ``copy_``; the
    arrays already live on the host, so every one of those is the identity on the same memory.
    ``dtype`` is a Triton dtype, which Triton's argument mangling accepts directly.
    """

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.dtype = _triton_dtype(array.dtype)
        self.shape = array.shape

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def untyped_storage(self) -> _HostTensor:
        return self

    def cpu(self) -> _HostTensor:
        return self

    def new_empty(self, *_: Any, **__: Any) -> _HostTensor:
        return _HostTensor(self.array)

    def set_(self, storage: _HostTensor, *_: Any) -> _HostTensor:
        self.array = storage.array
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self) -> int:
        return self.array.itemsize

    def copy_(self, other: _HostTensor) -> None:
        if other.array is not self.array:
            np.copyto(self.array, other.array)


def _triton_dtype(dtype: np.dtype) -> Any:
    import triton.language as tl

    table = {
        "float32": tl.float32,
        "float16": tl.float16,
        "bfloat16": tl.bfloat16,
        "float64": tl.float64,
        "int32": tl.int32,
        "int64": tl.int64,
        "int16": tl.int16,
        "int8": tl.int8,
        "uint32": tl.uint32,
        "uint8": tl.uint8,
        "bool": tl.int1,
    }
    try:
        return table[np.dtype(dtype).name]
    except KeyError:
        raise TypeError(f"no Triton dtype for {dtype}") from None


def _poison(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Uninitialised-output stand-in: NaN / a sentinel, so an unwritten element fails a test the
    way uninitialised GPU memory would, instead of passing as a lucky zero."""
    if jax.numpy.issubdtype(dtype, np.floating):
        return np.full(shape, np.nan, dtype=dtype)
    return np.full(shape, np.iinfo(dtype).max // 3, dtype=dtype)


# --------------------------------------------------------------------------- launch


def launch(
    kernel: Any,
    *,
    grid: Sequence[int],
    inputs: Sequence[jax.Array],
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    constexprs: Mapping[str, Any],
    num_warps: int = 4,
    num_stages: int = 2,
    input_output_aliases: Mapping[int, int] | None = None,
    zeroed_outputs: Sequence[int] = (),
) -> tuple[jax.Array, ...]:
    """Run ``kernel`` over a static ``grid``; returns one array per entry of ``out_shapes``.

    The kernel's parameters are, in order: one pointer per input, one pointer per output, then the
    ``constexprs`` (keywords). ``inputs`` must be arrays: a Python scalar would be baked into the
    compiled program by jax-triton (a recompile per value), so run-time lengths travel as int32
    device arrays that the kernel reads with ``tl.load``. ``input_output_aliases`` maps an input
    index to an output index sharing its buffer (in place; donate the input under ``jax.jit`` to
    avoid XLA's defensive copy). Outputs not listed in ``zeroed_outputs`` start uninitialised: the
    kernel must write every element.
    """
    for i, x in enumerate(inputs):
        if isinstance(x, int | float | np.generic) or not hasattr(x, "shape"):
            raise TypeError(
                f"launch(): input {i} is {type(x).__name__}; pass run-time values as int32 "
                "device arrays (Python scalars are compiled into the program) and static ones "
                "as constexprs"
            )
    grid = tuple(int(g) for g in grid)
    aliases = dict(input_output_aliases or {})
    out_shapes = [jax.ShapeDtypeStruct(tuple(s.shape), s.dtype) for s in out_shapes]
    mode = backend_name()
    if mode is None:
        raise ModuleNotFoundError("triton is not installed (see jaxrl_sym.backends.launch)")
    if mode == "gpu":
        return _launch_gpu(kernel, grid, inputs, out_shapes, constexprs, num_warps, num_stages,
                           aliases, tuple(zeroed_outputs))
    return _launch_interpreter(kernel, grid, inputs, out_shapes, constexprs, aliases,
                               tuple(zeroed_outputs))


def _launch_gpu(
    kernel: Any,
    grid: tuple[int, ...],
    inputs: Sequence[jax.Array],
    out_shapes: list[jax.ShapeDtypeStruct],
    constexprs: Mapping[str, Any],
    num_warps: int,
    num_stages: int,
    aliases: dict[int, int],
    zeroed: tuple[int, ...],
) -> tuple[jax.Array, ...]:
    jt = _jax_triton()
    assert jt is not None
    kwargs: dict[str, Any] = {
        _out_keyword(jt.triton_call): out_shapes,
        "grid": grid,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }
    if aliases:
        kwargs["input_output_aliases"] = aliases
    if zeroed:
        kwargs["zeroed_outputs"] = zeroed
    outs = jt.triton_call(*inputs, kernel=kernel, **kwargs, **constexprs)
    return tuple(outs) if isinstance(outs, list | tuple) else (outs,)


@functools.cache
def _out_keyword(triton_call: Any) -> str:
    """``out_shape`` (jax-triton 0.3.x) or ``out_type`` (0.4.x)."""
    params = inspect.signature(triton_call).parameters
    return "out_type" if "out_type" in params else "out_shape"


def _launch_interpreter(
    kernel: Any,
    grid: tuple[int, ...],
    inputs: Sequence[jax.Array],
    out_shapes: list[jax.ShapeDtypeStruct],
    constexprs: Mapping[str, Any],
    aliases: dict[int, int],
    zeroed: tuple[int, ...],
) -> tuple[jax.Array, ...]:
    fn = kernel
    out_of = {o: i for i, o in aliases.items()}
    consts = dict(constexprs)

    def host(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        ins = [np.ascontiguousarray(a) for a in arrays]
        outs: list[np.ndarray] = []
        for j, s in enumerate(out_shapes):
            if j in out_of:  # aliased: the input and output pointers share one writable buffer
                buf = np.array(ins[out_of[j]], dtype=s.dtype, copy=True)
                ins[out_of[j]] = buf
            elif j in zeroed:
                buf = np.zeros(s.shape, s.dtype)
            else:
                buf = _poison(s.shape, np.dtype(s.dtype))
            outs.append(buf)
        args = [_HostTensor(a) for a in ins] + [_HostTensor(o) for o in outs]
        with _INTERPRETER_LOCK, np.errstate(all="ignore"):
            fn[grid](*args, **consts)
        return tuple(outs)

    return tuple(jax.pure_callback(host, tuple(out_shapes), *inputs))
