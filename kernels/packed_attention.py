"""Packed variable-length (varlen) flash attention: forward with logsumexp, and backward.

Layout: ``q [N, Hq, D]``, ``k [N, Hkv, D]``, ``v [N, Hkv, Dv]`` hold several sequences end to end;
``cu_seqlens [S+1]`` int32 marks their boundaries. The launcher also passes ``seg [N]`` (sequence
index of each token, or S for tokens past ``cu_seqlens[S]``) and ``pos [N]`` (index within its
sequence, -1 past the end), two int32 device arrays derived from ``cu_seqlens`` by one cheap XLA
op. Masking is then exactly the library's reference: same segment, position >= 0, and the pattern
(causal / window / block) on positions.

WHY a grid over global token blocks rather than (sequence, block-within-sequence): the number of
sequences and their lengths are run-time data; a (S, max_len / BLOCK) grid would be sized by the
worst case of both. ``cdiv(N, BLOCK_M) x Hq`` programs cover the packed buffer exactly once; a block
that straddles a sequence boundary is handled by the segment mask. Each program derives its key
range from the positions of its first and last valid rows (the lower bound of each pattern is
monotone in the token index), so it reads only the keys its rows may see.

WHY no atomics in the backward: ``dk/dv`` are accumulated by one program per (key block, kv head)
that loops over every query head of its group and every query block that can see it, and ``dq``
by one program per (query block, query head) — the FlashAttention-2 split, deterministic.

Softmax runs in base 2: ``QK_SCALE = scale * log2(e)``; the stored logsumexp is natural-log.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.common import (
    first_key,
    last_query,
    load_heads,
    log2_logits,
    online_softmax,
    softcap_slope,
    store_heads,
    visible,
)


@triton.jit
def packed_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    seg_ptr,
    pos_ptr,
    o_ptr,
    lse_ptr,
    N: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    LOOKBACK: tl.constexpr,
    PERIOD: tl.constexpr,
    QK_SCALE: tl.constexpr,
    SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """One (query block, query head) program. Writes ``o [N, HQ, DV]`` and ``lse [HQ, N]``.

    Rows with no valid key (past the end, or an empty segment) get o = 0 and lse = -inf.
    """
    pm = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (HQ // HKV)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < N
    qpos = tl.load(pos_ptr + rows, mask=r_mask, other=-1)
    qseg = tl.load(seg_ptr + rows, mask=r_mask, other=-1)
    lo, hi = _key_range(pos_ptr, rows, qpos, N, LOOKBACK, PERIOD, BLOCK_N)
    q = load_heads(q_ptr, rows, r_mask, h, HQ, D, BLOCK_D)
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kpos, kseg, k, v = _load_keys(k_ptr, v_ptr, seg_ptr, pos_ptr, cols, cols < hi, hk, HKV,
                                      D, DV, BLOCK_D, BLOCK_DV)
        valid = (qseg[:, None] == kseg[None, :]) & visible(qpos[:, None], kpos[None, :],
                                                           LOOKBACK, PERIOD)
        m_i, l_i, acc = online_softmax(q, k, v, valid, m_i, l_i, acc, QK_SCALE, SCALE, SOFTCAP,
                                       F32_DOT)

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    store_heads(o_ptr, out, rows, r_mask, h, HQ, DV, BLOCK_DV)
    tl.store(lse_ptr + h * N + rows, lse, mask=r_mask)


@triton.jit
def _key_range(pos_ptr, rows, qpos, N: tl.constexpr, LOOKBACK: tl.constexpr,
               PERIOD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys ``[lo, hi)`` a query block may see: from the pattern's lower bound for its first
    valid row (monotone in the row), block-aligned, to its last valid row (causal). No valid
    row: an empty range."""
    first = tl.min(tl.where(qpos >= 0, rows, N), 0)
    last = tl.max(tl.where(qpos >= 0, rows, -1), 0)
    fpos = tl.load(pos_ptr + first, mask=first < N, other=0)
    lo = first_key(first, fpos, LOOKBACK, PERIOD)
    lo = (lo // BLOCK_N) * BLOCK_N
    return lo, last + 1


@triton.jit
def _load_keys(k_ptr, v_ptr, seg_ptr, pos_ptr, cols, c_mask, hk, HKV: tl.constexpr,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """A key block of kv head ``hk``: positions (-1 masked), segments (-2 masked, matching no
    query), and the K and V tiles (0 masked)."""
    kpos = tl.load(pos_ptr + cols, mask=c_mask, other=-1)
    kseg = tl.load(seg_ptr + cols, mask=c_mask, other=-2)
    k = load_heads(k_ptr, cols, c_mask, hk, HKV, D, BLOCK_D)
    v = load_heads(v_ptr, cols, c_mask, hk, HKV, DV, BLOCK_DV)
    return kpos, kseg, k, v


@triton.jit
def _load_queries(q_ptr, do_ptr, lse_ptr, delta_ptr, rows, r_mask, h, N: tl.constexpr,
                  HQ: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, F32_DOT: tl.constexpr):
    """A query block of head ``h`` for the backward: q, dO, the logsumexp in log2 units (0 for
    rows without keys, whose p must come out 0 from their -inf scores) and delta."""
    q = load_heads(q_ptr, rows, r_mask, h, HQ, D, BLOCK_D)
    do = load_heads(do_ptr, rows, r_mask, h, HQ, DV, BLOCK_DV)
    if F32_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + h * N + rows, mask=r_mask, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + h * N + rows, mask=r_mask, other=0.0)
    return q, do, lse2, delta


@triton.jit
def packed_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    seg_ptr,
    pos_ptr,
    dq_ptr,
    N: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    LOOKBACK: tl.constexpr,
    PERIOD: tl.constexpr,
    QK_SCALE: tl.constexpr,
    SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """dq for one (query block, query head): dq = scale * sum_j p_ij (dp_ij - delta_i) k_j.

    ``delta [HQ, N]`` = rowsum(o * do) - dlse (the lse cotangent folds into delta).
    """
    pm = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // (HQ // HKV)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < N
    qpos = tl.load(pos_ptr + rows, mask=r_mask, other=-1)
    qseg = tl.load(seg_ptr + rows, mask=r_mask, other=-1)
    lo, hi = _key_range(pos_ptr, rows, qpos, N, LOOKBACK, PERIOD, BLOCK_N)
    q, do, lse2, delta = _load_queries(q_ptr, do_ptr, lse_ptr, delta_ptr, rows, r_mask, h, N,
                                       HQ, D, DV, BLOCK_D, BLOCK_DV, F32_DOT)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        kpos, kseg, k, v = _load_keys(k_ptr, v_ptr, seg_ptr, pos_ptr, cols, cols < hi, hk, HKV,
                                      D, DV, BLOCK_D, BLOCK_DV)
        if F32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        valid = (qseg[:, None] == kseg[None, :]) & visible(qpos[:, None], kpos[None, :],
                                                           LOOKBACK, PERIOD)
        dq += _dq_block(q, do, k, v, valid, lse2, delta, QK_SCALE, SCALE, SOFTCAP, F32_DOT)
    dq = dq * SCALE
    store_heads(dq_ptr, dq, rows, r_mask, h, HQ, D, BLOCK_D)


@triton.jit
def _dq_block(q, do, k, v, valid, lse2, delta, QK_SCALE: tl.constexpr, SCALE: tl.constexpr,
              SOFTCAP: tl.constexpr, F32_DOT: tl.constexpr):
    """One key block's term of dq (before the final scale): ``sum_j p_ij (dp_ij - delta_i)
    slope_ij k_j`` over the block's keys j."""
    if F32_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
        dp = tl.dot(do, tl.trans(v), input_precision="tf32x3")
    else:
        s = tl.dot(q, tl.trans(k))
        dp = tl.dot(do, tl.trans(v))
    slope = softcap_slope(s, SCALE, SOFTCAP)  # d capped / d uncapped logit
    s = tl.where(valid, log2_logits(s, QK_SCALE, SCALE, SOFTCAP), float("-inf"))
    p = tl.exp2(s - lse2[:, None])
    ds = p * (dp - delta[:, None]) * slope
    if F32_DOT:
        return tl.dot(ds, k, input_precision="tf32x3")
    else:
        return tl.dot(ds.to(k.dtype), k)


@triton.jit
def packed_bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    seg_ptr,
    pos_ptr,
    cu_ptr,
    dk_ptr,
    dv_ptr,
    N: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    LOOKBACK: tl.constexpr,
    PERIOD: tl.constexpr,
    QK_SCALE: tl.constexpr,
    SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """dk, dv for one (key block, kv head), summed over the query heads of its group.

    Queries that can see this block lie in [first valid key, end of the last valid key's visible
    range): the segment end (from ``cu_seqlens``), cut by the mask's bounds (``last_query``).
    Every row of dk/dv is written (zeros for keys nobody reads), so no zero-initialisation is
    needed.
    """
    pn = tl.program_id(0)
    hk = tl.program_id(1)
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = cols < N
    kpos, kseg, k, v = _load_keys(k_ptr, v_ptr, seg_ptr, pos_ptr, cols, c_mask, hk, HKV, D, DV,
                                  BLOCK_D, BLOCK_DV)
    q_lo, q_hi = _query_range(seg_ptr, pos_ptr, cu_ptr, cols, kpos, N, LOOKBACK, PERIOD,
                              BLOCK_M)
    if F32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, HQ // HKV):
        h = hk * (HQ // HKV) + g
        for start in range(q_lo, q_hi, BLOCK_M):
            dk, dv = _dkdv_block(q_ptr, do_ptr, lse_ptr, delta_ptr, seg_ptr, pos_ptr, k, v, kpos,
                                 kseg, dk, dv, start, q_hi, h, N, HQ, D, DV, LOOKBACK, PERIOD,
                                 QK_SCALE, SCALE, SOFTCAP, BLOCK_M, BLOCK_D, BLOCK_DV, F32_DOT)
    dk = dk * SCALE
    store_heads(dk_ptr, dk, cols, c_mask, hk, HKV, D, BLOCK_D)
    store_heads(dv_ptr, dv, cols, c_mask, hk, HKV, DV, BLOCK_DV)


@triton.jit
def _query_range(seg_ptr, pos_ptr, cu_ptr, cols, kpos, N: tl.constexpr,
                 LOOKBACK: tl.constexpr, PERIOD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Queries ``[q_lo, q_hi)`` that may see a key block: from its first valid key,
    block-aligned, to the end of its last valid key's visible range; no valid key: empty."""
    first = tl.min(tl.where(kpos >= 0, cols, N), 0)
    last = tl.max(tl.where(kpos >= 0, cols, -1), 0)
    has = last >= 0
    lseg = tl.load(seg_ptr + last, mask=has, other=0)
    lpos = tl.load(pos_ptr + last, mask=has, other=0)
    seg_end = tl.load(cu_ptr + lseg + 1, mask=has, other=0)
    q_hi = last_query(seg_end, last, lpos, LOOKBACK, PERIOD)
    q_hi = tl.where(has, q_hi, 0)
    q_lo = (first // BLOCK_M) * BLOCK_M
    return q_lo, q_hi


@triton.jit
def _dkdv_block(q_ptr, do_ptr, lse_ptr, delta_ptr, seg_ptr, pos_ptr, k, v, kpos, kseg, dk, dv,
                start, q_hi, h, N: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr,
                DV: tl.constexpr, LOOKBACK: tl.constexpr, PERIOD: tl.constexpr,
                QK_SCALE: tl.constexpr, SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                F32_DOT: tl.constexpr):
    """dk, dv advanced by the query block at ``start`` of head ``h``."""
    rows = start + tl.arange(0, BLOCK_M)
    r_mask = rows < q_hi
    qpos = tl.load(pos_ptr + rows, mask=r_mask, other=-1)
    qseg = tl.load(seg_ptr + rows, mask=r_mask, other=-1)
    q, do, lse2, delta = _load_queries(q_ptr, do_ptr, lse_ptr, delta_ptr, rows, r_mask, h, N,
                                       HQ, D, DV, BLOCK_D, BLOCK_DV, F32_DOT)
    valid = (kseg[:, None] == qseg[None, :]) & visible(qpos[None, :], kpos[:, None],
                                                       LOOKBACK, PERIOD)
    # Transposed scores [BLOCK_N, BLOCK_M] so dk/dv accumulate without transposes.
    if F32_DOT:
        st = tl.dot(k, tl.trans(q), input_precision="tf32x3")
        dpt = tl.dot(v, tl.trans(do), input_precision="tf32x3")
    else:
        st = tl.dot(k, tl.trans(q))
        dpt = tl.dot(v, tl.trans(do))
    slope = softcap_slope(st, SCALE, SOFTCAP)
    st = tl.where(valid, log2_logits(st, QK_SCALE, SCALE, SOFTCAP), float("-inf"))
    pt = tl.exp2(st - lse2[None, :])
    dst = pt * (dpt - delta[None, :]) * slope
    if F32_DOT:
        dv += tl.dot(pt, do, input_precision="tf32x3")
        dk += tl.dot(dst, q, input_precision="tf32x3")
    else:
        dv += tl.dot(pt.to(do.dtype), do)
        dk += tl.dot(dst.to(q.dtype), q)
    return dk, dv
