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
# # Storage: how each attention pattern becomes a store
#
# The storage planner never looks at a pattern's *name*: it classifies the index expression of
# the edge from the keys to the attention node (`classify_access`) and sizes a store from it.
#
# | pattern | keys read by the query at t | planner's store |
# |---|---|---|
# | full (causal) | `0:t+1` — unbounded | growing buffer, capacity doubles when full |
# | window w | `max(0,t-w+1):t+1` — at most w, start monotone | ring of w slots |
# | block b | `t-(t mod b):t+1` — at most b, start resets | block buffer of b slots |
# | linear | `0:t+1`, consumed by a sum | recurrent state (S, z), no keys kept |
#
# Below: the plan and the concrete store layouts for each pattern, then the bytes the runtime
# holds at every decode step (its own memory meter), against the padded baseline's fixed
# `P + N` caches. Rows finish at different lengths, so the symbolic runtime also compacts its
# batch (drops finished rows once at most half the bucket is live).

# %%
import os

import jax
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

import jaxrl_sym.runtime.engine as engine_mod
from jaxrl_sym import (
    Block,
    Causal,
    DecoderLM,
    EngineOptions,
    GenerationConfig,
    Linear,
    LMConfig,
    SymbolicLM,
    Window,
    padded_generate,
)
from jaxrl_sym.runtime.metrics import MemoryMeter

QUICK = os.environ.get("JAXRL_SYM_NB_QUICK") == "1"
W = B = 16
PATTERNS = {"full": Causal(), f"window {W}": Window(W), f"block {B}": Block(B), "linear": Linear()}
base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
            ffn_dim=64)

# %% [markdown]
# ## The plans and the store layouts
# `init_stores(batch, capacity)` is traced abstractly (`jax.eval_shape`), so this shows the
# arrays each store would hold for 8 rows with a growing store's capacity at 128.

# %%
engines = {}
for name, pat in PATTERNS.items():
    model = DecoderLM(LMConfig(**base, patterns=(pat, pat)), rngs=nnx.Rngs(0))
    eng = engines[name] = (model, SymbolicLM(model, EngineOptions(min_capacity=32)))
    print(f"== {name}")
    print(eng[1].plan.to_text())
    layouts = jax.eval_shape(lambda e=eng[1]: e.builder.init_stores(8, 128))
    for node, arrays in layouts.items():
        print(f"   store %{node}: " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in arrays.items()))

# %% [markdown]
# ## Memory over time
# The runtime's `MemoryMeter` samples `weights + stores + the running program's temporaries`
# after every step; wrapping it records the samples. Eight rows (four at the quick size) with
# limits spread from short to long; the padded baseline holds its caches for `P + N` slots
# from the first step to the last.

# %%
samples: list[list[tuple[int, int]]] = []


class RecordingMeter(MemoryMeter):
    """The runtime's meter, keeping each generate call's samples for plotting."""

    def __init__(self) -> None:
        super().__init__()
        samples.append(self.samples)


engine_mod.MemoryMeter = RecordingMeter  # the engine looks the class up at call time
rng = np.random.default_rng(0)
rows = 4 if QUICK else 8
prompts = [rng.integers(1, 64, size=int(n), dtype=np.int32) for n in rng.integers(8, 16, rows)]
top = 48 if QUICK else 384
limits = tuple(int(x) for x in np.linspace(top // rows, top, rows))
gen = GenerationConfig(max_new_tokens=limits)

fig, axes = plt.subplots(1, len(PATTERNS), figsize=(4.2 * len(PATTERNS), 3.4), sharey=True)
for ax, (name, (model, eng)) in zip(axes, engines.items(), strict=True):
    samples.clear()
    res = eng.generate(prompts, gen)
    steps, held = zip(*samples[-1], strict=True)
    pad = padded_generate(model, prompts, gen)
    assert all(np.array_equal(a, b) for a, b in zip(res.tokens, pad.tokens, strict=True))
    ax.step(steps, np.array(held) / 2**10, where="post", color="tab:blue", label="sym")
    ax.hlines(pad.stats["peak_bytes"] / 2**10, 0, max(limits), color="tab:red",
              label="padded (P + N slots from the start)")
    ax.set_title(f"{name}: peak {res.stats['peak_bytes'] / 2**10:.0f} vs "
                 f"{pad.stats['peak_bytes'] / 2**10:.0f} KiB", fontsize=10)
    ax.set_xlabel("decode step")
    ax.grid(alpha=0.3)
axes[0].set_ylabel("bytes held (KiB)")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()
engine_mod.MemoryMeter = MemoryMeter

# %% [markdown]
# Reading the plot: with full attention the growing store doubles (steps in the blue line) and
# halves its rows when half of them are done; window and block stores stay at `w`/`b` slots and
# linear attention at its fixed state, so their memory only *falls* as rows finish. The padded
# baseline's line is flat at the top: every row holds `P + N` slots until the longest row ends.
