"""The system registry: a new system is one class + ``register_system``, with no trainer change.

The oracle for a registered copy of the padded baseline is the padded baseline itself: same
samples (same seed), same loss and the same parameters after the step, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
from jaxrl_sym.rl.systems import REGISTRY, PaddedSystem, SymSystem, get_system, register_system
from jaxrl_sym.rl.tasks import EOS, VOCAB_SIZE

TASK = get_task("reverse", max_digits=2)
MODEL = preset("tiny", vocab_size=VOCAB_SIZE)
CFG = RLConfig(algo="grpo", group_size=2, beta=0.1, epochs=1, eos_id=EOS,
               max_new_tokens=TASK.max_new_tokens, lr=1e-2)


class PaddedCopy(PaddedSystem):
    """A test-local system: the padded baseline under another name."""

    name = "padded-copy"


def test_a_registered_system_runs_a_step_without_touching_the_trainer() -> None:
    prompts = TASK.sample(np.random.default_rng(0), 2)
    base = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded")
    m_base = base.step(prompts, seed=7)
    register_system(PaddedCopy())
    try:
        copy = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded-copy")
        m_copy = copy.step(prompts, seed=7)
        rollout = copy.generate(prompts, seed=7)
        assert copy.layout(rollout).system == "padded-copy"
    finally:
        REGISTRY.pop("padded-copy")
    for key in ("loss", "kl", "entropy", "grad_norm", "reward", "layout_shape"):
        assert m_copy[key] == m_base[key], key
    assert copy.params_sha256() == base.params_sha256() and copy.steps_done == 1
    assert list(m_copy["seconds"]) == list(m_base["seconds"])
    # it ran through its own programs (named after it), not the padded system's
    names = {key[0] for key in copy.programs.cache.compiled}
    assert "update-padded-copy" in names and not any(n.endswith("-padded") for n in names)


def test_registry_lookup() -> None:
    assert isinstance(get_system("sym"), SymSystem)
    assert isinstance(get_system("padded"), PaddedSystem)
    with pytest.raises(InputError, match=r"unknown system 'nope'; choose one of sym, padded"):
        RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="nope")
