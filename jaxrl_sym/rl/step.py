"""One RL fine-tuning step in one call: generate → reference → reward → advantages → update.

"One call", not one XLA program: the step is a host function that runs the runtime's generation
programs (prefill / decode / compaction per shape bucket), one reference forward, the user's Python
reward, and one jitted loss-gradient-optimiser program per epoch. Each compiled program is cached
by shape, so a steady-state step compiles nothing.

:class:`RLTrainer` owns the policy parameters, the optimiser state and (when ``beta > 0``) the
frozen reference parameters, and runs the step on one of two systems that share everything except
the layout and the forward:

* ``sym``: :class:`~jaxrl_sym.runtime.engine.SymbolicLM` generates on exact-size stores; the
  reference, value and training forwards run on exact-length sequences bin-packed into rows
  (``SymbolicLM.forward_fn``, differentiated with ``jax.grad``); new weights go back with
  ``engine.set_params`` (no re-trace).
* ``padded``: :func:`~jaxrl_sym.baselines.padded.padded_generate` and ``padded_forward`` over rows
  padded to max prompt + max response, masked.

Choices that matter:

* The "old" log-probs are the ones generation reported for the sampled tokens (at the sampling
  temperature). They are never recomputed: TRL and verl spend a whole forward pass on that.
* On ``sym`` the reference log-probs of a row are computed as soon as the row finishes: finished
  rows are packed into chunks whose reference forward is dispatched (asynchronously) while the
  remaining rows still decode (:mod:`jaxrl_sym.rl.overlap`). The padded baseline, like TRL,
  runs one reference pass over the padded batch after generation.
* Nothing is committed until the update succeeded: a reward function that raises or returns a
  bad value leaves parameters, optimiser state and step counter as they were.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_sym.baselines.padded import padded_forward, padded_generate
from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult, validate_prompts
from jaxrl_sym.models.contract import check_model, model_fingerprint
from jaxrl_sym.rl.algorithms import (
    RLConfig,
    gae,
    merge_aux,
    rl_loss,
    sample_advantages,
    token_logprobs,
    token_weights,
    value_predictions,
    whiten,
)
from jaxrl_sym.rl.errors import RewardError
from jaxrl_sym.rl.layout import SYSTEMS, Layout, build_layout
from jaxrl_sym.rl.overlap import ReferenceOverlap
from jaxrl_sym.runtime.engine import SymbolicLM, length_bucket
from jaxrl_sym.runtime.metrics import CompileCounter, device_peak_bytes, tree_bytes
from jaxrl_sym.runtime.programs import ProgramCache

RewardFn = Callable[[np.ndarray, np.ndarray], float]
"""``reward_fn(prompt_tokens, response_tokens) -> float``; the response includes the EOS token
when the row ended on one."""


@dataclass
class Rollout:
    """Generated samples, group after group (G consecutive samples share a prompt)."""

    prompts: list[np.ndarray]
    responses: list[np.ndarray]
    old_logprobs: list[np.ndarray]
    group_size: int
    stats: dict = field(default_factory=dict)
    ref_logprobs: list[np.ndarray] | None = None
    """Reference log-probs per sample when they were computed during generation (sym, beta > 0,
    ``RLConfig.overlap_reference``); None means the step runs the reference pass afterwards."""

    @property
    def useful_tokens(self) -> int:
        return int(sum(len(p) + len(r) for p, r in zip(self.prompts, self.responses, strict=True)))


def compute_rewards(fn: RewardFn, prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray],
                    *, what: str = "reward function") -> np.ndarray:
    """Call ``fn`` per sample and insist on one finite real number each.

    Why so strict: a NaN or a vector reward would silently poison the group statistics and then
    every parameter; failing here, before the update, keeps the model intact and names the sample.
    """
    out = np.zeros(len(prompts), np.float64)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        try:
            v = fn(p, r)
        except Exception as e:
            raise RewardError(
                f"{what} raised on sample {i} (prompt {p.tolist()}, response {r.tolist()}): "
                f"{type(e).__name__}: {e}. The step was not applied.", i) from e
        a = np.asarray(v)
        if a.shape != () or a.dtype == bool or not np.issubdtype(a.dtype, np.number) \
                or np.iscomplexobj(a):
            raise RewardError(
                f"{what} returned {type(v).__name__} of shape {a.shape} and dtype {a.dtype} on "
                f"sample {i}; it must return one real number per (prompt, response). The step "
                "was not applied.", i)
        if not np.isfinite(a):
            raise RewardError(f"{what} returned {float(a)} on sample {i} (prompt {p.tolist()}, "
                              f"response {r.tolist()}); rewards must be finite. The step was not "
                              "applied.", i)
        out[i] = float(a)
    return out


def params_sha256(params: Any) -> str:
    """Digest of every parameter array (shape, dtype and bytes, in pytree order).

    Used to check that an interrupted-and-resumed run ends exactly where an uninterrupted one does.
    """
    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(params):
        a = np.ascontiguousarray(np.asarray(x))
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class _Programs:
    """The runtime's :class:`ProgramCache` keyed by (name, argument shapes), plus the peak of
    bytes held while a program runs (inputs + resident state + XLA temporaries + outputs).

    Compiling ahead of time (``lower().compile()``) is what gives access to
    ``memory_analysis()``; the cache key mirrors jit's own (pytree structure + shapes/dtypes).
    """

    def __init__(self) -> None:
        self.cache = ProgramCache()
        self.peak = 0

    @property
    def compiles(self) -> int:
        return self.cache.compiles

    def run(self, name: str, fn: Any, *args: Any, resident: int = 0) -> Any:
        leaves, tdef = jax.tree_util.tree_flatten(args)
        key = (name, tdef, tuple((np.shape(x), np.result_type(x).str) for x in leaves))
        out = self.cache.run(key, lambda: fn.lower(*args).compile(), *args)
        held = resident + sum(int(x.nbytes) for x in leaves)
        self.peak = max(self.peak, held + self.cache.temp_bytes[key] + tree_bytes(out))
        return out


class RLTrainer:
    """Policy, optimiser and reference for RL fine-tuning, on the ``sym`` or ``padded`` system.

    Args:
      model: the policy (its current weights are the starting point and, with ``beta > 0``, the
        reference).
      reward_fn: ``(prompt, response) -> float`` per sample.
      cfg: algorithm and hyper-parameters (:class:`RLConfig`).
      system: ``sym`` (exact lengths) or ``padded`` (baseline).
      metric_fn: optional second per-sample function reported as ``exact_match`` (not optimised).
      min_capacity: initial slots of the symbolic runtime's growing stores.
    """

    def __init__(
        self,
        model: nnx.Module,
        reward_fn: RewardFn,
        cfg: RLConfig,
        *,
        system: str = "sym",
        metric_fn: RewardFn | None = None,
        min_capacity: int = 16,
    ) -> None:
        if system not in SYSTEMS:
            raise InputError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")
        if not callable(reward_fn):
            raise InputError(f"reward_fn must be callable (prompt, response) -> float, got "
                             f"{type(reward_fn).__name__}")
        self.cfg = cfg
        self.system = system
        self.reward_fn = reward_fn
        self.metric_fn = metric_fn
        info = check_model(model)  # any model that follows the contract; fails early otherwise
        self.vocab_size = info.vocab_size
        self.model_fingerprint = model_fingerprint(model)
        self.graphdef, state = nnx.split(model)
        leaves, self.treedef = jax.tree_util.tree_flatten(state)
        self._model_ref = model
        self._min_capacity = min_capacity
        self._engine: SymbolicLM | None = None
        params: dict[str, Any] = {"lm": [jnp.asarray(x) for x in leaves]}
        if cfg.algo == "ppo":
            # Zero-initialised read-out: the first value estimates are 0, GAE then starts from
            # Monte-Carlo returns instead of noise.
            params["value"] = {"w": jnp.zeros((self.vocab_size,), jnp.float32),
                               "b": jnp.zeros((), jnp.float32)}
        self.params = params
        self.ref_leaves = [jnp.array(x, copy=True) for x in leaves] if cfg.beta > 0 else None
        parts = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm else []
        self.tx = optax.chain(*parts, optax.adam(cfg.lr))
        self.opt_state = self.tx.init(self.params)
        self.steps_done = 0
        self.programs = _Programs()
        self._fns: dict[str, dict[str, Any]] = {}
        if system == "sym":
            self.engine  # noqa: B018 - trace now, so a model the runtime rejects fails here

    # ------------------------------------------------------------------ pieces
    @property
    def engine(self) -> SymbolicLM:
        """The symbolic runtime (traced on first use; shares the trainer's weights)."""
        if self._engine is None:
            self._engine = SymbolicLM(self._model_ref, min_capacity=self._min_capacity,
                                      max_pad_fraction=self.cfg.gen_max_pad_fraction)
            self._engine.set_params(self.params["lm"])
        return self._engine

    def model(self) -> nnx.Module:
        """An NNX model holding the current policy weights (for the padded baseline)."""
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef,
                                                                     self.params["lm"]))

    def _logits_fn(self, system: str) -> Callable[..., jax.Array]:
        if system == "sym":
            fwd = self.engine.forward_fn()
            return lambda leaves, inputs: fwd(leaves, *inputs)
        graphdef, treedef = self.graphdef, self.treedef

        def padded_logits(leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> jax.Array:
            model = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
            return padded_forward(model, inputs[0], inputs[1])

        return padded_logits

    def fns(self, system: str) -> dict[str, Any]:
        """Jitted reference / value / loss-grad / update functions for one layout."""
        if system in self._fns:
            return self._fns[system]
        cfg, tx = self.cfg, self.tx
        logits_fn = self._logits_fn(system)

        def ref_lp(leaves, inputs, targets):
            return token_logprobs(logits_fn(leaves, inputs), targets, cfg.temperature)

        def values(params, inputs):
            return value_predictions(logits_fn(params["lm"], inputs), params["value"])

        # Rematerialise the loss head: only the logits are kept for the backward pass, not the
        # log-softmax, softmax and entropy terms — each another [slots × vocab] fp32 buffer.
        head = jax.checkpoint(lambda logits, arrays, value: rl_loss(logits, arrays, value, cfg))

        def loss(params, inputs, arrays):
            return head(logits_fn(params["lm"], inputs), arrays, params.get("value"))

        grad_fn = jax.value_and_grad(loss, has_aux=True)

        def update(params, opt_state, inputs, arrays):
            (_, aux), grads = grad_fn(params, inputs, arrays)
            updates, opt_state = tx.update(grads, opt_state, params)
            aux = {**aux, "grad_norm": optax.tree.norm(grads)}
            return optax.apply_updates(params, updates), opt_state, aux

        def apply(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

        def add(a, b):
            return jax.tree_util.tree_map(jnp.add, a, b)

        self._fns[system] = {
            "ref": jax.jit(ref_lp), "values": jax.jit(values), "grad": jax.jit(grad_fn),
            "update": jax.jit(update), "apply": jax.jit(apply, donate_argnums=(2,)),
            "add": jax.jit(add, donate_argnums=(0,)),
        }
        return self._fns[system]

    def _resident(self) -> int:
        return tree_bytes(self.opt_state) + (tree_bytes(self.ref_leaves) if self.ref_leaves
                                             else 0)

    # ------------------------------------------------------------------ stages
    def generate(self, prompts: Sequence[np.ndarray | Sequence[int]], seed: int,
                 limits: Sequence[int] | None = None) -> Rollout:
        """G samples per prompt at the configured temperature, with their sampling log-probs.

        limits: optional response limits, one per prompt or one per sample (prompt-major, G per
        prompt); default ``cfg.max_new_tokens`` for every row.
        """
        cfg = self.cfg
        n, g = len(prompts), cfg.group_size
        max_new: int | tuple[int, ...] = cfg.max_new_tokens
        if limits is not None:
            lim = [int(x) for x in limits]
            if len(lim) == n:
                lim = [x for x in lim for _ in range(g)]
            elif len(lim) != n * g:
                raise InputError(f"limits has {len(lim)} entries; give one per prompt ({n}) or "
                                 f"one per sample ({n * g})")
            max_new = tuple(lim)
        gcfg = GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_id=cfg.eos_id,
                                temperature=cfg.temperature, seed=int(seed) & 0x7FFFFFFF)
        # Validate the user's prompts first so errors name *their* index, not a repeated copy's.
        ps = validate_prompts(list(prompts), self.vocab_size, gcfg)
        gcfg = replace(gcfg, max_new_tokens=max_new)
        expanded = [p for p in ps for _ in range(g)]
        res: GenerationResult
        overlap = None
        if self.system == "sym":
            if self.ref_leaves is not None and cfg.overlap_reference:
                overlap = self._reference_overlap(expanded, gcfg)
            res = self.engine.generate(
                expanded, gcfg, on_finished=None if overlap is None else overlap.on_finished)
        else:
            res = padded_generate(self.model(), expanded, gcfg)
        stats = dict(res.stats)
        ref = None
        if overlap is not None:
            t = time.perf_counter()
            ref = overlap.collect(len(expanded), res.tokens)
            stats["ref_collect_seconds"] = time.perf_counter() - t
            stats["ref_chunks"] = overlap.chunks
            stats["ref_overlapped_samples"] = overlap.overlapped_samples
        return Rollout(expanded, list(res.tokens), list(res.logprobs), g, stats, ref)

    def _reference_overlap(self, prompts: list[np.ndarray], gcfg: GenerationConfig
                           ) -> ReferenceOverlap:
        """Reference scoring that runs while generation is still going (see ``overlap.py``)."""
        limits = gcfg.max_new_tokens
        longest = max(len(p) for p in prompts) + (max(limits) if isinstance(limits, tuple)
                                                  else int(limits))
        row_len = self.cfg.pack_row_len or length_bucket(max(longest, 64))
        fn = self.fns("sym")["ref"]

        def dispatch(lay: Layout) -> Any:
            return self.programs.run("ref-sym", fn, self.ref_leaves, lay.inputs, lay.targets,
                                     resident=tree_bytes(self.params) + self._resident())

        return ReferenceOverlap(prompts, row_len, dispatch, min_rows=max(1, len(prompts) // 4),
                                max_rows=self.rows_per_chunk(row_len))

    def greedy(self, prompts: Sequence[np.ndarray], max_new_tokens: int) -> list[np.ndarray]:
        """Greedy responses of the current policy (evaluation; nothing is trained)."""
        gcfg = GenerationConfig(max_new_tokens=max_new_tokens, eos_id=self.cfg.eos_id,
                                temperature=0.0)
        res = (self.engine.generate(list(prompts), gcfg) if self.system == "sym"
               else padded_generate(self.model(), list(prompts), gcfg))
        return list(res.tokens)

    def layout(self, rollout: Rollout, system: str | None = None) -> Layout:
        return build_layout(system or self.system, rollout.prompts, rollout.responses,
                            row_len=self.cfg.pack_row_len)

    def rows_per_chunk(self, width: int) -> int | None:
        """Rows of ``width`` slots per forward so one program holds at most ``update_tokens``
        slots (None: no limit). Every whole-batch forward — reference, values, update — is cut
        to this: the ``[slots × vocab]`` logits are what exhausts memory at real vocabularies
        (151,936 words: 0.6 MB per slot in fp32)."""
        if self.cfg.update_tokens is None:
            return None
        return max(1, self.cfg.update_tokens // width)

    def _row_chunks(self, layout: Layout) -> list[slice]:
        rows, width = layout.shape
        per = self.rows_per_chunk(width) or rows
        return [slice(i, i + per) for i in range(0, rows, per)]

    def reference_logprobs(self, layout: Layout) -> np.ndarray:
        """[rows, L] reference log-probs at the response-predicting slots (0 with beta = 0)."""
        if self.ref_leaves is None:
            return np.zeros(layout.shape, np.float32)
        fn = self.fns(layout.system)["ref"]
        outs = [self.programs.run(f"ref-{layout.system}", fn, self.ref_leaves,
                                  tuple(x[sl] for x in layout.inputs), layout.targets[sl],
                                  resident=tree_bytes(self.params) + self._resident())
                for sl in self._row_chunks(layout)]
        return np.concatenate([np.asarray(o) for o in outs])

    def value_estimates(self, layout: Layout) -> np.ndarray:
        """[rows, L] PPO value estimates of the current policy (before the update)."""
        fn = self.fns(layout.system)["values"]
        outs = [self.programs.run(f"values-{layout.system}", fn, self.params,
                                  tuple(x[sl] for x in layout.inputs), resident=self._resident())
                for sl in self._row_chunks(layout)]
        return np.concatenate([np.asarray(o) for o in outs])

    def loss_arrays(self, layout: Layout, rollout: Rollout, rewards: np.ndarray,
                    ref_slots: np.ndarray, value_slots: np.ndarray | None = None
                    ) -> dict[str, np.ndarray]:
        """Everything the loss needs, scattered to the layout's response-predicting slots."""
        cfg = self.cfg
        lengths = [len(r) for r in rollout.responses]
        arrays = {
            "targets": layout.targets,
            "mask": layout.mask(),
            "weight": layout.scatter(token_weights(lengths, cfg.loss_agg)),
            "old_lp": layout.scatter(rollout.old_logprobs),
            "ref_lp": ref_slots.astype(np.float32),
        }
        if cfg.algo == "ppo":
            if value_slots is None:
                raise InputError("PPO needs value estimates: pass value_slots")
            vals = layout.gather(value_slots)
            token_rewards = []
            for n, r in zip(lengths, rewards, strict=True):
                tr = np.zeros(n, np.float32)
                tr[-1] = r  # outcome reward arrives with the last token
                token_rewards.append(tr)
            advs, rets = gae(token_rewards, vals, cfg.gamma, cfg.lam)
            arrays["adv"] = layout.scatter(whiten(advs))
            arrays["returns"] = layout.scatter(rets)
            arrays["old_values"] = value_slots.astype(np.float32)
        else:
            adv = sample_advantages(rewards, rollout.group_size, cfg.algo, cfg.adv_eps)
            arrays["adv"] = layout.scatter(adv)
        return arrays

    def prepare(self, rollout: Rollout, rewards: np.ndarray, system: str | None = None
                ) -> tuple[Layout, dict[str, np.ndarray]]:
        """Layout + loss arrays for a rollout on ``system`` (reference/values via its forward)."""
        layout = self.layout(rollout, system)
        ref = self.reference_logprobs(layout)
        vals = self.value_estimates(layout) if self.cfg.algo == "ppo" else None
        return layout, self.loss_arrays(layout, rollout, rewards, ref, vals)

    def loss_and_grads(self, rollout: Rollout, rewards: np.ndarray, system: str | None = None
                       ) -> tuple[float, dict[str, float], Any]:
        """(loss, aux, grads) at the current parameters, without updating (tests, debugging)."""
        layout, arrays = self.prepare(rollout, rewards, system)
        (loss, aux), grads = self.fns(layout.system)["grad"](self.params, layout.inputs, arrays)
        return float(loss), {k: float(v) for k, v in aux.items()}, grads

    def micro_batches(self, layout: Layout, arrays: dict[str, np.ndarray]
                      ) -> list[tuple[tuple[np.ndarray, ...], dict[str, np.ndarray]]]:
        """Row slices of the training batch of at most ``update_tokens`` slots each (one slice
        when unset). Rows are never split: a packed row's sequences attend within the row."""
        return [(tuple(x[sl] for x in layout.inputs), {k: v[sl] for k, v in arrays.items()})
                for sl in self._row_chunks(layout)]

    def _update(self, params: Any, opt_state: Any, layout: Layout,
                arrays: dict[str, np.ndarray]) -> tuple[Any, Any, dict[str, float]]:
        """One optimiser update from the whole batch: fused loss-grad-update when it is one
        micro-batch, else gradients summed over micro-batches, then one optax update."""
        fns, sys_ = self.fns(layout.system), layout.system
        resident = tree_bytes(self.ref_leaves) if self.ref_leaves else 0
        chunks = self.micro_batches(layout, arrays)
        if len(chunks) == 1:
            params, opt_state, aux = self.programs.run(
                f"update-{sys_}", fns["update"], params, opt_state, *chunks[0], resident=resident)
            return params, opt_state, {k: float(v) for k, v in jax.device_get(aux).items()}
        grads, parts = None, []
        for inputs, arr in chunks:
            (_, aux), g = self.programs.run(
                f"grad-{sys_}", fns["grad"], params, inputs, arr,
                resident=resident + tree_bytes(opt_state) + tree_bytes(grads))
            grads = g if grads is None else self.programs.run(f"add-{sys_}", fns["add"], grads, g)
            parts.append(aux)
        params, opt_state, gnorm = self.programs.run(
            f"apply-{sys_}", fns["apply"], params, opt_state, grads, resident=resident)
        merged = merge_aux([{k: float(v) for k, v in jax.device_get(a).items()} for a in parts])
        return params, opt_state, {**merged, "grad_norm": float(gnorm)}

    # ------------------------------------------------------------------ the step
    def step(self, prompts: Sequence[np.ndarray | Sequence[int]], *, seed: int,
             limits: Sequence[int] | None = None) -> dict[str, Any]:
        """Run one full RL step and commit it; returns the step's metrics.

        Stages are timed separately (``seconds``); compile time lands in whichever stage first
        needed a program of that shape (``compiles`` counts XLA compiles in the step).
        """
        cfg = self.cfg
        self.programs.peak = 0
        sec: dict[str, float] = {}
        with CompileCounter() as cc:
            t = time.perf_counter()
            rollout = self.generate(prompts, seed, limits)
            sec["generation"] = time.perf_counter() - t
            t = time.perf_counter()
            layout = self.layout(rollout)
            sec["pack"] = time.perf_counter() - t
            t = time.perf_counter()
            if rollout.ref_logprobs is not None:  # scored during generation: only the read-back
                ref = layout.scatter(rollout.ref_logprobs)
                sec["reference"] = (time.perf_counter() - t
                                    + rollout.stats.get("ref_collect_seconds", 0.0))
                sec["generation"] -= rollout.stats.get("ref_collect_seconds", 0.0)
            else:
                ref = self.reference_logprobs(layout)
                sec["reference"] = time.perf_counter() - t
            t = time.perf_counter()
            rewards = compute_rewards(self.reward_fn, rollout.prompts, rollout.responses)
            metric = (compute_rewards(self.metric_fn, rollout.prompts, rollout.responses,
                                      what="metric function")
                      if self.metric_fn is not None else None)
            sec["reward"] = time.perf_counter() - t
            t = time.perf_counter()
            vals = self.value_estimates(layout) if cfg.algo == "ppo" else None
            arrays = self.loss_arrays(layout, rollout, rewards, ref, vals)
            sec["advantage"] = time.perf_counter() - t
            t = time.perf_counter()
            params, opt_state = self.params, self.opt_state
            auxes = []
            for _ in range(cfg.epochs):
                params, opt_state, aux = self._update(params, opt_state, layout, arrays)
                auxes.append(aux)
            aux_h, last_aux = auxes[0], auxes[-1]
            if not all(math.isfinite(v) for v in last_aux.values()):
                raise InputError(f"non-finite loss/gradients in the update ({last_aux}); the step "
                                 "was not applied. Lower the learning rate or check rewards.")
            sec["update"] = time.perf_counter() - t
        # ---- commit (nothing above changed the trainer's state)
        self.params, self.opt_state = params, opt_state
        if self._engine is not None:
            self._engine.set_params(self.params["lm"])
        self.steps_done += 1
        sec["total"] = sum(sec.values())
        gen_peak = int(rollout.stats.get("accounted_peak_bytes",
                                         rollout.stats.get("accounted_bytes", 0)))
        dev_peak = device_peak_bytes()
        peak = dev_peak if dev_peak is not None else max(gen_peak + self._resident(),
                                                          self.programs.peak)
        lengths = [len(r) for r in rollout.responses]
        useful = rollout.useful_tokens
        out: dict[str, Any] = {
            "step": self.steps_done,
            "reward": float(rewards.mean()),
            # k3 estimate of KL(policy || reference) over response tokens; None without a
            # reference pass (beta = 0), where there is nothing to compare against
            "kl": aux_h["kl"] if self.ref_leaves is not None else None,
            "loss": aux_h["loss"],
            "clip_frac": last_aux["clip_frac"],
            "entropy": aux_h["entropy"],
            "grad_norm": aux_h["grad_norm"],
            "response_len": float(np.mean(lengths)),
            "samples": len(lengths),
            "generated_tokens": int(sum(lengths)),
            "useful_tokens": useful,
            "useful_tokens_per_s": useful / sec["total"],
            "padding_fraction": layout.padding_fraction,
            "layout_shape": list(layout.shape),
            "peak_bytes": int(peak),
            "compiles": cc.count,
            "compile_seconds": cc.seconds,
            # generation's own split (the padded baseline compiles its program on every call)
            "generation_run_seconds": float(rollout.stats.get("run_seconds", sec["generation"])),
            "generation_compile_seconds": float(rollout.stats.get("compile_seconds", 0.0)),
            # reference chunks dispatched while generation still ran (0: a separate pass)
            "reference_chunks_during_generation": int(rollout.stats.get("ref_chunks", 0)),
            "seconds": sec,
        }
        if metric is not None:
            out["exact_match"] = float(metric.mean())
        if "v_loss" in aux_h:
            out["v_loss"] = aux_h["v_loss"]
        return out

    def params_sha256(self) -> str:
        return params_sha256(self.params)
