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
# # Quickstart: a Flax model, its dependence graph, its symbols, and a decode
#
# `jaxrl_sym` traces a plain Flax NNX language model **once** with a symbolic sequence length
# into a polyhedral dependence graph (PDG): nodes are repeated operations over the iterators
# `r` (row) and `t` (position); edges carry symbolic index expressions such as `0:t+1` (a query
# at `t` reads every earlier key) or `max(0,t-w+1):t+1` (a sliding window). A storage planner
# reads those expressions and picks a store per attention layer — a growing buffer, a ring of
# `w` slots, a recurrent state — and generation then runs on exact-size buffers.
#
# This notebook walks through that on a two-layer model (one window layer, one full layer) and
# compares a decode against the padded/masked XLA baseline on the same weights.
#
# `JAXRL_SYM_NB_QUICK=1` (set by the test suite) keeps every size small.

# %%
import os

import jax
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxrl_sym import (
    Causal,
    DecoderLM,
    GenerationConfig,
    LMConfig,
    SymbolicLM,
    Window,
    padded_generate,
)
from jaxrl_sym.passes.storage import live_count_fn
from jaxrl_sym.passes.stores import RING
from jaxrl_sym.symbols import classify_access, compile_index, evaluate_index

QUICK = os.environ.get("JAXRL_SYM_NB_QUICK") == "1"
WINDOW = 8

# %% [markdown]
# ## 1. A Flax model
# Nothing special about it: RMSNorm, RoPE, grouped-query attention, SwiGLU. Its attention calls
# `attend(q, k, v, pattern, ...)`, a JAX primitive whose default lowering is a masked reference,
# so called normally under `jax.jit` the model *is* the padded baseline.

# %%
cfg = LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
               ffn_dim=64, patterns=(Window(WINDOW), Causal()))
model = DecoderLM(cfg, rngs=nnx.Rngs(0))
n_params = sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model)))
print(f"{n_params:,} parameters; layer patterns {cfg.layer_patterns()}")

# %% [markdown]
# ## 2. Trace it: the PDG and the storage plan

# %%
engine = SymbolicLM(model)
pdg = engine.pdg
print(pdg.stats())
text = pdg.to_text().splitlines()
print("\n".join(text[:4] + ["…"] + [ln for ln in text if "sym_attention" in ln or "sample" in ln]))
print()
print(engine.plan.to_text())

# %% [markdown]
# The full graph has ~200 nodes (every multiply and reshape of the model). Below it is drawn
# condensed: the inputs, the projections that feed attention, the attention nodes, the sampler
# and the feedback edge that closes the generation loop; a grey edge stands for a chain of
# position-wise operations (index `t` → `t`), a blue edge is labelled with its index expression.

# %%
def condensed(pdg):
    """Kept nodes and the edges between them through chains of non-kept nodes."""
    ranged = {(e.src, e.dst): e for e in pdg.ranged_edges()}
    feedback = [e for e in pdg.edges if e.kind == "feedback"]
    keep = {n.id for n in pdg.nodes if n.domain and n.op in ("input", "sym_attention", "sample")}
    keep |= {s for s, _ in ranged} | {e.src for e in feedback} | {e.dst for e in feedback}
    keep |= {o for o in pdg.outputs}
    succ = {}
    for e in pdg.edges:
        if e.kind == "data" and pdg.node(e.src).domain:
            succ.setdefault(e.src, []).append(e.dst)
    edges = {}
    for k in keep:
        stack, seen = list(succ.get(k, [])), set()
        while stack:
            j = stack.pop()
            if j in seen:
                continue
            seen.add(j)
            if j in keep:
                e = ranged.get((k, j))
                edges[(k, j)] = e.label() if e else ""
            else:
                stack += succ.get(j, [])
    for e in feedback:
        edges[(e.src, e.dst)] = "feedback " + e.label()
    return sorted(keep), edges


def draw_pdg(pdg, ax):
    nodes, edges = condensed(pdg)
    depth = {n: 0 for n in nodes}
    for _ in nodes:  # longest path over the (acyclic) data edges
        for (a, b), lab in edges.items():
            if not lab.startswith("feedback"):
                depth[b] = max(depth[b], depth[a] + 1)
    levels = {}
    for n in nodes:
        levels.setdefault(depth[n], []).append(n)
    pos = {n: (i - (len(ns) - 1) / 2, -d) for d, ns in levels.items() for i, n in enumerate(ns)}
    color = {"sym_attention": "lightblue", "sample": "lightsalmon", "input": "lightgrey"}
    for (a, b), lab in edges.items():
        (x0, y0), (x1, y1) = pos[a], pos[b]
        fb = lab.startswith("feedback")
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(
            arrowstyle="->", color="tab:red" if fb else ("tab:blue" if lab else "grey"),
            connectionstyle="arc3,rad=0.35" if fb else "arc3", lw=1.2, ls="--" if fb else "-"))
        if lab:
            ax.text((x0 + x1) / 2, (y0 + y1) / 2, lab.replace("r, ", ""), fontsize=7,
                    color="tab:red" if fb else "tab:blue", ha="center",
                    bbox=dict(fc="white", ec="none", alpha=0.8, pad=0.5))
    for n in nodes:
        node = pdg.node(n)
        name = node.op if node.op != "sym_attention" else f"attention\n{node.params['pattern']}"
        ax.text(*pos[n], f"%{n} {name}", ha="center", va="center", fontsize=7,
                bbox=dict(boxstyle="round", fc=color.get(node.op, "white"), ec="black"))
    ax.set_xlim(min(x for x, _ in pos.values()) - 1, max(x for x, _ in pos.values()) + 1)
    ax.set_ylim(min(y for _, y in pos.values()) - 0.7, 0.7)
    ax.axis("off")


fig, ax = plt.subplots(figsize=(10, 7))
draw_pdg(pdg, ax)
ax.set_title("generation PDG, condensed (iterators r, t; w = window)")
plt.show()

# %% [markdown]
# ## 3. Symbols, evaluated
# The planner reasons about the index expressions with sympy (once, at build time): the window
# edge reads at most `w` keys and its start only moves forward, so a ring of `w` slots suffices;
# the full edge's length `t+1` is unbounded, so its store grows geometrically. For the decode
# loop the expressions are compiled once into plain Python integer code — shown below — and
# evaluated per step without touching sympy.

# %%
table = pdg.symbols
for store in engine.plan.stores:
    acc = classify_access(table, store.index, "t")
    print(f"%{store.node}: {store.index!s:<22} → {acc.kind:<7} bound {acc.bound}  "
          f"⇒ {store.kind} store, capacity {store.capacity_value(engine.bindings)}")

window_store = next(s for s in engine.plan.stores if s.kind == RING)
fn = compile_index(table, window_store.index, ["t", "w"])
print("\ngenerated code:\n" + fn.source)
ts = np.arange(0, 24 if QUICK else 64)
spans = [evaluate_index(table, fn, {"t": int(t), "w": WINDOW}) for t in ts]
live = live_count_fn(table, window_store, engine.bindings)
print("t = 0..5 →", spans[:6], "live slots:", [live(int(t))[0] for t in ts[:10]])

# %%
fig, ax = plt.subplots(figsize=(8, 3))
ax.fill_between(ts, [a for a, _ in spans], [b for _, b in spans], step="post", alpha=0.3,
                label=f"keys read: {window_store.index}")
ax.plot(ts, ts + 1, "k--", lw=1, label="full attention: 0:t+1")
ax.set_xlabel("query position t")
ax.set_ylabel("key position")
ax.legend()
plt.show()

# %% [markdown]
# ## 4. A decode against the padded baseline
# Same weights, same prompts, greedy; each row has its own limit (a row ends at its limit or at
# EOS). The padded baseline left-pads prompts, preallocates `P + N` slots for every row and
# layer and runs all rows for `N` steps in one compiled `lax.scan`; the symbolic runtime keeps a
# ring of `w` slots for the window layer and a growing buffer for the full layer.

# %%
rng = np.random.default_rng(0)
prompts = [rng.integers(1, cfg.vocab_size, size=n, dtype=np.int32) for n in (3, 9, 5, 12)]
limits = (24, 6, 40, 12) if QUICK else (96, 20, 160, 40)
gen = GenerationConfig(max_new_tokens=limits)
sym = engine.generate(prompts, gen)
pad = padded_generate(model, prompts, gen)
assert all(np.array_equal(a, b) for a, b in zip(sym.tokens, pad.tokens, strict=True))
print("tokens identical:", [len(t) for t in sym.tokens])
print("max |log-prob difference|:",
      max(float(np.max(np.abs(a - b))) for a, b in zip(sym.logprobs, pad.logprobs, strict=True)))
for name, r in (("sym", sym), ("padded", pad)):
    s = r.stats
    print(f"{name:<7} peak bytes {s['peak_bytes']:>10,}  XLA compiles {s['xla_compiles']:>3}  "
          f"dispatches {s['dispatches']:>4}  run s {s['run_seconds']:.3f}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3))
for ax, key, label in ((axes[0], "peak_bytes", "peak bytes"),
                       (axes[1], "xla_compiles", "XLA compiles")):
    vals = [sym.stats[key], pad.stats[key]]
    ax.bar(["sym", "padded"], vals, color=["tab:blue", "tab:red"])
    for i, v in enumerate(vals):
        ax.annotate(f"{v:,}", (i, v), ha="center", va="bottom")
    ax.set_title(label)
plt.tight_layout()
plt.show()
