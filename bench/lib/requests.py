"""Requests built from :mod:`jaxrl_sym.workloads` lengths: a model, token prompts and the
generation config, the same for every system an experiment compares.

Why here and not in the workloads: the lengths are the workload (one home, JAX-free); which model
and which random tokens fill them is how a benchmark uses it, and several experiments must agree
on it to be comparable (the suite's child, ``tunix_paired``, ``waste``, ``speculative``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxrl_sym.workloads import realistic


def prompt_tokens(seed: int, lengths: list[int], vocab: int) -> list[np.ndarray]:
    """Random prompts as the suite's child draws them (``seed + 1``, tokens below ``vocab``)."""
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(0, vocab, size=int(p), dtype=np.int32) for p in lengths]


def realistic_request(grid: dict[str, Any], seed: int = 0) -> tuple[Any, list[np.ndarray], Any]:
    """The realistic request of a suite preset with full attention: model, prompts (tokens
    1..99 drawn after the lengths, from the same generator) and per-row limits."""
    from jaxrl_sym.decode_run import build_model
    from jaxrl_sym.generation import GenerationConfig
    from jaxrl_sym.models.contract import check_model

    rng = np.random.default_rng(seed)
    step = realistic(**grid["realistic"], rng=rng)
    spec = {"preset": grid["preset"], "attention": "full", "window": grid["window"],
            "block": grid["block"], "seed": seed, "batch": 1, "prompt_len": [1, 1]}
    model, _ = build_model(spec)
    top = min(100, check_model(model).vocab_size)  # 1..99 unless the vocabulary is smaller
    prompts = [rng.integers(1, top, n).astype(np.int32) for n in step.prompt_lens]
    return model, prompts, GenerationConfig(max_new_tokens=step.response_lens)
