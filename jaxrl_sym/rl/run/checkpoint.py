"""Orbax checkpoints of an RL run that are verified before they are trusted.

What is saved per step: parameters, the optimiser state's leaves, the reference weights (β > 0),
and a JSON metadata record: the step, a structural fingerprint, the run's hyper-parameters, and
SHA-256 digests of every saved tree plus a digest of the metadata itself.

Why each piece:

- **Fingerprint** (model config, parameter shapes/dtypes, algorithm, reference present): restoring
  Adam moments or weights of another architecture either fails deep inside orbax with a shape
  message or — worse, when shapes happen to agree — silently resumes the wrong model. It is
  compared *before* any array is read, and a mismatch is an error (never a fallback: the
  directory belongs to another run).
- **Digests** (written at save time from the exact host arrays handed to orbax, checked after
  restore): orbax/tensorstore does not checksum array bytes, so random bytes written into a data
  file restored "successfully" as garbage optimiser moments (up to 2.8e38) and the next step
  committed NaN parameters. A step whose digests, metadata digest or finiteness check fails, or
  that cannot be read at all, is skipped with a warning naming the step and the reason, and the
  newest *good* step is restored instead. Skipped steps newer than the one restored are moved
  aside to ``<step>.corrupt`` (kept for inspection, invisible to orbax) so the resumed run can
  write those step numbers again.
- **Finite-only saves**: :meth:`Checkpointer.save` refuses to write non-finite parameters or
  optimiser state, so a diverged run never replaces good checkpoints with poisoned ones.

Sharded state (a trainer on a mesh, :mod:`jaxrl_sym.sharding`) is saved as the same host arrays —
a checkpoint does not record the mesh it was written on — and restored with *target shardings*:
orbax reads each array straight into the restoring trainer's placement (its rule on its mesh), so
a run saved on 8 devices resumes on 2, or on one, with equal parameters.

Atomicity comes from orbax's ``CheckpointManager``: a step is written into a temporary directory
and renamed into place only once complete, so an interrupted save never becomes "the latest
checkpoint". Only the newest ``max_to_keep`` steps are kept (``--keep``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxrl_sym.rl.errors import CheckpointError
from jaxrl_sym.rl.step.state import params_sha256, with_config_hyperparams
from jaxrl_sym.rl.step.trainer import RLTrainer
from jaxrl_sym.sharding import to_host

log = logging.getLogger(__name__)

QUARANTINE_SUFFIX = ".corrupt"
PARTS = {"params": "parameters", "opt_state": "optimiser state", "ref": "reference weights"}


class NonFiniteStateError(CheckpointError):
    """The state asked to be saved holds NaN/inf values; nothing was written."""


class NoGoodCheckpointError(CheckpointError):
    """Every checkpoint in a directory failed verification; nothing was loaded."""


class _BadStep(Exception):
    """One checkpoint step is unreadable or fails verification (internal: triggers fallback)."""


# --------------------------------------------------------------------------- digests and checks


def tree_sha256(tree: Any) -> str:
    """Digest of every leaf (shape, dtype and bytes, in pytree order): the construction of
    :func:`jaxrl_sym.rl.step.state.params_sha256`, so the parameter digest stored in a checkpoint
    equals the ``params_sha256`` a run reports."""
    return params_sha256(tree)


def nonfinite_report(tree: Any) -> str | None:
    """``None`` when every floating leaf is finite; else a short description of the first bad
    leaf and the total count (for an error that says how bad it is)."""
    bad_leaves, total, first = 0, 0, None
    leaves = jax.tree_util.tree_leaves(tree)
    for i, x in enumerate(leaves):
        a = to_host(x)
        if not jnp.issubdtype(a.dtype, jnp.floating):
            continue
        flat, step = a.reshape(-1), 1 << 22  # float32 copies of 4M values, not of the leaf
        n = sum(int(np.count_nonzero(~np.isfinite(flat[k:k + step].astype(np.float32))))
                for k in range(0, flat.size, step))
        if n:
            bad_leaves, total = bad_leaves + 1, total + n
            first = first or f"leaf {i}, shape {list(a.shape)}"
    if not total:
        return None
    return (f"{total} non-finite values ({bad_leaves} of {len(leaves)} arrays; first: "
            f"{first})")


def _meta_sha256(meta: dict[str, Any]) -> str:
    """Digest of the metadata minus its own digest: a flipped byte in the JSON that still parses
    (a changed learning rate, step or array digest) is caught too."""
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def fingerprint(trainer: RLTrainer, **run: Any) -> dict[str, Any]:
    """What must agree for a checkpoint's arrays to fit ``trainer`` at all (JSON-serialisable).

    Hyper-parameters that only change the trajectory are not here: they are compared separately
    (and may be overridden) by :mod:`jaxrl_sym.rl.run.train`.
    """
    model = {k: v for k, v in trainer.model_fingerprint.items() if k != "params"}
    shapes = [[list(np.shape(x)), str(np.result_type(x))]
              for x in jax.tree_util.tree_leaves(trainer.params)]
    algorithm = trainer.cfg.algorithm
    return {"model": model, "params": shapes, "algo": algorithm.algo,
            "beta_positive": algorithm.beta > 0, **run}


def _diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key), current.get(key)
        if key == "model" and isinstance(a, dict) and isinstance(b, dict):
            fa, fb = _flat_model(a), _flat_model(b)
            out += [f"model.{k}: checkpoint {fa.get(k)} vs this run {fb.get(k)}"
                    for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
        elif key == "params" and a != b:
            out.append(f"parameter shapes differ ({len(a or [])} arrays in the checkpoint vs "
                       f"{len(b or [])} here: another model or LoRA rank/targets, which no "
                       "flag can resume)")
        elif a != b:
            out.append(f"{key}: checkpoint {a!r} vs this run {b!r}")
    return out


def _flat_model(fp: dict[str, Any]) -> dict[str, Any]:
    """A model fingerprint with its dataclass configs' fields lifted to the top (``d_model``
    rather than ``config.cfg``), so a refused resume names the field that changed."""
    out: dict[str, Any] = {}
    for k, v in fp.items():
        if k.startswith("config.") and isinstance(v, dict):
            out.update(v)
        else:
            out[k] = v
    return out


def split_legacy(meta: dict[str, Any]) -> dict[str, Any]:
    """Metadata of checkpoints written before hyper-parameters were stored kept the run's task,
    max_digits, seed and system in the fingerprint: move them to ``hparams`` so both layouts
    compare the same way."""
    if "hparams" in meta:
        return meta
    fp = dict(meta.get("fingerprint", {}))
    run = {k: fp.pop(k) for k in ("task", "max_digits", "seed", "system") if k in fp}
    cfg = meta.get("config", {})
    return {**meta, "fingerprint": fp, "hparams": {**cfg, **run}}


# --------------------------------------------------------------------------- the manager


class Checkpointer:
    """Save / verify / restore RL training state under ``directory`` (one sub-directory per step).

    ``create=False`` opens an existing directory without creating it (``--resume`` must not turn
    a mistyped path into a fresh run). ``skipped`` lists ``(step, reason)`` for every step the
    last :meth:`restore` rejected; ``quarantined`` the paths it moved aside.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int = 3,
                 create: bool = True) -> None:
        if max_to_keep < 1:
            raise CheckpointError(f"keep={max_to_keep}: at least the newest checkpoint must be "
                                  "kept; pass --keep 1 or more")
        self.directory = os.path.abspath(os.fspath(directory))
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=create,
                                            enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=opts)
        self.skipped: list[tuple[int, str]] = []
        self.quarantined: list[str] = []

    def steps(self) -> list[int]:
        """Committed steps, oldest first (quarantined ones excluded)."""
        return sorted(int(s) for s in self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    @staticmethod
    def _state(trainer: RLTrainer) -> dict[str, Any]:
        """Host (numpy) copies of what is saved: digests are taken of exactly these bytes. With
        several processes every one holds the whole gathered copy (:func:`to_host`): orbax then
        writes host arrays from the primary process, and each process can verify the digest —
        at the price of one full host copy of the state per process while saving."""
        state: dict[str, Any] = {
            "params": trainer.params,
            "opt_state": jax.tree_util.tree_leaves(trainer.opt_state),
        }
        # LoRA's reference is its frozen base, which the source model gives back on resume:
        # only the adapters and their optimiser state are saved
        if trainer.ref_leaves is not None and trainer.state.frozen is None:
            state["ref"] = trainer.ref_leaves
        return jax.tree_util.tree_map(to_host, state)

    def save(self, step: int, trainer: RLTrainer, meta: dict[str, Any]) -> None:
        """Write step ``step`` (blocking; renamed into place when complete).

        Refuses (:class:`NonFiniteStateError`, nothing written, older steps untouched) when the
        parameters, optimiser state or reference hold NaN/inf: such a state can only poison
        every run resumed from it. Adds ``digests``, ``params_sha256`` and ``meta_sha256`` to
        ``meta``.
        """
        state = self._state(trainer)
        for part in ("params", "opt_state", "ref"):
            if part in state and (bad := nonfinite_report(state[part])) is not None:
                raise NonFiniteStateError(
                    f"refusing to save step {step} to {self.directory}: found {bad} in the "
                    f"{PARTS[part]}. "
                    "The run has diverged; the checkpoints already there were left untouched. "
                    "Resume from the newest one with a lower --lr (or check the rewards).")
        digests = {part: tree_sha256(tree) for part, tree in state.items()}
        meta = {**meta, "step": int(step), "digests": digests,
                "params_sha256": digests["params"]}
        meta["meta_sha256"] = _meta_sha256(meta)
        self._check_space(step, state)
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
            self.manager.wait_until_finished()
        except (OSError, ValueError, RuntimeError) as e:  # orbax wraps a full disk in these
            raise CheckpointError(
                f"--checkpoint-dir {self.directory}: saving step {step} failed "
                f"({_short(e)}); the steps already there are untouched (orbax writes a "
                "step in a temporary directory and renames it when complete). Free space or "
                "choose another directory; --resume continues from the newest step saved "
                "there, if any") from None

    def _check_space(self, step: int, state: dict[str, Any]) -> None:
        """Refuse a save the disk cannot hold, before orbax starts: its background threads
        report a full disk with pages of their own tracebacks before the error reaches here.
        The arrays' bytes are a lower bound of the step on disk (orbax adds metadata, and
        compresses nothing)."""
        need = sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(state))
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise CheckpointError(
                f"--checkpoint-dir {self.directory}: step {step} needs at least "
                f"{need / 1e6:.1f} MB and {free / 1e6:.1f} MB are free; nothing was written, "
                "the steps already there are untouched. Free space or choose another "
                "directory; --resume continues from the newest step saved there, if any")

    # ------------------------------------------------------------------ restore
    def restore(self, trainer: RLTrainer, expected: dict[str, Any], step: int | None = None,
                *, check_meta: Callable[[dict[str, Any]], None] | None = None
                ) -> dict[str, Any]:
        """Load the newest good step (or exactly ``step``) into ``trainer``; return its metadata.

        Steps are tried newest first. One that cannot be read or fails verification (metadata
        digest, array digests, finiteness) is logged as a warning naming the step and the
        reason and skipped; once a good step is found, the rejected newer ones are moved aside
        (``<step>.corrupt``). Raises :class:`CheckpointError` when a readable checkpoint belongs
        to a different model/algorithm (checked before its arrays are read), whatever
        ``check_meta(meta)`` raises (the caller's hyper-parameter comparison, also before any
        array is read), and :class:`NoGoodCheckpointError` when no step is good (nothing is
        loaded or moved then).
        """
        candidates = [step] if step is not None else self.steps()[::-1]
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        self.skipped, self.quarantined = [], []
        for s in candidates:
            try:
                meta, state = self._load_verified(s, trainer, expected, check_meta)
            except _BadStep as e:
                self.skipped.append((s, str(e)))
                log.warning("checkpoint %s/%s is unusable and was skipped: %s",
                            self.directory, s, e)
                continue
            self._quarantine([b for b, _ in self.skipped])
            self._apply(trainer, meta, state)
            if self.skipped:
                log.warning("resuming from step %s in %s, the newest good checkpoint "
                            "(rejected: %s)", s, self.directory,
                            ", ".join(str(b) for b, _ in self.skipped))
            return meta
        reasons = "; ".join(f"step {s}: {r}" for s, r in self.skipped)
        raise NoGoodCheckpointError(
            f"no usable checkpoint in {self.directory}: every step failed verification "
            f"({reasons}). Nothing was loaded or changed. Restore a backup of that directory, "
            "or start a new run with another --checkpoint-dir.")

    def restore_params(self, step: int, expected: dict[str, Any]
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(metadata, parameters)`` of ``step``: the parameters alone, as host arrays.

        For an export, which needs the policy only. Restoring the whole training state into a
        trainer (parameters, Adam's two moments, the reference, the trainer's own copies, every
        tree once more on the host for the digests) peaked at about ten times the weights' size
        (``bench/results/cpu/export_memory.md``); :func:`read_params` reads the ``params`` arrays
        and nothing else. Verified like a resume, for what is read: the metadata digest,
        ``expected`` (``model`` and the leading ``params`` shapes, compared before any array is
        read), the parameters' digest and finiteness. Any failure is a :class:`CheckpointError`
        naming the step and why; nothing in the directory is changed (no fallback to an older step,
        nothing moved aside).
        """
        where = f"checkpoint {self.directory}/{step}"
        try:
            meta = self._read_meta(step)
        except _BadStep as e:
            raise CheckpointError(f"{where} is unusable: {e}") from None
        saved = meta.get("fingerprint", {})
        saved = {"model": saved.get("model"),
                 "params": (saved.get("params") or [])[:len(expected["params"])]}
        if diffs := _diff(saved, expected):
            raise CheckpointError(f"{where} does not hold this model's weights: "
                                  + "; ".join(diffs[:6]))
        try:
            params = read_params(epath.Path(self.directory) / str(step) / "state")
        except Exception as e:  # orbax/tensorstore raise many types for one cause
            raise CheckpointError(f"{where}: its parameters cannot be read "
                                  f"({type(e).__name__}: {_short(e)})") from e
        try:
            self._verify(meta, {"params": params})
        except _BadStep as e:
            raise CheckpointError(f"{where} is unusable: {e}") from None
        return meta, params

    def _read_meta(self, step: int) -> dict[str, Any]:
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax/tensorstore/json raise many types for one cause
            raise _BadStep(f"its metadata cannot be read ({type(e).__name__}: "
                           f"{_short(e)})") from e
        if not isinstance(meta, dict):
            raise _BadStep("its metadata is not a JSON object")
        if "meta_sha256" in meta and meta["meta_sha256"] != _meta_sha256(meta):
            raise _BadStep("its metadata does not match the digest written with it")
        if meta.get("step") != step:
            raise _BadStep(f"its metadata names step {meta.get('step')!r}")
        return split_legacy(meta)

    def _load_verified(self, step: int, trainer: RLTrainer, expected: dict[str, Any],
                       check_meta: Callable[[dict[str, Any]], None] | None
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Metadata → fingerprint → caller's check → arrays → digests and finiteness."""
        meta = self._read_meta(step)
        diffs = _diff(meta.get("fingerprint", {}), expected)
        if diffs and check_meta is not None and all(d.startswith("parameter shapes")
                                                    for d in diffs):
            check_meta(meta)  # shapes changed by a flag (--lora-rank) are named by that flag
        if diffs:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} was written by a different run and cannot "
                "be resumed here: " + "; ".join(diffs[:6])
                + (f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else "")
                + ". Use another checkpoint_dir or the same model/algorithm.")
        if check_meta is not None:
            check_meta(meta)
        target = self._target(trainer)
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target)))["state"]
        except Exception as e:
            raise _BadStep(f"its arrays cannot be read ({type(e).__name__}: {_short(e)})") from e
        self._verify(meta, jax.tree_util.tree_map(to_host, state))
        return meta, state

    def _target(self, trainer: RLTrainer) -> dict[str, Any]:
        """What orbax restores into: host arrays for a single-device trainer; on a mesh,
        ``ShapeDtypeStruct``s carrying the trainer's shardings, so each array is read straight
        onto the devices and layout this trainer uses (whatever mesh wrote it)."""
        state = self._state(trainer)
        shardings = getattr(trainer, "shardings", None)
        if shardings is None:
            return state
        where = {"params": shardings["params"],
                 "opt_state": jax.tree_util.tree_leaves(shardings["opt"]),
                 "ref": shardings["params"]["lm"]}
        return {part: jax.tree_util.tree_map(
            lambda x, sh: jax.ShapeDtypeStruct(np.shape(x), np.result_type(x), sharding=sh),
            tree, where[part]) for part, tree in state.items()}

    @staticmethod
    def _verify(meta: dict[str, Any], state: dict[str, Any]) -> None:
        digests = meta.get("digests")
        if digests is None:  # written before digests existed: the parameter digest is all
            digests = {"params": meta.get("params_sha256")}
            log.warning("checkpoint of step %s predates optimiser digests: only its parameters "
                        "and finiteness are verified", meta.get("step"))
        for part in ("params", "opt_state", "ref"):
            if part not in state:
                continue
            if part in digests and tree_sha256(state[part]) != digests[part]:
                raise _BadStep(f"the digest of its restored {PARTS[part]} differs from the one "
                               "written at save time (corrupted array data)")
            if (bad := nonfinite_report(state[part])) is not None:
                raise _BadStep(f"found {bad} in its restored {PARTS[part]}")

    def _quarantine(self, steps: list[int]) -> None:
        """Move rejected steps aside so the resumed run can write those step numbers again.
        With several processes (one shared directory) process 0 moves them and the others wait
        for it, so no two hosts rename the same step."""
        if not steps:
            return
        many = jax.process_count() > 1
        if not many or jax.process_index() == 0:
            self._move_aside(steps)
        if many:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxrl_sym quarantine")
        self.manager.reload()

    def _move_aside(self, steps: list[int]) -> None:
        for s in steps:
            src = os.path.join(self.directory, str(s))
            dst, n = src + QUARANTINE_SUFFIX, 1
            while os.path.exists(dst):
                n += 1
                dst = f"{src}{QUARANTINE_SUFFIX}.{n}"
            try:
                os.rename(src, dst)
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint {src} is corrupt and could not be moved aside ({e}); move or "
                    "delete it yourself, then resume again") from e
            self.quarantined.append(dst)
            log.warning("moved the rejected checkpoint %s to %s (delete it once inspected)",
                        src, dst)

    @staticmethod
    def _apply(trainer: RLTrainer, meta: dict[str, Any], state: dict[str, Any]) -> None:
        # restored arrays already sit on the trainer's shardings (see _target); host ones move
        to_dev = lambda t: jax.tree_util.tree_map(
            lambda x: x if isinstance(x, jax.Array) else jnp.asarray(x), t)
        old = trainer.state
        ref = to_dev(state["ref"]) if "ref" in state else old.ref
        opt_state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(old.opt_state),
                                                 to_dev(state["opt_state"]))
        trainer.commit(old.replace(  # the bound systems (the sym runtime) get the weights too
            params=to_dev(state["params"]),
            # a weight decay changed on resume is the trainer's, not the checkpoint's
            opt_state=with_config_hyperparams(opt_state, old.opt_state),
            ref=ref, step=int(meta["step"])))


def read_params(item_dir: epath.Path, group_bytes: int = 64 * 2**20) -> Any:
    """The ``params`` tree of a saved state item as host arrays, nothing else read.

    In groups of about ``max(group_bytes, total / 16, largest array)`` bytes, one orbax restore
    per group (the rest of the tree, optimiser state and reference included, is a
    ``PLACEHOLDER``): one restore of a whole policy peaked well above its size in RSS (tensorstore's
    read buffers, kept by the allocator), groups of 64 MiB at little above it
    (``bench/results/cpu/export_memory.md``). The item's own handler is used (the format
    ``StandardSave`` wrote): a ``Checkpointer`` on the item directory warns about missing step
    metadata.
    """
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(item_dir).tree
        shapes, treedef = jax.tree_util.tree_flatten(jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree["params"]))
        sizes = [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in shapes]
        limit = max([group_bytes, sum(sizes) // 16, *sizes])
        rest = {k: jax.tree_util.tree_map(lambda _: ocp.PLACEHOLDER, v)
                for k, v in tree.items() if k != "params"}
        out: list[Any] = [None] * len(shapes)
        start = 0
        while start < len(shapes):
            end, used = start, 0
            while end < len(shapes) and (end == start or used + sizes[end] <= limit):
                used, end = used + sizes[end], end + 1
            item = jax.tree_util.tree_unflatten(treedef, [
                x if start <= i < end else ocp.PLACEHOLDER for i, x in enumerate(shapes)])
            got = handler.restore(item_dir, args=ocp.args.PyTreeRestore(
                item={**rest, "params": item}))["params"]
            leaves = treedef.flatten_up_to(got)  # the group's arrays, PLACEHOLDER elsewhere
            out[start:end] = leaves[start:end]
            start = end
    finally:
        handler.close()
    return jax.tree_util.tree_unflatten(treedef, out)


def _short(e: BaseException, limit: int = 160) -> str:
    """First line of an exception, cut: tensorstore errors embed a page-long JSON spec."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if len(text) <= limit else text[:limit] + "…"
