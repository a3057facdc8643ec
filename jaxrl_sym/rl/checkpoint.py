"""Orbax checkpoints of an RL run: parameters, optimiser state, reference, and a fingerprint.

Why a fingerprint: restoring Adam moments or weights of another architecture either fails deep
inside orbax with a shape message or — worse, when shapes happen to agree — silently resumes the
wrong model. The fingerprint (model config, parameter shapes/dtypes, algorithm, task, seed) is
saved as JSON next to the arrays and compared *before* any array is read.

Atomicity comes from orbax's ``CheckpointManager``: a step is written into a temporary directory
and renamed into place only once complete, so an interrupted save never becomes "the latest
checkpoint".
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_sym.rl.errors import CheckpointError
from jaxrl_sym.rl.step import RLTrainer


def fingerprint(trainer: RLTrainer, **run: Any) -> dict[str, Any]:
    """What must agree for a checkpoint to be resumable by ``trainer`` (JSON-serialisable)."""
    model = {k: v for k, v in trainer.model_fingerprint.items() if k != "params"}
    shapes = [[list(np.shape(x)), str(np.asarray(x).dtype)]
              for x in jax.tree_util.tree_leaves(trainer.params)]
    return {"model": model, "params": shapes, "algo": trainer.cfg.algo,
            "beta_positive": trainer.cfg.beta > 0, **run}


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
                       f"{len(b or [])} here)")
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


class Checkpointer:
    """Save / find / restore RL training state under ``directory`` (one sub-directory per step)."""

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int = 3) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                            enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=opts)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    @staticmethod
    def _state(trainer: RLTrainer) -> dict[str, Any]:
        state: dict[str, Any] = {
            "params": trainer.params,
            "opt_state": jax.tree_util.tree_leaves(trainer.opt_state),
        }
        if trainer.ref_leaves is not None:
            state["ref"] = trainer.ref_leaves
        return state

    def save(self, step: int, trainer: RLTrainer, meta: dict[str, Any]) -> None:
        """Write step ``step`` (blocking; renamed into place when complete)."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(self._state(trainer)),
            meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, trainer: RLTrainer, expected: dict[str, Any], step: int | None = None
                ) -> dict[str, Any]:
        """Load step ``step`` (default: latest) into ``trainer``; returns the saved metadata.

        Raises :class:`CheckpointError` when the checkpoint's fingerprint differs from
        ``expected`` (checked before any array is read) or the arrays cannot be restored.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:
            raise CheckpointError(f"checkpoint {self.directory}/{step} has no readable "
                                  f"metadata ({type(e).__name__}: {e})") from e
        diffs = _diff(meta.get("fingerprint", {}), expected)
        if diffs:
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} was written by a different run and cannot "
                "be resumed here: " + "; ".join(diffs[:6])
                + (f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else "")
                + ". Use another checkpoint_dir or the same model/algorithm/task/seed.")
        target = jax.tree_util.tree_map(np.asarray, self._state(trainer))
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target)))["state"]
        except Exception as e:
            raise CheckpointError(f"could not restore arrays of {self.directory}/{step} "
                                  f"({type(e).__name__}: {e})") from e
        to_dev = lambda t: jax.tree_util.tree_map(jnp.asarray, t)
        trainer.params = to_dev(restored["params"])
        trainer.opt_state = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(trainer.opt_state), to_dev(restored["opt_state"]))
        if trainer.ref_leaves is not None:
            trainer.ref_leaves = to_dev(restored["ref"])
        trainer.steps_done = int(meta["step"])
        if trainer._engine is not None:
            trainer._engine.set_params(trainer.params["lm"])
        return meta
