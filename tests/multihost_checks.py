"""Checks run by several cooperating processes, as on several hosts
(``python tests/multihost_checks.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR``).

Each process starts JAX's distributed runtime (``jax.distributed.initialize`` against a
coordinator on ``localhost:PORT``, CPU collectives over gloo) and sees the same global device
list: its own ``--xla_force_host_platform_device_count`` virtual devices plus every other
process's. That is the multi-host setting in miniature — arrays split over the mesh have shards
this process cannot read, and every program runs SPMD across processes — on one machine.

Oracle: process 0 also runs the single-device computation on its own first device (no mesh,
nothing shared), so "equal" means equal to what one device computes, as in
``tests/sharding_checks.py``, and asserts. Every process writes ``p<ID>.json`` into OUT_DIR with
a digest of each result as it sees it (tokens, log-probs, loss and gradients gathered to the
host); the parent test checks the other processes' digests equal process 0's, so each process's
view is checked against the oracle without computing it again. Process 0 writes ``result.json``,
and a checkpoint written there by the mesh is restored by the parent test on one device.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import jax

PROCESS, PROCESSES, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{PORT}", num_processes=PROCESSES, process_id=PROCESS)

import numpy as np  # noqa: E402  (after initialize: nothing may touch a backend before it)
from flax import nnx  # noqa: E402
from sharding_checks import CFG, MODEL, TASK, ragged_request  # noqa: E402
from zoo import GemmaishConfig, GemmaishLM  # noqa: E402

from jaxrl_sym.generation import GenerationConfig  # noqa: E402
from jaxrl_sym.models.lm import init_model  # noqa: E402
from jaxrl_sym.rl import RLTrainer, compute_rewards  # noqa: E402
from jaxrl_sym.rl.run.checkpoint import Checkpointer, fingerprint  # noqa: E402
from jaxrl_sym.rl.step.state import params_sha256  # noqa: E402
from jaxrl_sym.runtime.engine import SymbolicLM  # noqa: E402
from jaxrl_sym.runtime.options import EngineOptions  # noqa: E402
from jaxrl_sym.sharding import MeshConfig, to_host  # noqa: E402

MESHES = ("data={n}", "data={h},model=2")  # every device of every process


def meshes() -> list[str]:
    n = jax.device_count()
    return [m.format(n=n, h=n // 2) for m in MESHES]


def digest(*arrays: Any) -> str:
    """sha256 of host arrays' bytes: the same result seen by two processes has the same digest."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    return h.hexdigest()


def generation() -> dict[str, Any]:
    """Sharded generation across processes gives the single-device tokens and log-probs:
    7 prompts of ragged limits (an uneven row count, rounded up to the data axis), sampled on
    the data x model mesh, stores split over devices that belong to different processes
    (greedy and the other meshes: ``tests/sharding_checks.py``, 8 devices of one process). On
    the Gemma-like zoo model (soft-capped logits, its own layer layout), not the DecoderLM."""
    model = GemmaishLM(GemmaishConfig(), rngs=nnx.Rngs(4 + 3))  # zoo(4)["gemmaish"], alone
    vocab = SymbolicLM(model).vocab_size
    prompts, limits = ragged_request(vocab, seed=13)
    out: dict[str, Any] = {}
    for spec, temp in ((meshes()[-1], 1.0),):  # (the data mesh: rl_step's sym layout)
        gen = GenerationConfig(max_new_tokens=limits, temperature=temp, seed=5, eos_id=None)
        options = EngineOptions(max_pad_fraction=1.0, compact_min_rows=1)
        lm = SymbolicLM(model, options, mesh=MeshConfig.parse(spec).build())
        got = lm.generate(prompts, gen)
        if PROCESS == 0:
            want = SymbolicLM(model, options).generate(prompts, gen)
            assert all(np.array_equal(a, b) for a, b in zip(want.tokens, got.tokens,
                                                            strict=True))
            for a, b in zip(want.logprobs, got.logprobs, strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5)
        spans = sum(not x.is_fully_addressable for x in jax.tree_util.tree_leaves(lm.leaves))
        assert spans > 0, f"{spec}: no weight spans both processes"
        out[f"{spec},T={temp}"] = {"tokens": int(sum(len(t) for t in got.tokens)),
                                   "weights_across_processes": spans,
                                   "digest": digest(*got.tokens, *got.logprobs)}
    return out


def rl_step() -> dict[str, Any]:
    """Loss and gradients of a trainer on the cross-process mesh equal one device's on the same
    samples: the sym layout on the data mesh, the padded one on the data x model mesh (every
    layout on every mesh is ``tests/sharding_checks.py``'s, on 8 devices of one process); then
    a full step, and a checkpoint of the sharded state."""
    single = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG)
    rollout = single.generate(TASK.sample(np.random.default_rng(0), 5), seed=3)  # 20 samples
    rewards = compute_rewards(TASK.reward, rollout.prompts, rollout.responses)
    single.params = jax.tree_util.tree_map(lambda x: x * 1.05, single.params)  # KL non-zero
    out: dict[str, Any] = {}
    tr = None
    for spec, system in zip(meshes(), ("sym", "padded"), strict=True):
        tr = RLTrainer(init_model(MODEL, 0), TASK.reward, CFG,
                       mesh=MeshConfig.parse(spec).build())
        tr.params = jax.device_put(single.params, tr.shardings["params"])
        loss2, aux2, g2 = tr.loss_and_grads(rollout, rewards, system)
        grads = [to_host(g) for g in jax.tree_util.tree_leaves(g2)]
        res = out[f"{spec},{system}"] = {"loss": loss2, "kl": aux2["kl"],
                                         "digest": digest(np.float64(loss2), *grads)}
        if PROCESS == 0:
            loss1, _, g1 = single.loss_and_grads(rollout, rewards, system)
            diff = max(float(np.abs(to_host(a) - b).max()) for a, b in zip(
                jax.tree_util.tree_leaves(g1), grads, strict=True))
            assert abs(loss1 - loss2) <= 1e-5 and diff <= 1e-5, (spec, system, loss1, diff)
            res.update(loss_single=loss1, max_grad_diff=diff)
    assert tr is not None
    metrics = tr.step(TASK.sample(np.random.default_rng(1), 2), seed=4)  # Adam moments non-zero
    assert np.isfinite(metrics["loss"])
    Checkpointer(OUT / "ckpt").save(1, tr, {"fingerprint": fingerprint(tr)})
    out["saved"] = {"mesh": meshes()[-1], "params_sha256": params_sha256(tr.params),
                    "opt_sha256": params_sha256(tr.opt_state)}
    back = RLTrainer(init_model(MODEL, 1), TASK.reward, CFG, mesh=MeshConfig.parse(
        meshes()[0]).build())  # restored onto the other cross-process mesh
    Checkpointer(OUT / "ckpt", create=False).restore(back, fingerprint(back))
    assert params_sha256(back.params) == out["saved"]["params_sha256"]
    assert back.steps_done == 1
    return out


if __name__ == "__main__":
    result = {"processes": jax.process_count(), "devices": jax.device_count(),
              "local_devices": jax.local_device_count(),
              "generation": generation(), "rl_step": rl_step()}
    (OUT / f"p{PROCESS}.json").write_text(json.dumps(result))
    if PROCESS == 0:
        (OUT / "result.json").write_text(json.dumps(result))
    jax.distributed.shutdown()
