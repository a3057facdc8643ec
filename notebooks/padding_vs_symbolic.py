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
# # Padding vs symbolic: the benchmark at small sizes
#
# The same suite as `python -m bench suite` (whose `--preset full` run is committed under
# `bench/results/cpu/`), shrunk so it runs in a notebook: a few attention kinds, a few lengths N,
# the symbolic runtime against the padded/masked XLA baseline (and the per-shape JAX baseline at
# one tiny N). Here each configuration runs **in this process** to save start-up time, so peak
# RSS is the notebook's, not the system's; the suite itself runs one process per configuration.
#
# What to look for: padded attends over `P + N` slots for every pattern, so its memory and its
# wasted key slots grow with N even for a window or linear attention; sym's stores follow the
# pattern (ring of `w` slots, recurrent state) and only full attention grows. Sym compiles a
# handful of programs (one per capacity bucket), per-shape one per length.

# %%
import os
import sys
import tempfile
from pathlib import Path

from IPython.display import Image, Markdown, display

ROOT = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
sys.path.insert(0, str(ROOT))  # the kernel runs in notebooks/; bench is a package of the root
from bench.experiments.suite import grid  # noqa: E402
from bench.lib import plots  # noqa: E402
from bench.lib.suite import suite_jobs as suite  # noqa: E402
from bench.lib.suite import suite_report  # noqa: E402

QUICK = os.environ.get("JAXRL_SYM_NB_QUICK") == "1"
preset = {
    **grid("full"),
    "preset": "tiny" if QUICK else "decode-cpu",
    "batch": 4, "prompt_len": (4, 12), "window": 16, "block": 16,
    "kinds": ("full", "window") if QUICK else grid("full")["kinds"],
    "tokens": (16, 64) if QUICK else (64, 128, 256, 512),
    "pershape_tokens": (8,) if QUICK else (32,), "pershape_kinds": ("full",),
    "realistic": {"batch": 4 if QUICK else 16, "prompt": (4, 32), "median": 16 if QUICK else 69,
                  "cap": 48 if QUICK else 256, "sigma": 0.6},
}
jobs = suite.plan(preset, systems=("sym-xla", "padded", "pershape"),
                  scenarios=("decode", "realistic"))
print(f"{len(jobs)} configurations × systems")

# %%
out = Path(tempfile.mkdtemp(prefix="nb_suite_")) / "suite"
meta = suite.device_meta("notebooks/padding_vs_symbolic.py", in_process=True)
rows = suite.run_jobs(jobs, out, meta, progress=False, in_process=True, echo=None)
rows = list(rows.values())
print({r["status"] for r in rows}, "on", meta["device"])

# %% [markdown]
# ## sym vs padded, per attention kind and N

# %%
display(Markdown(suite_report.decode_ratios(rows)))

# %%
paths = plots.plot_all(rows, out)
for p in paths:
    display(Image(filename=str(p)))

# %% [markdown]
# ## Realistic lengths
# Responses log-normal (median 16 tokens at the notebook's quick size, 69 otherwise); each row
# ends at its own length as if EOS had been sampled there. The padded baseline keeps every row
# decoding until the longest one is done, and attends over the longest prompt plus the longest
# response for all of them.

# %%
display(Markdown(suite_report.lengths_table(rows, "realistic")))

# %%
checks = [r["check_vs_padded"]["tokens_equal"] for r in rows if "check_vs_padded" in r]
assert checks and all(checks), "sym or per-shape produced tokens different from padded"
print(f"{len(checks)} runs checked: tokens identical to the padded baseline")
