"""The padded baseline's generation ledger: its one program per call, compiled — never run — at
the request's shapes (``python -m bench project --workload decode``).

Why here and not beside sym's (:mod:`jaxrl_sym.runtime.memory.ledger_generation`): the baselines sit
below the runtime, and the program is :func:`~jaxrl_sym.baselines.padded.padded_program`, the one
``padded_generate`` runs. Its moment holds the weights, the left-padded inputs, the program's
outputs (the MAX_LEN caches are outputs: the program allocates them) and XLA's temporaries.
``cost_analysis`` counts the decode loop's body once, so the program is compiled a second time
without the loop (one new token, the same MAX_LEN): the difference is one decode step's cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_sym.baselines.padded import left_pad_prompts, padded_program
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.runtime.memory.ledger import Buffer, Ledger, ProgramSize, moment, tree_nbytes
from jaxrl_sym.runtime.memory.ledger_generation import WEIGHTS, GenerationLedger, ProgramRun
from jaxrl_sym.runtime.programs import Build

__all__ = ["padded_ledger"]


def padded_ledger(model: Any, prompts: Sequence[np.ndarray], cfg: GenerationConfig, *,
                  compiler: Callable[[Build], Any] | None = None) -> GenerationLedger:
    """The padded baseline's ledger for ``prompts`` with ``cfg``: its one program, compiled at
    the request's shapes, and once more without its decode loop for the per-step cost.
    ``compiler(build) -> Compiled``: how each compiles (None: for this machine; the bench
    compiles for a GPU it does not have)."""
    compile_ = compiler or (lambda build: build())
    _, state = nnx.split(model)
    state = jax.eval_shape(lambda: state)
    batch = left_pad_prompts(model, prompts, cfg)
    max_len = max(cfg.max_len or 0, batch.prompt_len + batch.steps)
    inputs = (batch.tokens, batch.positions, batch.prompt_lens, batch.limits)
    name = f"padded[{batch.batch}x{max_len}]"
    full = ProgramSize.of(name, compile_(Build(padded_program(model, batch, cfg),
                                               (state, *inputs))))
    one_cfg = dataclasses.replace(cfg, max_new_tokens=1, max_len=max_len)
    one = left_pad_prompts(model, prompts, one_cfg)
    head = ProgramSize.of(f"{name} prefill", compile_(Build(
        padded_program(model, one, one_cfg),
        (state, one.tokens, one.positions, one.prompt_lens, one.limits))))
    step = dataclasses.replace(full, name=f"{name} decode step",
                               flops=max(0.0, full.flops - head.flops),
                               bytes_accessed=max(0.0, full.bytes_accessed - head.bytes_accessed))
    held = [Buffer(WEIGHTS, "weights", tree_nbytes(state)),
            Buffer("left-padded prompt arrays", "batch", tree_nbytes(inputs))]
    m = moment("generate", name, held, full.buffers())
    runs = (ProgramRun("prefill", head.name, head, 1, 1),
            ProgramRun("decode", step.name, step, 0, batch.steps - 1))
    return GenerationLedger(Ledger("padded", (m,)), runs, 2, 1)
