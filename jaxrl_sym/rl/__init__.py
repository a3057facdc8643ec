"""RL fine-tuning on exact-length buffers: GRPO / RLOO / PPO steps, offline tasks, training loop.

The step (:class:`~jaxrl_sym.rl.step.trainer.RLTrainer`) runs on the symbolic runtime
(``system="sym"``) or on the padded/masked baseline (``system="padded"``) with the same model,
reward and loss code.

The package is four rooms, each importing only from the modules listed before it:
:mod:`.names` and :mod:`.errors` (shared by every room); :mod:`.tasks`, what a run learns and how
it is scored; :mod:`.knobs` and :mod:`.config`, the JAX-free configuration objects (a step's
knobs by concern, and the run around them; the CLI builds them to check its flags);
:mod:`.algorithms`, the maths (advantages, losses); :mod:`.step`, one step's machinery (the
trainer, its stages, layouts, compiled programs, the step's ledger); and :mod:`.run`, a training
run around it (the ``train`` / ``eval`` commands, the loop, checkpoints, signals, trackers,
evaluation, export).

The public names are loaded on first use (PEP 562), as in the top-level package: the ``train``
command imports :mod:`jaxrl_sym.rl.run.cli` to check its flags before JAX is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxrl_sym.rl.config import (
        CheckpointConfig,
        PartialConfig,
        RLConfig,
        RunConfig,
    )
    from jaxrl_sym.rl.errors import CheckpointError, RewardError
    from jaxrl_sym.rl.knobs import AlgorithmConfig, ExecutionConfig, OptimizerConfig
    from jaxrl_sym.rl.names import TASK_NAMES
    from jaxrl_sym.rl.step.rollout import BatchReward
    from jaxrl_sym.rl.step.sampling import SamplingConfig
    from jaxrl_sym.rl.step.trainer import RLTrainer, Rollout, compute_rewards, params_sha256
    from jaxrl_sym.rl.tasks.token_tasks import Task, get_task

_HOME = {
    **dict.fromkeys(("CheckpointConfig", "PartialConfig", "RLConfig", "RunConfig"),
                    "jaxrl_sym.rl.config"),
    **dict.fromkeys(("AlgorithmConfig", "ExecutionConfig", "OptimizerConfig"),
                    "jaxrl_sym.rl.knobs"),
    "SamplingConfig": "jaxrl_sym.rl.step.sampling",
    "BatchReward": "jaxrl_sym.rl.step.rollout",
    "CheckpointError": "jaxrl_sym.rl.errors",
    "RewardError": "jaxrl_sym.rl.errors",
    "TASK_NAMES": "jaxrl_sym.rl.names",
    **dict.fromkeys(("RLTrainer", "Rollout", "compute_rewards", "params_sha256"),
                    "jaxrl_sym.rl.step.trainer"),
    **dict.fromkeys(("Task", "get_task"), "jaxrl_sym.rl.tasks.token_tasks"),
}

__all__ = [
    "TASK_NAMES",
    "AlgorithmConfig",
    "BatchReward",
    "CheckpointConfig",
    "CheckpointError",
    "ExecutionConfig",
    "OptimizerConfig",
    "PartialConfig",
    "RLConfig",
    "RLTrainer",
    "RewardError",
    "Rollout",
    "RunConfig",
    "SamplingConfig",
    "Task",
    "compute_rewards",
    "get_task",
    "params_sha256",
]


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'jaxrl_sym.rl' has no attribute {name!r}")
