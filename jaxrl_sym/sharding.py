"""Device meshes and the rules that place parameters, optimiser state and batches on them.

One mesh configuration serves the whole system: ``MeshConfig.parse("data=4,model=2")`` names the
mesh axes and their sizes, :meth:`MeshConfig.build` turns it into a ``jax.sharding.Mesh`` over
``jax.devices()`` (every process's devices after ``jax.distributed.initialize()``).

Placement is a *rule*, not a table (FSDP / ZeRO-3 style):

- a parameter with at least ``min_elements`` elements has its largest dimension that the
  data-parallel axes (``data`` and/or ``fsdp``) divide sharded over them; of its other
  dimensions, the largest one the ``model`` axis divides is sharded over ``model``. Everything
  else — small parameters, dimensions nothing divides — is replicated. Why a rule: it needs no
  per-model naming convention (the runtime sees flat parameter leaves), and any sharding is
  *correct* under XLA's SPMD partitioner; the rule only decides where memory goes.
- optimiser state follows its parameter: the rule is a function of the shape alone, and optax's
  moments have their parameter's shape, so a moment lands exactly where its parameter does;
  step counters and injected hyper-parameters are scalars and replicated.
- batches (packed training rows, the generation stores' rows) are split along their first axis
  over the data-parallel axes; a row count the axes do not divide is padded up with empty rows
  (:func:`round_up`), never sharded unevenly (XLA refuses uneven splits).

This module does not import JAX at import time: the CLI checks ``--mesh`` before JAX starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxrl_sym.errors import InputError
from jaxrl_sym.sizes import human_bytes

if TYPE_CHECKING:
    from jax.sharding import Mesh, NamedSharding

AXIS_NAMES = ("data", "fsdp", "model")
"""Mesh axes this system knows: ``data``/``fsdp`` split batches and parameters, ``model`` splits a
second parameter dimension (its activations are left to XLA's partitioner)."""
BATCH_AXES = ("data", "fsdp")
DEFAULT_MIN_ELEMENTS = 1024  # parameters smaller than this are replicated: splitting costs more


@dataclass(frozen=True)
class MeshConfig:
    """Named mesh axes and sizes, in order (the device grid's row-major layout)."""

    axes: tuple[tuple[str, int], ...]
    flag: str = "--mesh"  # what the user wrote it as, for errors

    @staticmethod
    def parse(text: str, *, flag: str = "--mesh") -> MeshConfig:
        """``"data=4,model=2"`` → a config; an :class:`InputError` naming ``flag`` otherwise."""
        axes: list[tuple[str, int]] = []
        for part in (p.strip() for p in str(text).split(",")):
            name, eq, size = part.partition("=")
            name = name.strip()
            if not eq or not name:
                raise InputError(f"{flag} {text!r}: each entry is NAME=SIZE, e.g. "
                                 f"{flag} data=4,model=2 (got {part!r})")
            if name not in AXIS_NAMES:
                raise InputError(f"{flag} {text!r}: unknown axis {name!r}; axes are "
                                 f"{', '.join(AXIS_NAMES)}")
            if name in dict(axes):
                raise InputError(f"{flag} {text!r}: axis {name!r} is given twice")
            try:
                n = int(size)
            except ValueError:
                n = 0
            if n < 1:
                raise InputError(f"{flag} {text!r}: the size of {name!r} must be a positive "
                                 f"integer (got {size.strip()!r})")
            axes.append((name, n))
        if not any(a in dict(axes) for a in BATCH_AXES):
            raise InputError(f"{flag} {text!r}: name a data-parallel axis (data=N or fsdp=N); "
                             "batches and parameters are split over it")
        return MeshConfig(tuple(axes), flag)

    @property
    def size(self) -> int:
        return math.prod(n for _, n in self.axes)

    def check(self, device_count: int) -> None:
        """The mesh must use every device exactly once (a mesh of fewer devices leaves some idle
        and some runtimes refuse it later with a less helpful message)."""
        if self.size != device_count:
            spec = ",".join(f"{a}={n}" for a, n in self.axes)
            raise InputError(
                f"{self.flag} {spec}: the axis sizes multiply to {self.size} but JAX sees "
                f"{device_count} device(s); make the product {device_count} (e.g. {self.flag} "
                f"data={device_count})")

    def build(self, devices: Sequence[Any] | None = None) -> Mesh:
        """The ``jax.sharding.Mesh`` (axes of type Auto: XLA propagates shardings between the
        constraints this system places)."""
        import jax
        from jax.sharding import AxisType

        devs = list(jax.devices() if devices is None else devices)
        self.check(len(devs))
        names = tuple(a for a, _ in self.axes)
        shape = tuple(n for _, n in self.axes)
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                             devices=devs)


@dataclass(frozen=True)
class Distributed:
    """How this process joins a run of several processes (several hosts): the arguments of
    ``jax.distributed.initialize``, checked before JAX starts.

    Every process runs the same command; the coordinator (process 0's ``host:port``) connects
    them, after which ``jax.devices()`` lists every process's devices and a ``--mesh`` spans
    them all. ``coordinator=None`` leaves the three to JAX's cluster detection (SLURM, Open MPI,
    Cloud TPU, ...).
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @staticmethod
    def add_flags(parser: Any, reports: str) -> None:
        """``--coordinator``, ``--num-processes``, ``--process-id`` on a subcommand's parser;
        ``reports``: what process 0 alone writes."""
        parser.add_argument(
            "--coordinator", default=None, metavar="HOST:PORT",
            help="several hosts: process 0's address (or auto: JAX's cluster detection); run "
                 "the same command on every host with --num-processes and --process-id, and a "
                 f"--mesh over all their devices. Process 0 alone writes {reports}")
        parser.add_argument("--num-processes", type=int, default=None, metavar="N",
                            help="with --coordinator: how many processes take part")
        parser.add_argument("--process-id", type=int, default=None, metavar="I",
                            help="with --coordinator: this process's id, 0..N-1")

    @staticmethod
    def from_flags(coordinator: str | None, num_processes: int | None,
                   process_id: int | None) -> Distributed | None:
        """None without ``--coordinator``; ``auto`` for cluster detection; else ``host:port``
        with ``--num-processes`` and ``--process-id`` (an :class:`InputError` naming the flag)."""
        if coordinator is None:
            if num_processes is not None or process_id is not None:
                raise InputError("--num-processes/--process-id need --coordinator HOST:PORT "
                                 "(or --coordinator auto on a cluster JAX detects)")
            return None
        if coordinator == "auto":
            if num_processes is not None or process_id is not None:
                raise InputError("--coordinator auto takes the process count and id from the "
                                 "cluster; drop --num-processes/--process-id or name the "
                                 "coordinator HOST:PORT")
            return Distributed()
        host, colon, port = coordinator.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise InputError(f"--coordinator {coordinator!r}: give HOST:PORT of process 0, e.g. "
                             "--coordinator node0:1234 (or auto)")
        if num_processes is None or process_id is None:
            raise InputError(f"--coordinator {coordinator}: also give --num-processes N and "
                             "--process-id I (0 on the coordinator's host)")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise InputError(f"--process-id {process_id} with --num-processes {num_processes}: "
                             "the id must be in 0..N-1 and N at least 1")
        return Distributed(coordinator, num_processes, process_id)

    NEEDS_MESH = ("--coordinator: give a --mesh over every process's devices too (e.g. --mesh "
                  "data=16 for 2 hosts x 8 devices); without one each process would run alone")

    @staticmethod
    def reports() -> bool:
        """Whether this process writes the run's outputs (process 0 does)."""
        import jax

        return jax.process_index() == 0

    def initialize(self) -> None:
        """Start JAX's distributed runtime (before anything touches a device). CPU devices
        exchange data over gloo, so the same run works on CPU hosts and in tests."""
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        try:
            jax.distributed.initialize(self.coordinator, self.num_processes, self.process_id)
        except (ValueError, RuntimeError) as e:  # JAX's words, under the flag the user gave
            where = self.coordinator or "auto (no cluster JAX knows was detected)"
            raise InputError(f"--coordinator {where}: JAX's distributed runtime did not start "
                             f"({e}); check the address, that process 0 runs, and "
                             "--num-processes/--process-id") from e


def make_mesh(spec: str | MeshConfig | Mesh | None) -> Mesh | None:
    """A mesh from a ``--mesh`` string, a config or a mesh (None stays None: one device)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = MeshConfig.parse(spec, flag="mesh")
    if isinstance(spec, MeshConfig):
        return spec.build()
    return spec


def platform_of(mesh: Mesh | None) -> str:
    """The platform (``jax.Device.platform``: "cpu", "gpu", "tpu") programs for ``mesh`` run
    on; without a mesh, JAX's default device's."""
    import jax

    if mesh is None:
        return jax.devices()[0].platform
    return mesh.devices.flat[0].platform


# ---------------------------------------------------------------------- the rules
def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The data-parallel axes present in ``mesh`` (batches and parameters are split over them)."""
    return tuple(a for a in BATCH_AXES if a in mesh.shape)


def data_size(mesh: Mesh | None) -> int:
    """Devices a batch is split over (1 without a mesh)."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // multiple) * multiple


def param_spec(shape: Sequence[int], mesh: Mesh, *, min_elements: int = DEFAULT_MIN_ELEMENTS
               ) -> tuple[Any, ...]:
    """PartitionSpec entries for one parameter of ``shape`` (see the module docstring)."""
    spec: list[Any] = [None] * len(shape)
    if math.prod(shape) < min_elements:
        return tuple(spec)
    data, n_data = batch_axes(mesh), data_size(mesh)

    def largest(n: int) -> int | None:
        dims = [i for i, s in enumerate(shape) if spec[i] is None and s % n == 0 and s >= n]
        return max(dims, key=lambda i: (shape[i], -i)) if dims else None

    if n_data > 1 and (i := largest(n_data)) is not None:
        spec[i] = data if len(data) > 1 else data[0]
    n_model = mesh.shape.get("model", 1)
    if n_model > 1 and (j := largest(n_model)) is not None:
        spec[j] = "model"
    return tuple(spec)


def tree_shardings(tree: Any, mesh: Mesh, *, min_elements: int = DEFAULT_MIN_ELEMENTS) -> Any:
    """A ``NamedSharding`` per leaf of a parameter (or optimiser-state) tree, by the rule."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.tree_util.tree_map(
        lambda x: NamedSharding(mesh, PartitionSpec(*param_spec(np.shape(x), mesh,
                                                                min_elements=min_elements))),
        tree)


def replicated(mesh: Mesh) -> NamedSharding:
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec())


def rows_sharding(mesh: Mesh) -> NamedSharding:
    """First axis split over the data-parallel axes, the rest replicated (any rank >= 1)."""
    from jax.sharding import NamedSharding, PartitionSpec

    data = batch_axes(mesh)
    return NamedSharding(mesh, PartitionSpec(data if len(data) > 1 else data[0]))


def place(tree: Any, shardings: Any) -> Any:
    """``jax.device_put`` of a tree onto matching shardings (a single sharding: every leaf)."""
    import jax

    return jax.device_put(tree, shardings)


def to_host(x: Any) -> Any:
    """A numpy copy of a device array — the global value, on every process.

    Why not ``np.asarray``: with several processes (``jax.distributed.initialize()``) an array
    split over the data axes has shards this process cannot address, and reading it raises. The
    host loop must still see every row's tokens and lengths on every process, because each one
    runs the same host program and must take the same decisions (stop, compact, grow). Such an
    array is all-gathered across processes (``multihost_utils.process_allgather``); anything
    this process holds whole is read directly (one process: always).
    """
    import jax
    import numpy as np

    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def global_args(compiled: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Arguments for a compiled program on a mesh that spans several processes.

    A program jitted for a multi-process mesh takes only global ``jax.Array``s: JAX refuses host
    (numpy) inputs with non-trivial shardings there, and an array committed to this process's
    default device is not on the mesh. Every process holds the same host value (they run the
    same host program on the same data), so each leaf is placed with the sharding the program
    was compiled for — ``device_put`` then copies only this process's shards. With one process
    the arguments are returned untouched: single-process JAX places them itself, and the hot
    loop pays nothing.
    """
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return args
    leaves, tdef = jax.tree_util.tree_flatten(args)
    # one sharding per argument leaf; None where XLA pruned an unused argument
    shardings = tdef.flatten_up_to(compiled.input_shardings[0])
    placed = []
    for x, sh in zip(leaves, shardings, strict=True):
        if sh is None or sh.is_fully_addressable or (
                isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sh, x.ndim)):
            placed.append(x)  # a local program, or already where the program wants it
        else:
            placed.append(jax.device_put(to_host(x) if isinstance(x, jax.Array)
                                         else np.asarray(x), sh))
    return jax.tree_util.tree_unflatten(tdef, placed)


def lowerable(args: Any) -> Any:
    """``args`` for ``jit(...).lower``: with several processes, host (numpy) leaves become
    ``ShapeDtypeStruct``s, because lowering with a host value under a non-trivial in-sharding is
    refused there; the program's own in-shardings then place them (:func:`global_args`). One
    process: unchanged."""
    import jax
    import numpy as np

    if jax.process_count() == 1:
        return args
    return jax.tree_util.tree_map(
        lambda x: x if isinstance(x, jax.Array)
        else jax.ShapeDtypeStruct(np.shape(x), np.result_type(x)), args)


def per_device_bytes(tree: Any) -> dict[Any, int]:
    """Bytes each device holds of a tree of arrays (its addressable shards)."""
    import jax

    out: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + int(shard.data.nbytes)
    return out


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes one device may hold, checked before work runs rather than discovered as an
    out-of-memory error half-way through a step.

    Why the library checks: a GPU allocator fails at run time with a message about one buffer,
    after minutes of compiling and generating; XLA's CPU client has no per-device limit at all,
    so on virtual devices nothing would ever fail. The budget is checked twice, against XLA's
    own numbers: the resident state's shards per device (:func:`per_device_bytes`), and every
    compiled program's per-device footprint (``memory_analysis()`` of the SPMD-partitioned
    executable: arguments + outputs − aliased + temporaries).
    """

    limit: int
    flag: str = "device_memory"

    def _fail(self, what: str, need: int, hint: str) -> None:
        raise InputError(f"{what} needs {human_bytes(need)} on one device, over the "
                         f"{self.flag} budget of {human_bytes(self.limit)}; {hint}")

    def check_tree(self, tree: Any, what: str) -> int:
        """Largest per-device share of ``tree``; an InputError naming ``what`` over the limit."""
        per = per_device_bytes(tree)
        need = max(per.values(), default=0)
        if need > self.limit:
            total = sum(per.values()) if len(per) > 1 else need
            devices = -(-total // self.limit)
            self._fail(what, need, f"shard it over a mesh of at least {devices} devices "
                       f"(--mesh fsdp={devices} or data={devices}) or raise the budget")
        return need

    def check_program(self, compiled: Any, name: str) -> int:
        """Per-device bytes a compiled program holds while it runs (0 if XLA does not say)."""
        try:
            ma = compiled.memory_analysis()
        except Exception:  # pragma: no cover - backends without memory analysis
            return 0
        if ma is None:  # pragma: no cover
            return 0
        need = int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                   - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
        if need > self.limit:
            self._fail(f"program {name!r}", need, "use more devices on the data/fsdp axes, "
                       "fewer tokens per micro-batch, or a larger budget")
        return need


def describe(mesh: Mesh | None) -> str:
    """``data=4,model=2`` (or ``single device``), for logs and summaries."""
    if mesh is None:
        return "single device"
    return ",".join(f"{a}={n}" for a, n in mesh.shape.items())


__all__ = [
    "Distributed",
    "MemoryBudget",
    "MeshConfig",
    "batch_axes",
    "data_size",
    "describe",
    "global_args",
    "lowerable",
    "make_mesh",
    "param_spec",
    "per_device_bytes",
    "place",
    "replicated",
    "round_up",
    "rows_sharding",
    "to_host",
    "tree_shardings",
]
