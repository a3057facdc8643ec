# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # GRPO on digit reversal
#
# The RL layer end to end on an offline task: prompts are digit strings, the policy must answer
# with the digits reversed, the reward scores the answer (partial credit per digit, exact match
# reported separately). Every step samples a group of responses per prompt with the symbolic
# runtime (rows stop at their own EOS), computes group-relative advantages (GRPO), and updates
# the policy on packed exact-length sequences — no `MAX_LEN` padding anywhere.
#
# A short run here (a minute on a CPU; a few steps when `JAXRL_SYM_NB_QUICK=1`), next to the
# committed 400-step run `bench/results/cpu/train_grpo_reverse_400.jsonl`
# (`jaxrl-sym train --algo grpo --task reverse --steps 400`).

# %%
import json
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from jaxrl_sym import train

QUICK = os.environ.get("JAXRL_SYM_NB_QUICK") == "1"
ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
STEPS, PROMPTS, GROUP = (8, 8, 4) if QUICK else (40, 16, 8)

# %%
out = train("grpo", "reverse", steps=STEPS, seed=0, prompts_per_step=PROMPTS, group_size=GROUP,
            progress=False, eval_prompts=32 if QUICK else 128)
hist = out["history"]
print(f"{out['steps']} steps in {out['seconds']:.1f} s; final greedy exact match "
      f"{out['final_exact_match']:.3f}")
print("step 1:", {k: round(hist[0][k], 3) for k in ("reward", "exact_match", "entropy")})
print(f"step {len(hist)}:", {k: round(hist[-1][k], 3) for k in ("reward", "exact_match",
                                                                "entropy")})
print("packed training rows wasted (padding fraction), mean:",
      round(float(np.mean([m["padding_fraction"] for m in hist])), 3))

# %% [markdown]
# ## The reward curve

# %%
def smooth(x, k=10):
    x = np.asarray(x, float)
    k = max(1, min(k, len(x)))
    return np.convolve(x, np.ones(k) / k, mode="valid"), np.arange(k, len(x) + 1)


committed = ROOT / "bench" / "results" / "cpu" / "train_grpo_reverse_400.jsonl"
long_run = ([json.loads(line) for line in committed.read_text().splitlines() if line.strip()]
            if committed.exists() else [])

fig, axes = plt.subplots(1, 2 if long_run else 1, figsize=(12 if long_run else 6, 3.6),
                         squeeze=False)
ax = axes[0][0]
steps = [m["step"] for m in hist]
ax.plot(steps, [m["reward"] for m in hist], "o-", ms=3, label="reward (mean over samples)")
ax.plot(steps, [m["exact_match"] for m in hist], "s-", ms=3, label="exact match")
ax.set_title(f"this notebook: {len(hist)} steps, {PROMPTS} prompts × {GROUP}")
ax.set_xlabel("step")
ax.legend()
ax.grid(alpha=0.3)
if long_run:
    ax = axes[0][1]
    for key, label in (("reward", "reward"), ("exact_match", "exact match")):
        y, x = smooth([m[key] for m in long_run], 20)
        ax.plot(x, y, label=f"{label} (20-step mean)")
    ax.set_title("committed run: 400 steps, 32 prompts × 8")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %%
assert len(hist) == STEPS and all(np.isfinite(m["reward"]) for m in hist)
