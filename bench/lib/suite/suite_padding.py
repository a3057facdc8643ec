"""Padding fractions of the three generation systems, computed from the request alone.

Why from the request and not measured: the work each system launches is a deterministic function
of the prompt lengths, the per-row limits and its own buffer policy, so counting it on the host is
exact and costs nothing. For the symbolic runtime the count calls the host loop's own policy
(:mod:`jaxrl_sym.runtime.policy`: aligned microbatches, row buckets, decode tiles, compaction,
geometric growth of growing stores; :mod:`jaxrl_sym.runtime.packing`: packing) — the same
functions the engine executes, not a copy of them.

Two fractions, both "computed but not needed / computed":

``padding_fraction`` (token positions): a token position is one (row, position) pushed through
  the model (prefill or a decode step). Needed: each row's prompt plus every generated token fed
  back, ``sum_i p_i + L_i - 1``. Computed: padded = ``B * P`` (left-padded prompt block) plus
  ``B`` per decode step for all ``N - 1`` steps (finished rows keep decoding); per-shape = the
  same block plus ``B`` per step until every row is done; sym = per microbatch its packed
  prefill rows (the prompts bin-packed), plus the live-row bucket per decode step (after
  compaction). The engine also logs this itself while it runs (``waste_by_cause``).

``key_padding_fraction`` (attention key slots, decode steps only): per layer, row and decode
  step, the key slots attention runs over. Needed: the pattern's minimal footprint S(q) for the
  query position q of a live row: ``q + 1`` (full), ``min(q + 1, w)`` (window), ``q mod b + 1``
  (block), ``1`` (linear: the recurrent state (S, z) is read once). Computed: padded = MAX_LEN =
  ``P + N`` slots for every row and every pattern (masked); per-shape = the exact cache length
  ``P + s`` at step s; sym = the store's slots: the growing store's current capacity (full), ``w``
  (ring), ``b`` (block), ``1`` (state), for every row of the live bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from jaxrl_sym.runtime.packing import PackedPrompts
from jaxrl_sym.runtime.policy import DEFAULT_MAX_PAD_FRACTION, microbatches, replay


@dataclass(frozen=True)
class Layer:
    """One attention layer's pattern as the counting needs it: kind and size (w or b)."""

    kind: str  # full | window | block | linear
    size: int = 0

    def needed(self, q: int) -> int:
        """Keys the pattern needs for a query at position q (its minimal storage)."""
        if self.kind == "window":
            return min(q + 1, self.size)
        if self.kind == "block":
            return q % self.size + 1
        if self.kind == "linear":
            return 1
        return q + 1

    def sym_slots(self, growing_capacity: int) -> int:
        """Slots the symbolic runtime's store for this layer holds (and attention runs over)."""
        if self.kind in ("window", "block"):
            return self.size
        if self.kind == "linear":
            return 1
        return growing_capacity


def layers_for(attention: str, n_layers: int, window: int, block: int) -> list[Layer]:
    """The per-layer patterns the CLI's ``build_model`` gives each attention kind (mixed: even
    layers a window, odd layers full, as ``LMConfig.mixed``)."""
    if attention == "mixed":
        return [Layer("window", window) if i % 2 == 0 else Layer("full") for i in range(n_layers)]
    size = {"window": window, "block": block}.get(attention, 0)
    return [Layer(attention, size)] * n_layers


@dataclass
class Work:
    """Needed and computed counts of one system on one request."""

    tokens_needed: int = 0
    tokens_computed: int = 0
    keys_needed: int = 0
    keys_computed: int = 0

    def fractions(self) -> dict[str, float]:
        return {
            "padding_fraction": _frac(self.tokens_needed, self.tokens_computed),
            "key_padding_fraction": _frac(self.keys_needed, self.keys_computed),
        }


def _frac(needed: int, computed: int) -> float:
    return 0.0 if computed <= 0 else max(0.0, 1.0 - needed / computed)


def _needed(prompts: Sequence[int], limits: Sequence[int], layers: Sequence[Layer]) -> Work:
    w = Work()
    w.tokens_needed = sum(p + n - 1 for p, n in zip(prompts, limits, strict=True))
    for p, n in zip(prompts, limits, strict=True):
        for s in range(1, n):  # decode step s feeds token s-1 at position p + s - 1
            q = p + s - 1
            w.keys_needed += sum(layer.needed(q) for layer in layers)
    return w


def padded_work(prompts: Sequence[int], limits: Sequence[int], layers: Sequence[Layer]) -> Work:
    """The padded baseline: B rows × (P + N) slots, all N - 1 decode steps for every row."""
    w = _needed(prompts, limits, layers)
    b, p, n = len(prompts), max(prompts), max(limits)
    w.tokens_computed = b * p + b * (n - 1)
    w.keys_computed = b * (n - 1) * (p + n) * len(layers)
    return w


def pershape_work(prompts: Sequence[int], limits: Sequence[int], layers: Sequence[Layer]) -> Work:
    """The per-shape baseline: exact cache lengths, all rows until the last one is done."""
    w = _needed(prompts, limits, layers)
    b, p, n = len(prompts), max(prompts), max(limits)
    w.tokens_computed = b * p + b * (n - 1)
    w.keys_computed = sum(b * (p + s) for s in range(1, n)) * len(layers)
    return w


def tunix_work(prompts: Sequence[int], limits: Sequence[int], layers: Sequence[Layer], *,
               defaults: bool = False) -> Work:
    """Tunix's Sampler (``jaxrl_sym.baselines.tunix``): prompts left-padded to the next power of
    two of the longest (rollout defaults: at least 64), N = max(limits) decode steps for every
    row (its while_loop stops only when all rows are done; without an EOS it runs N steps, the
    last one's token dropped), each attending over all ``cache_size`` slots (P + N, or 1024)."""
    w = _needed(prompts, limits, layers)
    b, n = len(prompts), max(limits)
    p = 1 << (max(prompts) - 1).bit_length()
    if defaults and p <= 64:
        p = 64
    cache = 1024 if defaults else p + n
    w.tokens_computed = b * p + b * n
    w.keys_computed = b * n * cache * len(layers)
    return w


def sym_work(prompts: Sequence[int], limits: Sequence[int], layers: Sequence[Layer]) -> Work:
    """The symbolic runtime at its defaults: the dispatches its own policy
    (:func:`jaxrl_sym.runtime.policy.replay`) decides for this request, counted; the prefill is
    the runtime's own packing of each group's prompts (:class:`PackedPrompts`), every prompt
    distinct (a length profile has no tokens to share)."""
    w = _needed(prompts, limits, layers)
    groups = microbatches(prompts, limits, max_rows=None,
                          max_pad_fraction=DEFAULT_MAX_PAD_FRACTION)
    for group, (shape, dispatches) in zip(groups, replay(prompts, limits), strict=True):
        packed = PackedPrompts.build([np.full(prompts[i], i, np.int32) for i in group],
                                     shape.prompt_slots, vocab=1, logits_bytes=1 << 62)
        w.tokens_computed += packed.positions_computed
        for d in dispatches:
            w.tokens_computed += d.tile * d.rows
            w.keys_computed += d.tile * d.rows * sum(layer.sym_slots(d.capacity)
                                                     for layer in layers)
    return w


def _geometries() -> dict[str, Callable[..., Work]]:
    """System name → its counting function, every registered variant included."""
    from jaxrl_sym import systems

    base: dict[str, Callable[..., Work]] = {
        "sym": sym_work, "padded": padded_work, "pershape": pershape_work, "tunix": tunix_work,
        "tunix-defaults": partial(tunix_work, defaults=True)}
    out = dict(base)
    for name in base:
        if name in systems.names():
            out.update({f"{name}-{v}": base[name] for v in systems.get(name).variants})
    return out


def work_for(system: str, prompts: Sequence[int], limits: Sequence[int],
             layers: Sequence[Layer]) -> Work:
    """Token positions and attention key slots of ``system`` on one request.

    Why a table here: the registry's ``BoundSystem.work`` counts token positions but not key
    slots, which need each system's store geometry; until it does, this is bench's one
    per-system table (a system missing from it is an InputError naming the ones counted)."""
    from jaxrl_sym.errors import InputError

    geometry = _geometries()
    if system not in geometry:
        raise InputError(f"system {system!r}: no padding count; counted: {', '.join(geometry)}")
    return geometry[system](prompts, limits, layers)
