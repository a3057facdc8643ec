"""Multi-device checks run in a child process (``python tests/sharding_checks.py CHECK``).

Why a child: ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX
initialises its CPU backend, and the test process has initialised it with one device long
before. :mod:`tests.test_sharding` starts this script once with the flag set, for every check
(one JAX start-up, and later checks reuse what earlier ones built: the checkpoint check saves the
trainer ``rl_step`` stepped), and reads the JSON line it prints last. Every check asserts here; a
failing one reports its traceback under its name and the others still run, so each test reads
its own check's outcome.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig
from jaxrl_sym.models.lm import init_model, preset
from jaxrl_sym.rl import RLConfig, RLTrainer, compute_rewards, get_task
from jaxrl_sym.rl.tasks.token_tasks import EOS, VOCAB_SIZE
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.options import EngineOptions
from jaxrl_sym.sharding import MeshConfig, per_device_bytes

TASK = get_task("reverse", max_digits=3)
MODEL = preset("tiny", vocab_size=VOCAB_SIZE)
CFG = RLConfig.of(algo="grpo", group_size=4, beta=0.1, epochs=1, eos_id=EOS,
                  max_new_tokens=TASK.max_new_tokens, lr=1e-2)


def mesh_of(spec: str) -> Any:
    """A mesh over the first devices its sizes need (the child has 8)."""
    cfg = MeshConfig.parse(spec)
    return cfg.build(jax.devices()[:cfg.size])


def ragged_request(vocab: int = 64, seed: int = 0) -> tuple[list[np.ndarray], tuple[int, ...]]:
    """7 prompts of 2-8 tokens and limits of 3-24: a row count no mesh axis divides."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, size=int(n)).astype(np.int32)
               for n in rng.integers(2, 9, size=7)]
    return prompts, tuple(int(x) for x in rng.integers(3, 25, size=7))


def generation(ctx: dict[str, Any]) -> dict[str, Any]:
    """Tokens of a sharded SymbolicLM equal the single-device run: 8 devices sampled and a
    data x model mesh greedy (a plain 2-device data mesh adds no code path the two lack).
    7 prompts of different limits: one device runs a bucket of 7 rows, a mesh rounds it up to
    a multiple of its data axis (filler rows) and keeps every bucket a multiple as compaction
    shrinks it, so every step program's stores split evenly."""
    model = init_model(preset("tiny"), 0)
    prompts, limits = ragged_request()
    out: dict[str, Any] = {}
    # one group; compact_min_rows=1: compaction to small buckets is exercised on the mesh. The
    # single-device reference is one engine, its run per temperature computed once.
    single = SymbolicLM(model, EngineOptions(max_pad_fraction=1.0, compact_min_rows=1))
    wants: dict[float, Any] = {}
    for spec, temp in (("data=8", 1.0), ("data=4,model=2", 0.0)):
        gen = GenerationConfig(max_new_tokens=limits, temperature=temp, seed=5, eos_id=None)
        if temp not in wants:
            wants[temp] = single.generate(prompts, gen)
        want = wants[temp]
        lm = SymbolicLM(model, EngineOptions(max_pad_fraction=1.0, compact_min_rows=1),
                        mesh=mesh_of(spec))
        got = lm.generate(prompts, gen)
        assert all(np.array_equal(a, b) for a, b in zip(want.tokens, got.tokens, strict=True))
        for a, b in zip(want.logprobs, got.logprobs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
        split = _split_programs(lm)
        assert split > 0, f"{spec}: no step program kept its stores split over data"
        rows = sorted({k[1][0] for k in lm.cache.compiled if k[0] in ("decode", "decode_tile")})
        assert rows and all(r % lm.row_multiple == 0 for r in rows), (spec, rows)
        out[f"{spec},T={temp}"] = {"programs_with_split_stores": split, "decode_rows": rows,
                                   "programs": len(lm.cache.compiled),
                                   "weights_sharded": _sharded_leaves(lm.leaves),
                                   "tokens": int(sum(len(t) for t in got.tokens))}
    return out


def _split_programs(lm: SymbolicLM) -> int:
    """Compiled decode/prefill programs whose store outputs are split over the data axis."""
    n = 0
    for key, exe in lm.cache.compiled.items():
        if key[0] in ("prefill", "decode", "decode_tile"):
            specs = [s.spec for s in jax.tree_util.tree_leaves(exe.output_shardings[0])]
            n += all(len(sp) and sp[0] in ("data", ("data",)) for sp in specs)
    return n


def _sharded_leaves(leaves: list[Any]) -> int:
    return sum(any(a is not None for a in x.sharding.spec) for x in leaves)


def _trainer(mesh: Any, cfg: RLConfig = CFG) -> RLTrainer:
    return RLTrainer(init_model(MODEL, 0), TASK.reward, cfg, mesh=mesh)


def rl_step(ctx: dict[str, Any]) -> dict[str, Any]:
    """Loss, training signals and gradients of a sharded trainer equal the single-device
    trainer's on the same samples: the padded layout on the data mesh (its rows rounded up to
    the axis with empty rows), the sym layout on the data x model mesh (each layout's programs
    are the same on either mesh; the mesh changes only their shardings); then one full sharded
    step (the stepped data x model trainer goes to ``ctx['stepped']`` for :func:`checkpoint`)."""
    single = _trainer(None)
    rollout = single.generate(TASK.sample(np.random.default_rng(0), 5), seed=3)  # 20 samples
    rewards = compute_rewards(TASK.reward, rollout.prompts, rollout.responses)
    moved = jax.tree_util.tree_map(lambda x: x * 1.05, single.params)  # KL term non-zero
    single.params = moved
    out: dict[str, Any] = {}
    for spec, system in (("data=8", "padded"), ("data=4,model=2", "sym")):
        tr = _trainer(mesh_of(spec))
        tr.params = jax.device_put(moved, tr.shardings["params"])
        loss1, aux1, g1 = single.loss_and_grads(rollout, rewards, system)
        loss8, aux8, g8 = tr.loss_and_grads(rollout, rewards, system)
        assert abs(loss1 - loss8) <= 1e-5, (spec, system, loss1, loss8)
        assert max(abs(aux1[k] - aux8[k]) for k in aux1) <= 1e-5
        diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                   for a, b in zip(jax.tree_util.tree_leaves(g1),
                                   jax.tree_util.tree_leaves(g8), strict=True))
        assert diff <= 1e-5, (spec, system, diff)
        rows = (single.layout(rollout, system).shape[0], tr.layout(rollout, system).shape[0])
        out[f"{spec},{system}"] = {"loss": loss8, "loss_single": loss1,
                                   "max_grad_diff": diff, "rows_single_vs_mesh": rows,
                                   "kl": aux8["kl"]}
    metrics = tr.step(TASK.sample(np.random.default_rng(1), 2), seed=4)
    assert np.isfinite(metrics["loss"])
    leaves = jax.tree_util.tree_leaves(tr.params)
    assert _sharded_leaves(leaves) > 0
    assert all(x.sharding == s for x, s in zip(
        leaves, jax.tree_util.tree_leaves(tr.shardings["params"]), strict=True))
    out["step_loss"] = metrics["loss"]
    ctx["stepped"] = tr
    return out


def memory(ctx: dict[str, Any]) -> dict[str, Any]:
    """A model whose parameters + optimiser state + reference exceed one device's budget trains on
    8 devices under that budget. XLA's CPU client has no per-device limit, so the limit is the
    trainer's own :class:`MemoryBudget`, checked against the shards actually placed and every
    compiled program's per-device ``memory_analysis`` (the SPMD-partitioned executable)."""
    cfg = preset("small", vocab_size=VOCAB_SIZE, d_model=256, ffn_dim=1024)
    model = init_model(cfg, 0)
    # micro-batches of one 8-row mesh split of 64-slot rows (the batch's own rows; sym's default
    # 4096-slot micro-batch would put the update program over the budget this check sets)
    rl = CFG.replace(update_tokens=8 * 64)
    probe = RLTrainer(model, TASK.reward, rl)  # one device, no budget: the state's size
    total = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(
        (probe.params, probe.opt_state, probe.state.ref)))
    limit = total // 2
    try:
        RLTrainer(model, TASK.reward, rl, device_memory=limit)
        raise AssertionError("one device accepted a state over its budget")
    except InputError as err:
        refused = str(err)
    tr = RLTrainer(model, TASK.reward, rl, mesh=mesh_of("data=8"), device_memory=limit)
    tree = (tr.params, tr.opt_state, tr.state.ref)
    small = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree)
                if all(a is None for a in x.sharding.spec))
    per = per_device_bytes(tree)
    assert len(per) == 8
    assert max(per.values()) <= total / 8 + small, (max(per.values()), total, small)
    assert max(per.values()) <= total / 8 * 1.05
    metrics = tr.step(TASK.sample(np.random.default_rng(1), 2), seed=4)
    assert np.isfinite(metrics["loss"])
    programs = {**tr.programs.cache.device_bytes, **tr.engine.cache.device_bytes}
    assert any(k[0].startswith("update") for k in programs)  # every program was checked
    assert 0 < max(programs.values()) <= limit
    return {"total_bytes": total, "replicated_bytes": small, "max_per_device": max(per.values()),
            "fraction": max(per.values()) / total, "limit": limit, "refused": refused,
            "largest_program": max(programs.values())}


def checkpoint(ctx: dict[str, Any]) -> dict[str, Any]:
    """State saved by a trainer on 8 devices (a data x model mesh, after one step: Adam moments
    non-zero; :func:`rl_step`'s trainer when it ran first) restores onto a 2-device mesh and onto
    one device with equal parameters, optimiser state and reference, each placed by the
    restoring trainer's own shardings. That a restored run trains on is the CLI tests' part
    (``test_cli_trains_on_a_mesh_and_resumes_on_another`` resumes on data=2,
    ``test_cli_trains_on_two_processes_and_resumes_on_one`` on one device)."""
    import tempfile

    from jaxrl_sym.rl.run.checkpoint import Checkpointer, fingerprint
    from jaxrl_sym.rl.step.state import params_sha256

    src = ctx.get("stepped")
    if src is None:
        src = _trainer(mesh_of("data=4,model=2"))
        src.step(TASK.sample(np.random.default_rng(1), 2), seed=4)
    want = {k: params_sha256(v) for k, v in
            (("params", src.params), ("opt", src.opt_state), ("ref", src.ref_leaves))}
    out: dict[str, Any] = {"saved_on": "data=4,model=2", "steps": src.steps_done}
    with tempfile.TemporaryDirectory() as d:
        Checkpointer(d).save(src.steps_done, src, {"fingerprint": fingerprint(src)})
        for spec in ("data=2", None):
            # another seed: the restore must replace the reference too
            dst = RLTrainer(init_model(MODEL, 1), TASK.reward, CFG,
                            mesh=None if spec is None else mesh_of(spec))
            before = {k: params_sha256(v) for k, v in
                      (("params", dst.params), ("ref", dst.ref_leaves))}
            assert before["params"] != want["params"] and before["ref"] != want["ref"]
            Checkpointer(d, create=False).restore(dst, fingerprint(dst))
            got = {k: params_sha256(v) for k, v in
                   (("params", dst.params), ("opt", dst.opt_state), ("ref", dst.ref_leaves))}
            assert got == want, (spec, got, want)
            assert dst.steps_done == src.steps_done >= 1
            if spec is not None:
                for x, sh in zip(jax.tree_util.tree_leaves(dst.params),
                                 jax.tree_util.tree_leaves(dst.shardings["params"]),
                                 strict=True):
                    assert x.sharding == sh and len(x.sharding.device_set) == 2
            else:
                assert all(len(x.sharding.device_set) == 1
                           for x in jax.tree_util.tree_leaves(dst.params))
            out[f"restored_on_{spec or 'one device'}"] = got["params"][:16]
    return out


CHECKS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "generation": generation, "rl_step": rl_step, "checkpoint": checkpoint, "memory": memory}


def run(names: list[str]) -> dict[str, Any]:
    """Each named check in order, sharing one context; a failure is recorded under its name
    (``{"error": traceback}``) and the rest still run."""
    ctx: dict[str, Any] = {}
    result: dict[str, Any] = {}
    for name in names:
        try:
            result[name] = CHECKS[name](ctx)
        except Exception:  # reported to the test that owns the check
            result[name] = {"error": traceback.format_exc()}
    return result


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1:])))
