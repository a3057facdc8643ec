"""What distinguishes GRPO, RLOO and PPO: the advantage estimate, per sample or per token.

Every algorithm runs the same step (generate → reference → reward → advantages → clipped policy
loss + KL → update); only :func:`sample_advantages` (GRPO, RLOO) / :func:`gae` (PPO) and the
optional value term differ. The per-token weights of the loss's weighted sum
(:func:`token_weights`) follow ``AlgorithmConfig.loss_agg``. Numpy only, on the host: the loss
itself is :mod:`jaxrl_sym.rl.algorithms.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl_sym.errors import InputError
from jaxrl_sym.rl.errors import RewardError

__all__ = ["gae", "informative_samples", "sample_advantages", "token_weights", "whiten"]


def sample_advantages(rewards: np.ndarray, group_size: int, algo: str, eps: float,
                      adv_norm: str = "group_std") -> np.ndarray:
    """One advantage per sample from rewards laid out group after group (G consecutive samples of
    the same prompt).

    GRPO: (r - mean_g) / scale, scale = std_g + eps (``group_std``), the batch's std of
    r - mean_g + eps (``batch_std``) or 1 (``none``) — a group where every sample scored the same
    teaches nothing, so it gets 0 rather than a division blow-up. RLOO: r - mean of the *other*
    G-1 samples, an unbiased baseline (it does not use the sample's own reward).
    """
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size % group_size:
        raise InputError(f"{r.size} rewards do not split into groups of {group_size}")
    try:
        with np.errstate(over="raise"):
            adv = _advantages(r.reshape(-1, group_size), group_size, algo, eps, adv_norm)
            out = adv.reshape(-1).astype(np.float32)
    except FloatingPointError:
        out = np.full(r.size, np.inf, np.float32)
    if not np.all(np.isfinite(out)):
        # finite float64 rewards of ±1e308 overflowed the group statistics: the std became inf
        # and every advantage 0, a "successful" step that learned nothing
        i = int(np.argmax(np.abs(r)))
        raise RewardError(
            f"rewards of this batch reach {r[i]:g} (sample {i}): the advantages overflow "
            f"({algo}, adv_norm={adv_norm!r}: squares and float32 must stay finite); scale the "
            "reward function's output into a moderate range (|r| <= 1e6 is plenty). The step "
            "was not applied.", i)
    return out


def _advantages(g: np.ndarray, group_size: int, algo: str, eps: float,
                adv_norm: str) -> np.ndarray:
    """:func:`sample_advantages` on rewards already shaped [groups, group_size] (float64)."""
    mean = g.mean(axis=1, keepdims=True)
    if algo == "grpo":
        centred = g - mean
        std = g.std(axis=1, keepdims=True)
        # Tied by value, not by std > 0: three equal rewards of 0.047 have a float64 std of
        # 6.9e-18, which gave every sample an advantage of -7e-12 whose sign flipped the clip
        # diagnostics (found by tests/test_oracle_rl_loss.py).
        varies = g.max(axis=1, keepdims=True) > g.min(axis=1, keepdims=True)
        if adv_norm == "group_std":
            with np.errstate(invalid="ignore", divide="ignore"):
                adv = np.where(varies, centred / (std + eps), 0.0)
        elif adv_norm == "batch_std":
            adv = np.where(varies, centred / (centred.std() + eps), 0.0)
        else:
            adv = np.where(varies, centred, 0.0)
    elif algo == "rloo":
        adv = g - (g.sum(axis=1, keepdims=True) - g) / (group_size - 1)
    else:
        raise InputError(f"sample_advantages: algo {algo!r} has no per-sample advantage")
    return adv


def informative_samples(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Per sample: does its group's reward vary? (All-equal groups carry no preference.)"""
    g = np.asarray(rewards, np.float64).reshape(-1, group_size)
    varies = g.max(axis=1) > g.min(axis=1)
    return np.repeat(varies, group_size)


def gae(
    rewards: Sequence[np.ndarray], values: Sequence[np.ndarray], gamma: float, lam: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Generalised advantage estimation per sequence (terminal after the last token: V = 0).

    rewards[i], values[i]: per response token of sequence i (values are the critic's estimate at
    the slot that predicts the token). Returns (advantages, returns = advantages + values).
    """
    advs, rets = [], []
    for r, v in zip(rewards, values, strict=True):
        n = len(r)
        a = np.zeros(n, np.float64)
        last = 0.0
        for t in range(n - 1, -1, -1):
            nxt = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * nxt - v[t]
            last = delta + gamma * lam * last
            a[t] = last
        advs.append(a.astype(np.float32))
        rets.append((a + np.asarray(v, np.float64)).astype(np.float32))
    return advs, rets


def whiten(per_seq: Sequence[np.ndarray], eps: float = 1e-8) -> list[np.ndarray]:
    """Zero-mean unit-std over all tokens of the batch (PPO's usual advantage normalisation)."""
    flat = np.concatenate([np.asarray(a, np.float64) for a in per_seq])
    mu, sd = flat.mean(), flat.std()
    return [((np.asarray(a) - mu) / (sd + eps)).astype(np.float32) for a in per_seq]


def token_weights(lengths: Sequence[int], loss_agg: str, max_new_tokens: int = 1,
                  keep: Sequence[bool] | None = None) -> list[np.ndarray]:
    """Per-token weights of the loss's weighted sum, zero on samples not kept.

    ``token_mean`` / ``seq_mean`` weights sum to 1 over the kept samples; ``token_sum`` weighs
    every token ``1 / (kept sequences x max_new_tokens)`` (Dr. GRPO's constant normaliser: a
    longer response adds terms instead of diluting each one). Nothing kept: all zero.
    """
    keep_l = [True] * len(lengths) if keep is None else [bool(k) for k in keep]
    if len(keep_l) != len(lengths):
        raise InputError(f"token_weights: {len(keep_l)} keep flags for {len(lengths)} samples")
    n = sum(keep_l)
    total = float(sum(k for k, on in zip(lengths, keep_l, strict=True) if on))
    out = []
    for k, on in zip(lengths, keep_l, strict=True):
        if not on:
            w = 0.0
        elif loss_agg == "token_mean":
            w = 1.0 / total
        elif loss_agg == "seq_mean":
            w = 1.0 / (n * k)
        else:
            w = 1.0 / (n * max_new_tokens)
        out.append(np.full(k, w, np.float32))
    return out
