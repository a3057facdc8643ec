"""An attention written independently of the library: Python loops over rows, heads, queries and
keys in float64, its own visibility rule per pattern, no shared masking code. The oracle for
``reference_attention`` and the kernels (and so, transitively, for the padded baseline)."""

from __future__ import annotations

import math

import numpy as np


def _sees(pattern: str, size: int, qp: int, kp: int) -> bool:
    if qp < 0 or kp < 0 or kp > qp:
        return False
    if pattern == "window":
        return qp - kp < size
    if pattern == "block":
        return kp // size == qp // size
    return True


def naive_attention(q, k, v, q_pos, k_pos, q_seg, k_seg, *, pattern: str = "causal",
                    size: int = 0, scale: float, softcap: float = 0.0) -> np.ndarray:
    """q [B,Tq,Hq,D], k [B,Tk,Hkv,D], v [B,Tk,Hkv,Dv]; a query that sees nothing gets 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, tq, hq, _ = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    out = np.zeros((b, tq, hq, dv))
    for r in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(tq):
                logits, vals = [], []
                for j in range(k.shape[1]):
                    if q_seg[r][i] != k_seg[r][j] or not _sees(pattern, size, int(q_pos[r][i]),
                                                               int(k_pos[r][j])):
                        continue
                    s = float(np.dot(q[r, i, h], k[r, j, kh])) * scale
                    if softcap:
                        s = softcap * math.tanh(s / softcap)
                    logits.append(s)
                    vals.append(v[r, j, kh])
                if logits:
                    m = max(logits)
                    w = [math.exp(s - m) for s in logits]
                    out[r, i, h] = sum(wi * vi for wi, vi in zip(w, vals, strict=True)) / sum(w)
    return out
