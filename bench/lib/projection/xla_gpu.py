"""Compile for an NVIDIA H100 on a machine without a GPU, and read XLA:GPU's own buffer
assignment — the GPU's memory truth without the GPU.

Why: the projection compiled every program for the CPU, whose buffer assignment differs from
XLA:GPU's (fusion, matmul custom calls and their workspaces, layouts); at the GPU preset the
padded generation program's temporaries were 3.43 GB on CPU and 3.95 GB for the H100, and
neither number was in the generation estimate (1.25 GB) the H100 run missed by 3.9 GB. JAX
compiles ahead of time for a GPU it does not have (``jax.experimental.topologies`` with a
``GpuTargetConfig``; jax's ``tests/aot_test.py::test_deviceless_aot_compile``): the CUDA PJRT
plugin builds a compile-only device from the target description (``bench/devices/
h100_sxm.txtpb``: XLA's own H100 SXM spec, CUDA 12.9 / cuDNN 9.10 as the plugin is built).

Needs the optional packages ``scripts/gpu_compile_deps.sh`` installs into ``.gpu-compile/``
(jax-cuda12-plugin and -pjrt matching jaxlib, and the CUDA 12.9 nvcc wheel for ptxas and
libdevice; ~590 MB, never imported by the library). :func:`unavailable` says why not, so an
experiment can refuse with a sentence. Known gaps of the compile-only executable (jaxlib
0.11.2): ``cost_analysis()`` is None (:func:`cost_analysis` runs XLA's generic HLO cost
analysis on the optimised GPU module instead) and the generated code size is 0. Autotuning
has no device to time candidates on, so XLA takes each fusion's default configuration (with
``xla_gpu_autotune_level=0`` some Triton GEMM fusions have none and the compile fails): a tuned
matmul on the real GPU may pick another workspace.
"""

from __future__ import annotations

import functools
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.lib.child import ROOT

SITE = ROOT / ".gpu-compile"
TARGETS = {"h100": ROOT / "bench" / "devices" / "h100_sxm.txtpb"}
OPTIONS: dict[str, Any] = {}  # XLA:GPU defaults; autotuning without a device takes defaults

__all__ = ["compile_for", "compiler", "cost_analysis", "temp_buffers", "unavailable"]


def _path() -> None:
    """The optional packages on ``sys.path``, and JAX's platforms held to the CPU: the CUDA
    plugin is then loaded for its compile-only topology, not as a backend (which would fail
    without a GPU and its driver). Must run before JAX initialises its backends."""
    if SITE.is_dir() and str(SITE) not in sys.path:
        sys.path.append(str(SITE))
    import jax
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def unavailable() -> str | None:
    """None when a deviceless GPU compile can run here, else what to do."""
    _path()
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return ("the deviceless GPU compile needs jax's CUDA plugin: run `bash "
                "scripts/gpu_compile_deps.sh` (installs into .gpu-compile/, ~590 MB)")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized() and "cuda" not in xla_bridge._backend_factories:
        return ("JAX's backends started before the CUDA plugin was on the path: compile for "
                "the GPU in a fresh process (python -m bench dispatch / gpu_compile)")
    return None


@functools.cache
def _mesh(target: str) -> Any:
    from jax.experimental import topologies

    if target not in TARGETS:
        raise ValueError(f"target {target!r}: known targets are {', '.join(TARGETS)}")
    topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                        target_config=TARGETS[target].read_text())
    if topo.devices[0].client.runtime_type != "compile_only_runtime":
        raise RuntimeError(f"{target}: not a compile-only device")
    return topologies.make_mesh(topo, (1,), ("x",))


def compile_for(fn: Any, *args: Any, target: str = "h100", dump_to: str | None = None,
                kwargs: dict[str, Any] | None = None, options: dict[str, Any] | None = None
                ) -> Any:
    """``fn`` (jitted or not) lowered for ``target`` at the shapes of ``args`` (arrays or
    ``ShapeDtypeStruct`` trees; placed replicated on the compile-only device) and compiled,
    never run. ``kwargs``: static keyword arguments of the lowering, as given. ``dump_to``: a
    folder for XLA's dumps (the buffer assignment :func:`temp_buffers` reads, the thunk
    sequence :mod:`bench.lib.projection.thunks` reads). ``options``: XLA debug options for this
    compile (e.g. ``xla_gpu_enable_command_buffer``), beside :data:`OPTIONS`."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    _path()
    sharding = NamedSharding(_mesh(target), PartitionSpec())
    def struct(x: Any) -> Any:
        if not hasattr(x, "dtype"):  # a static argument (a Python int): as it is
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    structs = jax.tree.map(struct, args)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    opts = dict(OPTIONS, **(options or {}), **({"xla_dump_to": dump_to} if dump_to else {}))
    # the target's device kind in scope while lowering: a Pallas kernel (the pallas backend's
    # decode attention) reads the GPU it lowers for from the abstract mesh when none is attached
    with jax.sharding.use_abstract_mesh(_mesh(target).abstract_mesh):
        lowered = jitted.lower(*structs, **(kwargs or {}))
    return lowered.compile(compiler_options=opts)


class Analysed:
    """What :class:`~jaxrl_sym.runtime.memory.ledger.ProgramSize` reads: the memory of the program
    compiled for the GPU, the counts (flops, bytes) of the same program compiled here.

    Why the CPU's counts: against the H100's measured update seconds, the roofline over
    XLA:GPU's HLO cost analysis of the compile-only module fell 49-51% short where the CPU
    compile's counts fell 24-25% short (2026-11-27 run, bf16-mixed + LoRA 16)."""

    def __init__(self, gpu: Any, here: Any) -> None:
        self.gpu, self.here = gpu, here

    def memory_analysis(self) -> Any:
        return self.gpu.memory_analysis()

    def cost_analysis(self) -> Any:
        return self.here.cost_analysis()

    def runtime_executable(self) -> Any:
        """This machine's executable: its optimised modules go with its counts (the loops
        :func:`~jaxrl_sym.runtime.memory.loop_cost.loop_aware_cost` counts)."""
        return self.here.runtime_executable()


def compiler(target: str) -> Any:
    """``compiler(build)`` for the ledgers (:func:`jaxrl_sym.rl.step.ledger.step_ledger`,
    :func:`jaxrl_sym.runtime.memory.ledger_generation.sym_ledger`): every program compiled for
    ``target`` (its memory) and for this machine (its counts); ``build`` a
    :class:`~jaxrl_sym.runtime.programs.Build`."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    return lambda build: Analysed(
        compile_for(build.jitted, *build.args, target=target, kwargs=dict(build.kwargs)),
        build())


def cost_analysis(compiled: Any) -> dict[str, float]:
    """``compiled.cost_analysis()``, or where the compile-only executable has none, XLA's generic
    HLO cost analysis of its optimised modules (what PJRT runs for a real GPU executable)."""
    got = compiled.cost_analysis()
    if got:
        return dict(got)
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    cpu = xla_bridge.get_backend("cpu")
    total: dict[str, float] = {}
    for module in compiled.runtime_executable().hlo_modules():
        for k, v in _jax.hlo_module_cost_analysis(cpu, module).items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def temp_buffers(dump_dir: str, top: int = 8) -> list[tuple[str, str, int]]:
    """The ``top`` largest values in the program's temporary allocation (name, shape, bytes),
    from XLA's ``*buffer-assignment.txt`` dump: what the temporaries are."""
    files = sorted(Path(dump_dir).glob("*after_optimizations-buffer-assignment.txt"))
    if not files:
        return []
    text = files[-1].read_text()
    blocks = re.split(r"\n(?=allocation \d+:)", text)
    temp = [b for b in blocks if "preallocated-temp" in b.split("\n", 1)[0]]
    seen: dict[str, tuple[str, str, int]] = {}
    for block in temp:
        for name, size, _, shape in _VALUE.findall(block):
            seen.setdefault(name, (name, shape, int(size)))
    return sorted(seen.values(), key=lambda v: -v[2])[:top]


def dump_dir() -> str:
    """A fresh folder for one compile's XLA dump."""
    return tempfile.mkdtemp(prefix="gpu_compile_")

