"""RL fine-tuning on exact-length buffers: GRPO / RLOO / PPO steps, offline tasks, training loop.

The step (:class:`~jaxrl_sym.rl.step.RLTrainer`) runs on the symbolic runtime (``system="sym"``)
or on the padded/masked baseline (``system="padded"``) with the same model, reward and loss code.
"""

from jaxrl_sym.rl.algorithms import RLConfig
from jaxrl_sym.rl.errors import CheckpointError, RewardError
from jaxrl_sym.rl.step import RLTrainer, Rollout, compute_rewards, params_sha256
from jaxrl_sym.rl.tasks import TASK_NAMES, Task, get_task

__all__ = [
    "TASK_NAMES",
    "CheckpointError",
    "RLConfig",
    "RLTrainer",
    "RewardError",
    "Rollout",
    "Task",
    "compute_rewards",
    "get_task",
    "params_sha256",
]
