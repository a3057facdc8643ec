"""Throughput vs device count of the sharded RL step and generation (mechanics only).

One child process per device count (``XLA_FLAGS=--xla_force_host_platform_device_count=N``,
``--mesh data=N``); each times, after a warm-up that compiles everything, generation of a batch
(sampled with the warm-up's seed, so no shape is new: tokens/s) and the training update on that
batch's samples (loss-grad-Adam program, samples/s), and reads the per-device bytes of
parameters + optimiser state.

    python -m bench sharding --preset full         # 1 (no mesh and data=1), 2, 4, 8
    python -m bench sharding --preset full --devices 1,8 --out /tmp/sharding

What this measures on CPU: virtual devices are threads of one host sharing its cores, so more
devices cannot be faster here — the numbers show the partitioned programs run, what their
collectives cost relative to one device, and that per-device memory falls as 1/N. Speed-up
needs real accelerators. With one device the child also runs without a mesh (the unsharded
path), interleaved with ``data=1``, so the first two rows show what a 1-device mesh costs over
it. Writes ``<out>.jsonl`` (one line per
device count) and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from bench import presets
from bench.lib import child

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"devices": "1,2", "prompts": 2, "repeats": 1,
              "out": os.path.join(presets.quick_dir("sharding"), "sharding")},
    "full": {"devices": "1,2,4,8", "prompts": 8, "repeats": 3,
             "out": os.path.join(child.ROOT, "bench", "results", "cpu", "sharding")},
    # virtual CPU devices on any machine: the GPU preset is the CPU measurement
    "gpu": {"devices": "1,2,4,8", "prompts": 8, "repeats": 3,
            "out": os.path.join(child.ROOT, "bench", "results", "cpu", "sharding")},
}


def measure(n: int, prompts: int, repeats: int) -> list[dict[str, Any]]:
    """In a process with ``n`` devices: timings of generation and of the update on the mesh
    ``data=n``; with one device also without a mesh, interleaved call by call with the mesh's
    (process-to-process noise on a shared CPU is larger than the difference looked for)."""
    import jax
    import numpy as np

    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLConfig, RLTrainer, compute_rewards, get_task
    from jaxrl_sym.rl.step.stages import update_once
    from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE

    task = get_task("reverse", max_digits=3)
    cfg = RLConfig.of(algo="grpo", group_size=8, beta=0.0, eos_id=EOS,
                      max_new_tokens=task.max_new_tokens, lr=1e-3)
    model = init_model(preset("small", vocab_size=VOCAB_SIZE), 0)
    batch = task.sample(np.random.default_rng(0), prompts)
    meshes = [None, "data=1"] if n == 1 else [f"data={n}"]
    runs = []
    for mesh in meshes:
        tr = RLTrainer(model, task.reward, cfg, mesh=mesh)
        rollout = tr.generate(batch, seed=0)  # warm-up: compiles generation
        rewards = compute_rewards(task.reward, rollout.prompts, rollout.responses)
        layout, arrays = tr.prepare(rollout, rewards)
        # warm-up: compiles the update (one optimiser update, as the step's; not committed)
        # (update_once consumes the state it is given: donated buffers, so it gets copies)
        update_once(tr.context, *_copies(tr), tr.state, layout, arrays)
        runs.append({"tr": tr, "mesh": mesh, "layout": layout, "arrays": arrays, "gen": [],
                     "upd": [], "tokens": 0, "samples": len(rollout.responses)})
    for _ in range(repeats):
        for r in runs:
            tr = r["tr"]
            t = time.perf_counter()
            ro = tr.generate(batch, seed=0)  # the warm-up's samples: same shapes, no compiles
            r["gen"].append(time.perf_counter() - t)
            r["tokens"] += sum(len(x) for x in ro.responses)
            state = _copies(tr)
            t = time.perf_counter()
            out = update_once(tr.context, *state, tr.state, r["layout"], r["arrays"])
            jax.block_until_ready(out[0])
            r["upd"].append(time.perf_counter() - t)
    return [_row(n, r, repeats) for r in runs]


def _row(n: int, r: dict[str, Any], repeats: int) -> dict[str, Any]:
    import jax
    import numpy as np

    from jaxrl_sym.sharding import per_device_bytes

    tr = r["tr"]
    per = per_device_bytes({"params": tr.params, "opt": tr.opt_state})
    total = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves((tr.params, tr.opt_state)))
    return {"devices": n, "mesh": r["mesh"] or "none", "samples": r["samples"],
            "layout_rows": r["layout"].shape[0],
            "generation_tokens_per_s": r["tokens"] / sum(r["gen"]),
            "generation_seconds_median": float(np.median(r["gen"])),
            "update_samples_per_s": r["samples"] * repeats / sum(r["upd"]),
            "update_seconds_median": float(np.median(r["upd"])),
            "state_bytes": total, "max_state_bytes_per_device": max(per.values()),
            "platform": jax.devices()[0].platform}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, every setting of the chosen preset filled in."""
    p = presets.parser("sharding", __doc__, PRESETS)
    p.add_argument("--devices", default=None, type=presets.ints(1),
                   help="device counts, one child each")
    p.add_argument("--out", default=None, help="OUT.jsonl and OUT.md")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return presets.parse(p, PRESETS, argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child is not None:
        print(json.dumps(measure(a.child, a.prompts, a.repeats)))
        return 0
    rows = []
    for n in presets.csv(a.devices, int):
        env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}
        res = child.run(child.experiment("sharding", "--preset", a.preset, "--child", str(n)),
                        env=env)
        if not res.ok:
            print(res.stderr[-3000:], file=sys.stderr)
            return res.returncode or 1
        for row in json.loads(res.stdout.strip().splitlines()[-1]):
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(a.out + ".md", "w") as f:
        f.write("| devices | mesh | generation tok/s | generation s (median) | update samples/s | "
                "update s (median) | "
                "state MB / device | state MB total |\n|---|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['devices']} | {r['mesh']} | {r['generation_tokens_per_s']:.0f} | "
                    f"{r['generation_seconds_median']:.4f} | "
                    f"{r['update_samples_per_s']:.1f} | {r['update_seconds_median']:.3f} | "
                    f"{r['max_state_bytes_per_device'] / 1e6:.2f} | "
                    f"{r['state_bytes'] / 1e6:.2f} |\n")
    return 0


def _copies(tr: Any) -> tuple[Any, Any]:
    """Copies of the trainer's parameters and optimiser state, ready before a timer starts."""
    import jax
    import jax.numpy as jnp

    out = jax.tree_util.tree_map(jnp.copy, (tr.params, tr.opt_state))
    jax.block_until_ready(out)
    return out
