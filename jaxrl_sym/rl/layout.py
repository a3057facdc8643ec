"""Where each response token's numbers live in a training batch: packed (symbolic) or padded.

Both layouts put prompt+response of each sample into a [rows, L] token array and describe each
sample's response by a *span* ``(row, first, n)``: slots ``first .. first+n-1`` are the slots whose
logits predict the n response tokens (slot of the token minus one, so ``first = start + len(prompt)
- 1`` ≥ start because prompts are non-empty). Per-token quantities (old / reference log-probs,
advantages, weights) are scattered to those slots, so :func:`jaxrl_sym.rl.algorithms.rl_loss` sees
the same numbers in either layout and only the forward differs:

* ``sym``: sequences bin-packed into rows by :class:`~jaxrl_sym.runtime.engine.PackedBatch`
  (positions restart per sequence, segment ids keep them apart), forward through
  ``SymbolicLM.forward_fn``. The row count is rounded up to a fine geometric bucket (16 steps
  per octave, < 1/16 empty rows) instead of the next power of two, which would waste up to half
  the slots; bucketing at all keeps the number of compiled update programs small across steps.
* ``padded``: one row per sample, width ``max prompt + max response`` (what a padded RL library
  allocates), right-padded and masked, forward through ``padded_forward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.names import SYSTEMS  # noqa: F401 - re-exported
from jaxrl_sym.runtime.engine import PackedBatch, length_bucket

"""The built-in systems' names (the CLI's choices). Which layout a system uses is the system's
own choice (:mod:`jaxrl_sym.rl.systems`), so nothing here dispatches on these names."""


@dataclass(frozen=True)
class Layout:
    """A training batch in one system's layout.

    inputs: ``(tokens, positions, segment_ids)`` for ``sym``; ``(tokens, lengths)`` for ``padded``.
    targets: [rows, L] the token each slot predicts (only meaningful on response spans).
    spans: per sample ``(row, first, n)`` as described in the module docstring.
    useful_tokens: prompt + response tokens actually needed (the rest of the rows is padding).
    """

    system: str
    inputs: tuple[np.ndarray, ...]
    targets: np.ndarray
    spans: tuple[tuple[int, int, int], ...]
    useful_tokens: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.targets.shape  # type: ignore[return-value]

    @property
    def padding_fraction(self) -> float:
        """Share of slots in the [rows, L] batch that hold no real token."""
        return 1.0 - self.useful_tokens / float(self.targets.size)

    def mask(self) -> np.ndarray:
        m = np.zeros(self.shape, bool)
        for r, s, n in self.spans:
            m[r, s:s + n] = True
        return m

    def scatter(self, per_sample: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
        """[rows, L] float32: per-token arrays (or one scalar per sample, broadcast over its
        response) written to each sample's span; zeros elsewhere."""
        out = np.zeros(self.shape, np.float32)
        for i, (r, s, n) in enumerate(self.spans):
            out[r, s:s + n] = per_sample[i]
        return out

    def gather(self, per_slot: np.ndarray) -> list[np.ndarray]:
        """Per-sample arrays (response length each) read from a [rows, L] array."""
        a = np.asarray(per_slot)
        return [a[r, s:s + n].copy() for r, s, n in self.spans]


def _check(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]) -> None:
    if len(prompts) != len(responses):
        raise InputError(f"{len(prompts)} prompts but {len(responses)} responses; pair them 1:1")
    if not prompts:
        raise InputError("no samples: a training batch needs at least one prompt/response pair")
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if len(p) == 0:
            raise InputError(f"sample {i} has an empty prompt; every prompt needs a token")
        if len(r) == 0:
            raise InputError(f"sample {i} has an empty response; generation always emits >= 1 "
                             "token, so this batch was not produced by generate()")


def packed_layout(
    prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray], *,
    row_len: int | None = None,
) -> Layout:
    """Bin-pack prompt+response sequences (exact lengths) into rows of ``row_len`` slots."""
    _check(prompts, responses)
    seqs = [np.concatenate([p, r]).astype(np.int32)
            for p, r in zip(prompts, responses, strict=True)]
    longest = max(len(s) for s in seqs)
    if row_len is None:
        row_len = length_bucket(max(longest, 64))
    elif row_len < longest:
        raise InputError(f"pack_row_len={row_len} is shorter than the longest sequence "
                         f"({longest} tokens); raise it or leave it None")
    pb = PackedBatch.build(seqs, row_len=row_len)
    used = 1 + max(r for r, _, _ in pb.where)
    rows = length_bucket(used, per_octave=16, minimum=1)
    pb = PackedBatch(pb.tokens[:rows], pb.positions[:rows], pb.segment_ids[:rows], pb.where)
    targets = np.zeros_like(pb.tokens)
    spans = []
    for (r, s, n), p, resp in zip(pb.where, prompts, responses, strict=True):
        targets[r, s:s + n - 1] = pb.tokens[r, s + 1:s + n]
        spans.append((r, s + len(p) - 1, len(resp)))
    return Layout("sym", (pb.tokens, pb.positions, pb.segment_ids), targets, tuple(spans),
                  sum(len(s) for s in seqs))


def padded_layout(prompts: Sequence[np.ndarray], responses: Sequence[np.ndarray]) -> Layout:
    """One right-padded row per sample, ``max(prompt) + max(response)`` wide, masked by length."""
    _check(prompts, responses)
    pmax = max(len(p) for p in prompts)
    rmax = max(len(r) for r in responses)
    tokens = np.zeros((len(prompts), pmax + rmax), np.int32)
    lengths = np.zeros(len(prompts), np.int32)
    targets = np.zeros_like(tokens)
    spans = []
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(p) + len(r)
        tokens[i, :n] = np.concatenate([p, r])
        lengths[i] = n
        targets[i, :n - 1] = tokens[i, 1:n]
        spans.append((i, len(p) - 1, len(r)))
    return Layout("padded", (tokens, lengths), targets, tuple(spans), int(lengths.sum()))

