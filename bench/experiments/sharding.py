"""Throughput vs device count of the sharded RL step and generation (mechanics only).

One child process per device count (``XLA_FLAGS=--xla_force_host_platform_device_count=N``,
``--mesh data=N``); each times, after a warm-up that compiles everything, generation of a batch
(sampled with the warm-up's seed, so no shape is new: tokens/s) and the training update on that
batch's samples (loss-grad-Adam program, samples/s), and reads the per-device bytes of
parameters + optimiser state.

    .venv/bin/python bench/sharding.py                    # 1 (no mesh and data=1), 2, 4, 8
    .venv/bin/python bench/sharding.py --devices 1,8 --out /tmp/sharding

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
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "results", "cpu", "sharding")


def child(n: int, prompts: int, repeats: int) -> list[dict[str, Any]]:
    """In a process with ``n`` devices: timings of generation and of the update on the mesh
    ``data=n``; with one device also without a mesh, interleaved call by call with the mesh's
    (process-to-process noise on a shared CPU is larger than the difference looked for)."""
    import jax
    import numpy as np

    from jaxrl_sym.models.lm import init_model, preset
    from jaxrl_sym.rl import RLConfig, RLTrainer, compute_rewards, get_task
    from jaxrl_sym.rl.tasks import EOS, VOCAB_SIZE

    task = get_task("reverse", max_digits=3)
    cfg = RLConfig(algo="grpo", group_size=8, beta=0.0, eos_id=EOS,
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
        tr._update(tr.params, tr.opt_state, layout, arrays)  # warm-up: compiles the update
        runs.append({"tr": tr, "mesh": mesh, "layout": layout, "arrays": arrays, "gen": [],
                     "upd": [], "tokens": 0, "samples": len(rollout.responses)})
    for _ in range(repeats):
        for r in runs:
            tr = r["tr"]
            t = time.perf_counter()
            ro = tr.generate(batch, seed=0)  # the warm-up's samples: same shapes, no compiles
            r["gen"].append(time.perf_counter() - t)
            r["tokens"] += sum(len(x) for x in ro.responses)
            t = time.perf_counter()
            out = tr._update(tr.params, tr.opt_state, r["layout"], r["arrays"])
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="1,2,4,8", help="device counts, one child each")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (x8 samples)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=OUT)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(child(a.child, a.prompts, a.repeats)))
        return 0
    rows = []
    for n in (int(x) for x in a.devices.split(",")):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
               "JAX_PLATFORMS": "cpu"}
        proc = subprocess.run([sys.executable, __file__, "--child", str(n), "--prompts",
                               str(a.prompts), "--repeats", str(a.repeats)], env=env,
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        for row in json.loads(proc.stdout.strip().splitlines()[-1]):
            rows.append(row)
            print(json.dumps(row), flush=True)
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


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())
