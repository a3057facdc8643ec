"""The RL layer's choices as plain names, importable without JAX.

Why a module of its own: ``jaxrl-sym train`` offers these as ``argparse`` choices and must reject
a bad flag before paying JAX's multi-second import; the modules that implement the choices
(algorithms, layouts, tasks) import JAX and re-export these tuples from here.
"""

ALGOS = ("grpo", "rloo", "ppo")
LOSS_AGGS = ("token_mean", "seq_mean", "token_sum")
ADV_NORMS = ("group_std", "batch_std", "none")
LR_SCHEDULES = ("constant", "cosine", "linear")
OPTIMIZERS = ("adam", "adamw", "sgd", "lion", "adafactor")  # optax's, jaxrl_sym.rl.step.state
PG_LOSSES = ("ppo_clip", "gspo", "cispo")  # policy-gradient terms, jaxrl_sym.rl.algorithms.losses
TASK_NAMES = ("reverse", "copy", "sort", "add")  # token tasks of the built-in model
TEXT_TASK_NAMES = ("word-problems",)  # text tasks of a --model checkpoint, plus "jsonl:PATH"
TASK_HELP = (f"one of {', '.join(TASK_NAMES)} (the built-in model); with --model a text task: "
             f"{', '.join(TEXT_TASK_NAMES)} (word-problems:K: at most K operations, 1-4; "
             f"word-problems:K:N: no stated number above N; "
             f"word-problems:K:N:D: at most D irrelevant sentences, 0-2; "
             f"defaults: K 3, N 59, D 2) or jsonl:FILE ({{prompt, answer}} lines; "
             f"--dataset FILE instead reads JSON, CSV, Parquet and other field names)")
"""The ``--task`` help: every task name, from this one place."""
