"""Every experiment, by name: the one table ``python -m bench`` reads.

Why a table of module names, not imports: listing the experiments (``python -m bench``) and
checking a name must not load JAX or any experiment; an experiment's module is imported only
when it runs. Each module offers ``PRESETS`` (:mod:`bench.presets`) and ``main(argv) -> int``.
Adding an experiment = one module in ``bench/experiments/`` + one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from jaxrl_sym.errors import InputError


@dataclass(frozen=True)
class Experiment:
    """``name`` runs ``bench.experiments.<name>``; ``cheap``: its quick preset takes a minute or
    two on 2 CPU cores and needs no optional package (the tests run those)."""

    name: str
    summary: str
    cheap: bool = True

    @property
    def module_name(self) -> str:
        return f"bench.experiments.{self.name}"

    def load(self) -> ModuleType:
        return importlib.import_module(self.module_name)

    def main(self, argv: Sequence[str]) -> int:
        return int(self.load().main(list(argv)) or 0)


EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment("headline", "sym vs Tunix vs padded on the realistic GRPO workload: generation "
                           "alone and the whole step"),
    Experiment("suite", "padding vs symbolic: decode, realistic, growing, RL step and trace "
                        "scenarios, one process per system (resumable JSONL + tables + plots)"),
    Experiment("rlft_step", "one GRPO step, sym vs padded, stage by stage"),
    Experiment("waste", "where sym's token positions go on realistic lengths, per cause"),
    Experiment("refill", "refill vs compaction vs padded groups through R resident rows: "
                         "the policy's replay with an H100 projection, and measured on CPU"),
    Experiment("speculative", "speculative decoding vs plain, sym and padded"),
    Experiment("row_cost", "decode step cost vs live rows"),
    Experiment("sharding", "RL step and generation vs device count (virtual CPU devices)"),
    Experiment("logprob_memory", "RL update peak bytes at a 151,936-word vocabulary, chunked "
                                 "vs unchunked log-probs"),
    Experiment("project", "an RL step's peak memory (a ledger of named buffers) and time, "
                          "projected to a GPU from XLA's memory/cost analysis; nothing runs"),
    Experiment("reasoning", "one GRPO step at reasoning lengths (caps 4k-32k, skewed): each "
                            "system's peak, largest batch and step seconds on a GPU, projected "
                            "from compiled programs", cheap=False),
    Experiment("growing_rl", "a GRPO run whose responses grow 10x (reasoning_growing): sym "
                             "without a MAX_LEN beside padded at the cap, cold programs and "
                             "generation bytes per step", cheap=False),
    Experiment("gpu_compile", "the padded generation program compiled for an H100 on a machine "
                              "without one: XLA:GPU's buffer assignment beside the CPU's",
               cheap=False),
    Experiment("dispatch", "generation's kernels, CUDA-graph capture and host round-trips per "
                           "decode step, from the programs compiled for a GPU on this machine; "
                           "seconds projected from bytes, launches and syncs", cheap=False),
    Experiment("pretrained_memory", "peak RSS of one GRPO step of a SmolLM2-135M-shaped "
                                    "checkpoint on CPU, beside its ledger", cheap=False),
    Experiment("pretrained_learning", "a pretrained checkpoint fine-tuned with GRPO (LoRA / "
                                      "full, bf16-mixed / fp32): held-out greedy exact match "
                                      "and format before vs after", cheap=False),
    Experiment("learning", "multi-seed learning: final greedy exact match per algorithm and "
                           "task", cheap=False),
    Experiment("tunix_paired", "sym, padded and Tunix interleaved on one request (steady "
                               "state)", cheap=False),
    Experiment("tunix_window", "window/mixed decode vs Tunix's ring-cached Gemma 4",
               cheap=False),
    Experiment("tunix_grpo", "Tunix's GRPO learner on the RL-step workload (needs its trainer "
                             "stack)", cheap=False),
    Experiment("gpu_plan", "every GPU measurement in priority order within a time budget, one "
                           "result line per item as it ends (--dry-run: tiny shapes, any backend)",
               cheap=False),
    Experiment("decode_kernel", "Triton decode-attention bandwidth vs device copy bandwidth "
                                "(GPU)"),
)


def names() -> tuple[str, ...]:
    return tuple(e.name for e in EXPERIMENTS)


def get(name: str) -> Experiment:
    """The experiment called ``name``; an unknown name lists the choices."""
    for e in EXPERIMENTS:
        if e.name == name:
            return e
    raise InputError(f"experiment {name!r}: unknown; choose one of {', '.join(names())}")
