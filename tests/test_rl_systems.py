"""Trainable systems come from the one systems registry: a new one is a class (its RL half) plus
one ``register`` line naming it, and ``RLTrainer(system=name)`` runs it with no trainer change.

The oracle for a registered copy of the padded baseline is the padded baseline itself: same
samples (same seed), same loss and the same parameters after the step, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_sym import systems
from jaxrl_sym.errors import InputError
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer, get_task
from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.systems import registry
from jaxrl_sym.systems.padded import PaddedSystem
from jaxrl_sym.systems.sym import SymSystem
from jaxrl_sym.systems.trainable import trainable

TASK = get_task("reverse", max_digits=2)
MODEL = preset("tiny", vocab_size=VOCAB_SIZE)
CFG = RLConfig.of(algo="grpo", group_size=2, beta=0.1, epochs=1, eos_id=EOS,
                  max_new_tokens=TASK.max_new_tokens, lr=1e-2)


# --------------------------------------------------------------------------- the toy system
# What docs/extending.md shows: the RL half is a System subclass (here the padded baseline's,
# unchanged) and the spec names it; generation binds as the padded system does.


class PaddedCopy(PaddedSystem):
    """A test-local trainable system: the padded baseline's RL half under another name."""


COPY = systems.SystemSpec("padded-copy", "the padded baseline under another name (a test's)",
                          systems.Capabilities(trains=True), "jaxrl_sym.systems.padded",
                          trainer=f"{__name__}:PaddedCopy")


@pytest.fixture
def padded_copy(monkeypatch) -> systems.SystemSpec:
    """The toy system registered for one test (the registry is restored after it)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    return systems.register(COPY)


def test_a_registered_system_runs_a_step_without_touching_the_trainer(padded_copy) -> None:
    prompts = TASK.sample(np.random.default_rng(0), 2)
    base = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded")
    m_base = base.step(prompts, seed=7)
    assert "padded-copy" in systems.names(trains=True)
    copy = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded-copy")
    m_copy = copy.step(prompts, seed=7)
    lay = copy.layout(copy.generate(prompts, seed=7))
    assert lay.system == PaddedCopy(padded_copy) and lay.system.name == "padded-copy"
    assert lay.system != base.system  # its own key: its own programs
    for key in ("loss", "kl", "entropy", "grad_norm", "reward", "layout_shape"):
        assert m_copy[key] == m_base[key], key
    assert copy.params_sha256() == base.params_sha256() and copy.steps_done == 1
    assert list(m_copy["seconds"]) == list(m_base["seconds"])
    # it ran through its own programs (named after it), not the padded system's
    names = {key[0] for key in copy.programs.cache.compiled}
    assert "update-padded-copy" in names and not any(n.endswith("-padded") for n in names)
    # its spec says it does not speculate: the trainer refuses speculation for it by name
    with pytest.raises(InputError, match=r"--speculate 2\): system 'padded-copy'.*sym, padded"):
        RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded-copy",
                  speculation=Speculation(2))


def test_trainable_systems_come_from_the_registry() -> None:
    sym, padded = trainable("sym"), trainable("padded")
    assert isinstance(sym, SymSystem) and sym.spec is systems.get("sym")
    assert isinstance(padded, PaddedSystem) and padded.spec is systems.get("padded")
    assert sym == trainable("sym") and hash(sym) == hash(trainable("sym")) and sym != padded
    with pytest.raises(InputError, match=r"unknown system 'nope'; choose one of sym, padded"):
        RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="nope")
    with pytest.raises(InputError, match=r"'pershape'; choose one of sym, padded \(the systems"):
        RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="pershape")
    with pytest.raises(InputError, match="does not train"):
        systems.get("pershape").trainable()


def test_the_engine_options_reach_the_runtime() -> None:
    """One default per knob: without ``engine`` the trainer's runtime has ``EngineOptions()``,
    the same as a ``SymbolicLM``'s; given, the trainer's own."""
    assert RLTrainer(init_model(MODEL, 0), TASK.reward, CFG).engine.options == EngineOptions()
    opts = EngineOptions(min_capacity=8, max_pad_fraction=0.5)
    tr = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, engine=opts)
    assert tr.engine.options == opts
    with pytest.raises(InputError, match=r"engine=.*EngineOptions"):
        RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, engine={"min_capacity": 8})
    padded = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG, system="padded")
    with pytest.raises(InputError, match="no engine"):
        _ = padded.engine
