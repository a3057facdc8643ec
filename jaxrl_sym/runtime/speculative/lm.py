"""Speculative decoding on the symbolic runtime: a draft proposes k tokens per row, the target
verifies them in one forward over k+1 positions, and each row keeps its own number of them.

The drafts, the acceptance rule and the speculation log live in
:mod:`jaxrl_sym.runtime.speculative.rules` (shared with the padded baseline); the verify
program and the on-device draft in :mod:`jaxrl_sym.runtime.speculative.tile`. Here:

- :func:`choose_k`: the adaptive k, from measured acceptance and verify cost;
- :class:`SpeculativeGroup`: the host loop of one aligned microbatch (prefill, compaction and
  growth are :class:`DecodeGroup`'s, decided by :func:`~jaxrl_sym.runtime.policy.next_dispatch`),
  dispatching tiles of ``verify_tile`` draft + verify steps; every attention store writes its
  entries at per-row slots (:meth:`StoreKind.verify`) — the stores own the "advance by the
  accepted count" behaviour: a row's next verify starts at its first rejected slot and
  overwrites the rejected entries;
- :class:`SpeculativeLM`: a :class:`SymbolicLM` whose generate runs it, its ring/block stores
  planned ``k`` slots larger (speculation is a planning input of
  :func:`~jaxrl_sym.runtime.plan.compile_generation`).

Compiles: one verify program per (row bucket, store capacity, k); k comes from a small fixed set
(powers of two up to ``speculate``) when adaptive.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_sym.errors import InputError
from jaxrl_sym.generation import GenerationConfig, GenerationResult
from jaxrl_sym.runtime.engine import SymbolicLM
from jaxrl_sym.runtime.group.loop import DecodeGroup
from jaxrl_sym.runtime.group.outputs import OnFinished, Outputs
from jaxrl_sym.runtime.metrics import MemoryMeter
from jaxrl_sym.runtime.options import EngineOptions, Speculation
from jaxrl_sym.runtime.packing import PackedPrompts
from jaxrl_sym.runtime.plan import GenerationPlan, compile_generation
from jaxrl_sym.runtime.policy import next_pow2
from jaxrl_sym.runtime.programs import ProgramCache
from jaxrl_sym.runtime.speculative.draft import DraftModel
from jaxrl_sym.runtime.speculative.rules import SpecLog
from jaxrl_sym.runtime.speculative.tile import VerifyRows, verify_tile
from jaxrl_sym.sharding import to_host

DRAFTS = ("ngram",)


# --------------------------------------------------------------------------- adaptive k
def choose_k(log: SpecLog, ks: tuple[int, ...], rows: int) -> int:
    """The k of ``ks`` with the most expected tokens per second.

    A verify of k drafts emits ``(1 - a^(k+1)) / (1 - a)`` tokens per row in expectation when
    each draft is accepted with probability a (the measured rate, independent drafts assumed);
    its cost is the measured seconds per verify at that k (unmeasured k: a line through the
    measured costs, or with one measurement that cost scaled by positions — optimistic for
    smaller k, so each gets tried). Before any measurement, the largest k.
    """
    a = log.rate()
    if a is None or len(ks) == 1:
        return ks[-1]
    measured = {k: log.verify_seconds[k] / log.timed[k] for k in ks if log.timed.get(k)}
    if not measured:
        return ks[-1]
    if len(measured) >= 2:  # a line through the measured costs (c0 + c1 (k+1)), floored
        xs = np.asarray([k + 1 for k in measured], float)
        c1, c0 = np.polyfit(xs, np.asarray(list(measured.values())), 1)
        guess = lambda k: max(c0 + c1 * (k + 1), min(measured.values()))
    else:
        ((ref, c),) = measured.items()
        guess = lambda k: c * (k + 1) / (ref + 1)

    def cost(k: int) -> float:
        return measured.get(k) or guess(k)

    def gain(k: int) -> float:
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    return max(ks, key=lambda k: gain(k) / cost(k))


# --------------------------------------------------------------------------- the host loop
class SpeculativeGroup(DecodeGroup):
    """A :class:`DecodeGroup` that decodes by draft + verify instead of single steps.

    Row s's token j (response index) is fed at position ``len(prompt) + j`` and written at slot
    ``prompt_slots + j`` — the plain decode layout — so prefill, compaction and growth are
    inherited unchanged; only the write offsets now differ per row. Compaction and growth are
    the policy's (:meth:`DecodeGroup.next_dispatch`), as for plain decoding.

    draft: the draft model (None: prompt lookup); log: this call's speculation log (its cost
    table carries over calls: :class:`SpeculativeLM`).
    """

    def __init__(self, plan: GenerationPlan, cache: ProgramCache, *args: Any,
                 draft: DraftModel | None, log: SpecLog, **kwargs: Any) -> None:
        super().__init__(plan, cache, *args, **kwargs)
        assert plan.speculation is not None, "a speculative group needs a speculative plan"
        self.speculation, self.draft, self.log = plan.speculation, draft, log
        self.draft_stores: dict = {}
        if draft is not None:
            self.draft_stores = draft.init(
                cache, self.rows, DraftModel.capacity(self.shape.total, self.speculation.k))

    def prefill(self, hoisted: tuple[jax.Array, ...]) -> tuple[Any, ...]:
        """The target's prefill, then the draft model's from the same packed prompts."""
        out = super().prefill(hoisted)
        if self.draft is not None:
            prompts = [self.prompts[i] if i >= 0 else None for i in self.state.ids]
            pk = PackedPrompts.build(prompts, self.shape.prompt_slots,
                                     vocab=self.plan.vocab_size,
                                     logits_bytes=self.cfg.prefill_logits_bytes)
            arrays = tuple(jax.device_put(x) for x in (pk.tokens, pk.positions, pk.rows,
                                                        pk.slots, pk.last, pk.copies))
            self.draft_stores = self.draft.prefill(self.cache, self.draft_stores,
                                                   (*arrays, self.row_ids, self.seed),
                                                   chunk_rows=pk.chunk_rows)
        return out

    def compact(self, live: np.ndarray, rows: int) -> None:
        """The target's compaction; the draft's stores keep the same rows."""
        if self.draft is not None:
            keep, filler = self.kept(live, rows)
            self.draft_stores = self.draft.compact(self.cache, self.draft_stores,
                                                   jax.device_put(keep.astype(np.int32)),
                                                   jax.device_put(filler),
                                                   self.on_device.pos0, self.row_ids)
        super().compact(live, rows)

    def run(self, hoisted: tuple[jax.Array, ...], out: Outputs,
            on_finished: OnFinished | None) -> None:
        self.collect(self.prefill(hoisted), out, on_finished)
        log, m = self.log, self.speculation.verify_tile
        while not self.state.done.all() and not out.should_stop():
            live = self.state.live()
            k = choose_k(log, self.speculation.ks, self.rows)
            top = max(len(out.toks[int(self.state.ids[s])]) for s in live)
            # a tile writes up to m (k + 1) slots past the longest row's last token
            span = m * (k + 1) + 1
            d = self.next_dispatch(live, steps_done=top - 1, remaining=span, tile=span,
                                   grow_with_compaction=False, check=1)
            self.carry_out(d, live)
            live = self.state.live()
            emitted = {int(s): len(out.toks[int(self.state.ids[s])]) for s in live}
            t0, compiles = time.perf_counter(), self.cache.compiles
            res = self._verify(hoisted, self._inputs(out, emitted, k), k, m)
            self._collect_verified(res, out, on_finished, emitted, k)
            log.verifies[k] = log.verifies.get(k, 0) + m
            if self.cache.compiles == compiles:
                log.verify_seconds[k] = log.verify_seconds.get(k, 0.0) + time.perf_counter() - t0
                log.timed[k] = log.timed.get(k, 0) + m

    def _inputs(self, out: Outputs, emitted: dict[int, int], k: int) -> VerifyRows:
        """One verify tile's rows, host arrays: token history (prompt + response, the device
        draft reads it), its length, tokens emitted, limit, slot offset, done, sampling id."""
        b, pcap = self.rows, self.shape.prompt_slots
        # any row's prompt + response + a step's overhang; a power of two: fewer programs
        size = next_pow2(self.shape.total + k + 1)
        hist = np.zeros((b, size), np.int32)
        length, done = np.ones((b,), np.int32), np.ones((b,), bool)
        n_out, offset = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
        for s, n in emitted.items():
            i = int(self.state.ids[s])
            p = self.prompts[i]
            hist[s, :len(p)], hist[s, len(p):len(p) + n] = p, out.toks[i]
            length[s], n_out[s], offset[s], done[s] = len(p) + n, n, pcap - len(p), False
        return VerifyRows(hist, length, n_out, self.state.limits.astype(np.int32), offset, done,
                          self.state.row_id)

    def _verify(self, hoisted: tuple[jax.Array, ...], rows: VerifyRows, k: int,
                m: int) -> tuple[Any, ...]:
        plan, cfg, dm = self.plan, self.cfg, self.draft
        if plan.mesh is not None:
            self.stores = plan.builder.place_stores(self.stores)
        args = (hoisted, self.stores, jax.device_put(rows), self.seed,
                () if dm is None else dm.hoisted(), self.draft_stores)
        caps = lambda st: tuple(sorted((n, s["pos"].shape[1]) for n, s in st.items()
                                       if "pos" in s))
        key = ("verify_tile", self.rows, k, m, rows.hist.shape[1], caps(self.stores),
               caps(self.draft_stores), cfg.temperature, cfg.return_logits, cfg.eos_ids)
        fn = partial(verify_tile, plan.builder, temperature=cfg.temperature,
                     want_logits=cfg.return_logits, k=k, m=m, eos=cfg.eos_ids,
                     draft=None if dm is None else dm.plan.builder)
        self.stores, self.draft_stores, *res = self.cache.run(
            key, lambda a=args: jax.jit(fn, donate_argnums=(1, 5)).lower(*a).compile(), *args)
        del args
        self.work.computed += self.rows * (k + 1) * m
        self._observe(key, step=self.steps_done)
        return tuple(res)

    def _collect_verified(self, res: tuple[Any, ...], out: Outputs, on_finished: OnFinished | None,
                          emitted: dict[int, int], k: int) -> None:
        """Append each step's kept tokens per row (the device already cut at EOS/limit)."""
        tok, lp, keep, acc, lg = (to_host(x) for x in res)
        log, finished, ended = self.log, [], []
        for j in range(tok.shape[0]):
            for s in emitted:
                n = int(keep[j, s])
                if not n:
                    continue
                i = int(self.state.ids[s])
                log.proposed[i] = log.proposed.get(i, 0) + k
                log.accepted[i] = log.accepted.get(i, 0) + int(acc[j, s])
                out.toks[i].extend(int(t) for t in tok[j, s, :n])
                out.lps[i].extend(float(x) for x in lp[j, s, :n])
                if out.logits is not None:
                    out.logits[i].extend(lg[j, s, :n])
                if int(tok[j, s, n - 1]) in self.cfg.eos_ids or \
                        len(out.toks[i]) >= self.state.limits[s]:
                    ended.append(s)
                    out.finished[i] = True
                    finished.append(i)
        self.state = self.state.end(ended)
        self.work.needed += sum(len(out.toks[int(self.state.ids[s])]) - n
                                for s, n in emitted.items())
        self.at = dataclasses.replace(self.at, steps_done=self.steps_done + 1)
        if out.progress is not None:
            out.progress(sum(len(t) for t in out.toks))
        if finished and on_finished is not None:
            on_finished(finished, [np.asarray(out.toks[i], np.int32) for i in finished])


class SpeculativeLM(SymbolicLM):
    """A :class:`SymbolicLM` that generates by speculative decoding.

    Args (beyond :class:`SymbolicLM`'s):
      speculation: how to speculate (:class:`~jaxrl_sym.runtime.options.Speculation`): ``k``,
        the most draft tokens per verify; ``adaptive``, pick k per verify tile from
        {1, 2, 4, …, k} by measured acceptance and verify cost (:func:`choose_k`; False: always
        k, one verify program per shape); ``verify_tile``, draft + verify steps per dispatch
        (:mod:`jaxrl_sym.runtime.speculative.tile`: the draft runs on device, so m verifies cost
        one device→host sync).
      draft: ``"ngram"`` (prompt lookup, no model) or a draft model: an NNX module following
        the same contract with the target's vocabulary (:mod:`jaxrl_sym.runtime.speculative.draft`;
        proposes greedily on device, its own stores in the target's row layout).

    ``SpeculativeLM(model, EngineOptions(min_capacity=16), speculation=Speculation(4))``.
    Speculation is a planning input, as in :func:`~jaxrl_sym.runtime.plan.compile_generation`:
    ring and block stores are planned ``k`` slots larger
    (:meth:`StoreKind.speculative_capacity`); a model with a recurrent-state (linear attention)
    store is refused.
    """

    def __init__(self, model: nnx.Module, options: EngineOptions | None = None, *,
                 speculation: Speculation, draft: str | nnx.Module = "ngram",
                 mesh: Any = None) -> None:
        if not isinstance(speculation, Speculation):
            raise InputError(f"speculation={speculation!r}: give a Speculation, e.g. "
                             "SpeculativeLM(model, speculation=Speculation(4)) (plain decoding: "
                             "SymbolicLM)")
        if not isinstance(draft, nnx.Module) and draft not in DRAFTS:
            raise InputError(f"draft={draft!r}: choose one of {DRAFTS} (prompt lookup) or pass "
                             "a draft model (an NNX module with the target's vocabulary)")
        self.speculation = speculation
        super().__init__(model, options, mesh=mesh)
        self.draft_model = (None if isinstance(draft, str)
                            else DraftModel.build(draft, self.plan))
        self.draft_name = draft if isinstance(draft, str) else self.draft_model.name
        self.spec_log = SpecLog()

    def _compile(self, mesh: Any) -> GenerationPlan:
        return compile_generation(self.program, self.options, mesh=mesh,
                                  speculation=self.speculation)

    @property
    def speculate(self) -> int:
        return self.speculation.k

    def _group(self, group: list[int], prompts: list[np.ndarray], limits: np.ndarray,
               cfg: GenerationConfig, meter: MemoryMeter, weights_bytes: int
               ) -> SpeculativeGroup:
        return SpeculativeGroup(self.plan, self.cache, group, prompts, limits, cfg, meter,
                                weights_bytes, draft=self.draft_model, log=self.spec_log)

    def generate(self, prompts: Any, cfg: GenerationConfig, **kwargs: Any) -> GenerationResult:
        """As :meth:`SymbolicLM.generate`; stats add the speculation report (acceptance rate
        overall and per row, drafted/accepted tokens, verify steps per k, draft seconds)."""
        old = self.spec_log
        self.spec_log = SpecLog(verify_seconds=old.verify_seconds, timed=old.timed)
        res = super().generate(prompts, cfg, **kwargs)
        res.stats.update(self.spec_log.report(len(res.tokens)))
        res.stats["draft"] = self.draft_name
        return res
