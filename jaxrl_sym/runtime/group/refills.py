"""A decode group's refills: free rows take waiting samples, their prompts copied in from the
prompt cache (:mod:`jaxrl_sym.runtime.prompt_cache`).

Why apart from :mod:`jaxrl_sym.runtime.group.loop`: the group's loop asks, between dispatches,
whether to refill; what a refill does — which rows and samples, the cache chunk to build, the
one refill program, the host's bookkeeping of the new rows and their token 0 — is this room.
:class:`RefillRows` is mixed into :class:`~jaxrl_sym.runtime.group.loop.DecodeGroup` and works on
its state (rows, stores, the work log); the policy itself (when, how many) is
:class:`~jaxrl_sym.runtime.refill.Refill`'s.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxrl_sym.runtime.group.outputs import OnFinished, Outputs
from jaxrl_sym.runtime.group.programs_by_shape import prompt_cache_program, refill_program
from jaxrl_sym.sharding import to_host


class RefillRows:
    """Refilling a :class:`~jaxrl_sym.runtime.group.loop.DecodeGroup`'s free rows (see the module
    docstring); every attribute it reads is the group's."""

    def refill_rows(self, hoisted: tuple[jax.Array, ...], out: Outputs,
                    on_finished: OnFinished | None) -> bool:
        """Give free rows (finished, or not yet used) waiting samples when the refill policy
        says so — one refill from the prompt cache (:meth:`fill_rows`) — and read their token
        0; returns whether it refilled. With no live row left every free row is refilled."""
        free = np.nonzero(self.state.done)[0]
        n = (self.refill.take(len(free), len(self.waiting)) if len(free) < len(self.state)
             else min(len(free), len(self.waiting)))
        if n == 0:
            return False
        n = self.feed.servable(self.waiting[:n])  # one cache chunk per refill
        slots, new = free[:n], self.waiting[:n]
        self.waiting = self.waiting[n:]
        self.state = self.state.seat(slots, new, self.all_limits[new],
                                     [len(self.prompts[i]) - self.steps_done for i in new],
                                     off=self.steps_done)
        self._first_tokens(slots, *self.fill_rows(hoisted, slots, new), out, on_finished)
        if not self.waiting:  # the last refill: the cache's memory goes back for the tail
            self.feed.loaded(self.feed.at, None, None)
        return True

    def fill_rows(self, hoisted: tuple[jax.Array, ...], slots: np.ndarray, samples: list[int]
                  ) -> tuple[Any, Any, Any]:
        """The refill program: ``samples``' prompts (one cache chunk, built first if it is not
        loaded) written from the cache into rows ``slots``, ending before the slot the next
        decode step writes; returns their token 0, log-prob and logits (device arrays)."""
        chunk = self.feed.needs_load(samples[0])
        if chunk is not None:
            self.load_cache(hoisted, chunk)
        pcap = self.shape.prompt_slots
        host = self.feed.rows_args(self.rows, slots, samples)
        args = (self.stores, self.feed.kv, self.feed.logits, *map(jax.device_put, host),
                np.int32(pcap + self.steps_done), np.int32(self.steps_done + 1), self.row_ids,
                self.seed)
        key, build = refill_program(self.plan, self.cfg, pcap, args)
        self.stores, tok, lp, lg = self.cache.run(key, build, *args)
        del args, build  # they hold the stores before the refill, donated
        self._observe(key, step=self.steps_done)
        return tok, lp, lg

    def load_cache(self, hoisted: tuple[jax.Array, ...], chunk: int) -> None:
        """Run chunk ``chunk``'s distinct prompts through the model into the prompt cache
        (:func:`~jaxrl_sym.runtime.prefill.cache_prompts`); its positions are booked as a
        prefill's."""
        pk = self.feed.chunks[chunk].packed
        self.work.computed += pk.positions_computed
        self.work.needed += pk.prompt_tokens
        self.work.add("packing", pk.positions_computed - pk.prompt_tokens)
        self.feed.loaded(chunk, None, None)  # the old chunk's entries go before the new ones
        args = (hoisted, *map(jax.device_put, (pk.tokens, pk.positions, pk.rows, pk.last)))
        key, build = prompt_cache_program(self.plan, pk, args)
        self.feed.loaded(chunk, *self.cache.run(key, build, *args))
        self._observe(key, step=self.steps_done)

    def _first_tokens(self, slots: np.ndarray, tok: Any, lp: Any, lg: Any, out: Outputs,
                      on_finished: OnFinished | None) -> None:
        """Read the token 0 a refill sampled for ``slots`` (the other rows' are not theirs)."""
        tok_h, lp_h = to_host(tok), to_host(lp)
        lg_h = to_host(lg) if self.cfg.return_logits and out.logits is not None else None
        finished: list[int] = []
        ended = []
        for r in slots:
            i = int(self.state.ids[r])
            out.toks[i].append(int(tok_h[r]))
            out.lps[i].append(float(lp_h[r]))
            if lg_h is not None:
                out.logits[i].append(lg_h[r])
            ended.append(int(tok_h[r]) in self.cfg.eos_ids
                         or len(out.toks[i]) >= self.state.limits[r])
            if ended[-1]:
                out.finished[i] = True
                finished.append(i)
        self.state = self.state.emitted(slots, tok_h[slots], ended)
        if out.progress is not None:
            out.progress(sum(len(t) for t in out.toks))
        if finished and on_finished is not None:
            on_finished(finished, [np.asarray(out.toks[i], np.int32) for i in finished])
