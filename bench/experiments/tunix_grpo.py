"""Tunix's GRPO learner (``google-tunix`` 0.1.7) on ``rlft_step``'s workload: a peer row for the
RL step.

Same policy shape and weights (rlft_step's shrunk Qwen2.5, copied into Tunix's Qwen2 by
:mod:`jaxrl_sym.baselines.tunix`; the reference is a second copy), same prompts, group size G, β,
clip ε 0.2, Adam at 1e-4, one iteration per batch, temperature 1.0. What differs by Tunix's design:
it has one response length per batch (its sampler stops a row only at EOS, and a random policy
never samples one), so every response has ``max(limits)`` tokens — run ``rlft_step --sigma 0``
for the comparable row of our systems (all responses at the median). Step time: the wall time
between consecutive reward calls (one per step: rollout, reference, reward, update in between);
the first two intervals (the rollout's and the update's compiles) are reported apart.

The GRPO learner imports Tunix's trainer stack, which the light install leaves out; without
touching the project's venv, put those packages in a directory of their own::

    pip install --no-deps --target /tmp/tunix_rl_deps google-metrax grain qwix omegaconf \
        array_record cloudpickle clu ml_collections portpicker tensorboardX wrapt
    PYTHONPATH=/tmp/tunix_rl_deps python -m bench tunix_grpo --preset full --sigma 0 \
        --steps 3 --out bench/results/cpu/tunix_grpo.json

The sizes (model, prompts, group, scale, β, seed) are ``rlft_step``'s preset of the same name.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from bench import presets
from bench.experiments import rlft_step
from bench.lib.record import peer_report

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"sigma": 0.0, "steps": 1, "out": None},
    "full": {"sigma": 0.0, "steps": 4, "out": None},
    "gpu": {"sigma": 0.0, "steps": 4, "out": None},
}


def _ids(text: str) -> np.ndarray:
    return np.array([int(t) for t in text.split()], np.int64)


def build(args: argparse.Namespace, prompts: list[np.ndarray], n: int, stamps: list[float]
          ) -> Any:
    """Tunix's RLCluster + GRPOLearner for the workload; ``stamps`` gets a time per reward call."""
    import importlib

    import jax
    import optax

    from jaxrl_sym.baselines.tunix import _IdTokenizer, load_tunix, to_tunix
    from jaxrl_sym.models.lm import init_model, preset

    tx = load_tunix()
    rl_cluster = importlib.import_module("tunix.rl.rl_cluster")
    grpo = importlib.import_module("tunix.rl.grpo.grpo_learner")
    base_rollout = importlib.import_module("tunix.rl.rollout.base_rollout")
    model = init_model(preset("small", **rlft_step.model_config(args)), args.seed)
    vocab = model.cfg.vocab_size
    prompt_len = 1 << (max(p.size for p in prompts) - 1).bit_length()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = rl_cluster.Role
    cluster_cfg = rl_cluster.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster.RLTrainingConfig(
            actor_optimizer=optax.adam(1e-4), eval_every_n_steps=10**9,
            max_steps=1 + args.steps, checkpoint_root_directory=None,
            metrics_logging_options=None, pbar_description=None),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=n, max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + n, temperature=1.0, top_p=1.0, eos_tokens=[vocab]))
    cluster = rl_cluster.RLCluster(actor=to_tunix(model, tx), reference=to_tunix(model, tx),
                                   tokenizer=_IdTokenizer(vocab, vocab), cluster_config=cluster_cfg)

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        stamps.append(time.perf_counter())
        return [rlft_step.reward_fn(_ids(p), _ids(c))
                for p, c in zip(prompts, completions, strict=True)]

    algo = grpo.GRPOConfig(num_generations=args.group, num_iterations=1, beta=args.beta,
                           epsilon=0.2)
    return grpo.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[reward])


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts, limits = rlft_step.workload(args)
    n = max(limits)
    stamps: list[float] = []
    learner = build(args, prompts, n, stamps)
    # One array leaf: Tunix tree-maps over a batch (a list would make each string a leaf).
    batch = {"prompts": np.array([" ".join(map(str, p.tolist())) for p in prompts])}
    t0 = time.perf_counter()
    learner.train([batch] * (1 + args.steps))
    total = time.perf_counter() - t0
    steps = np.diff(stamps).tolist()
    responses = args.prompts * args.group * n
    # steps[0] holds the first update, which compiles the training programs: not steady state.
    steady = steps[1:]
    step = statistics.median(steady) if steady else float("nan")
    return {"system": "tunix", "response_tokens_per_row": n, "response_tokens": responses,
            "prompt_tokens": int(sum(p.size for p in prompts)) * args.group,
            "first_step_seconds": stamps[0] - t0 if stamps else None,
            "step_seconds": steps, "median_step_seconds": step, "train_seconds": total,
            "response_tokens_per_s": responses / step if steady else None,
            "reward_calls": len(stamps)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("tunix_grpo", __doc__, PRESETS)
    p.add_argument("--sigma", type=presets.finite_at_least(0), default=None,
                   help="log-normal sigma of lengths (0: every response at the median)")
    p.add_argument("--steps", type=presets.at_least(1), default=None,
                   help="steps after the first; the median skips the first of them too (it "
                        "holds the update's compile)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = rlft_step.parse_args(["--preset", args.preset])  # model, prompts, group, scale, beta
    for k in ("model", "scale", "prompts", "group", "beta", "seed"):
        setattr(args, k, getattr(sizes, k))
    config = {"preset": args.model, **{k: getattr(args, k) for k in (
        "scale", "prompts", "group", "sigma", "beta", "steps", "seed")}}
    peer_report({"config": config, **run(args)}, presets.command("tunix_grpo", argv), args.out)
    return 0
