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

from kernels.common import first_key, last_query, log2_logits, softcap_slope, visible


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
    m0 = pm * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    r_mask = rows < N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV

    qpos = tl.load(pos_ptr + rows, mask=r_mask, other=-1)
    qseg = tl.load(seg_ptr + rows, mask=r_mask, other=-1)
    # Key range: from the pattern's lower bound for the first valid row (monotone in the row)
    # to the last valid row (causal). No valid row: empty range.
    first = tl.min(tl.where(qpos >= 0, rows, N), 0)
    last = tl.max(tl.where(qpos >= 0, rows, -1), 0)
    fpos = tl.load(pos_ptr + first, mask=first < N, other=0)
    lo = first_key(first, fpos, LOOKBACK, PERIOD)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = last + 1

    q = tl.load(
        q_ptr + rows[:, None] * (HQ * D) + h * D + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        c_mask = cols < hi
        kpos = tl.load(pos_ptr + cols, mask=c_mask, other=-1)
        kseg = tl.load(seg_ptr + cols, mask=c_mask, other=-2)
        k = tl.load(
            k_ptr + cols[:, None] * (HKV * D) + hk * D + offs_d[None, :],
            mask=c_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        v = tl.load(
            v_ptr + cols[:, None] * (HKV * DV) + hk * DV + offs_dv[None, :],
            mask=c_mask[:, None] & dv_mask[None, :],
            other=0.0,
        )
        valid = (qseg[:, None] == kseg[None, :]) & visible(qpos[:, None], kpos[None, :],
                                                           LOOKBACK, PERIOD)
        if F32_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="tf32x3")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid, log2_logits(s, QK_SCALE, SCALE, SOFTCAP), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="tf32x3")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(
        o_ptr + rows[:, None] * (HQ * DV) + h * DV + offs_dv[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=r_mask[:, None] & dv_mask[None, :],
    )
    tl.store(lse_ptr + h * N + rows, lse, mask=r_mask)


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
    m0 = pm * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    r_mask = rows < N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV

    qpos = tl.load(pos_ptr + rows, mask=r_mask, other=-1)
    qseg = tl.load(seg_ptr + rows, mask=r_mask, other=-1)
    first = tl.min(tl.where(qpos >= 0, rows, N), 0)
    last = tl.max(tl.where(qpos >= 0, rows, -1), 0)
    fpos = tl.load(pos_ptr + first, mask=first < N, other=0)
    lo = first_key(first, fpos, LOOKBACK, PERIOD)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = last + 1

    q = tl.load(
        q_ptr + rows[:, None] * (HQ * D) + h * D + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    do = tl.load(
        do_ptr + rows[:, None] * (HQ * DV) + h * DV + offs_dv[None, :],
        mask=r_mask[:, None] & dv_mask[None, :],
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + h * N + rows, mask=r_mask, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + h * N + rows, mask=r_mask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        c_mask = cols < hi
        kpos = tl.load(pos_ptr + cols, mask=c_mask, other=-1)
        kseg = tl.load(seg_ptr + cols, mask=c_mask, other=-2)
        k = tl.load(
            k_ptr + cols[:, None] * (HKV * D) + hk * D + offs_d[None, :],
            mask=c_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        v = tl.load(
            v_ptr + cols[:, None] * (HKV * DV) + hk * DV + offs_dv[None, :],
            mask=c_mask[:, None] & dv_mask[None, :],
            other=0.0,
        )
        if F32_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        valid = (qseg[:, None] == kseg[None, :]) & visible(qpos[:, None], kpos[None, :],
                                                           LOOKBACK, PERIOD)
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
            dq += tl.dot(ds, k, input_precision="tf32x3")
        else:
            dq += tl.dot(ds.to(k.dtype), k)
    dq = dq * SCALE
    tl.store(
        dq_ptr + rows[:, None] * (HQ * D) + h * D + offs_d[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


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
    G = HQ // HKV
    n0 = pn * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    c_mask = cols < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV

    kpos = tl.load(pos_ptr + cols, mask=c_mask, other=-1)
    kseg = tl.load(seg_ptr + cols, mask=c_mask, other=-2)
    first = tl.min(tl.where(kpos >= 0, cols, N), 0)
    last = tl.max(tl.where(kpos >= 0, cols, -1), 0)
    has = last >= 0
    lseg = tl.load(seg_ptr + last, mask=has, other=0)
    lpos = tl.load(pos_ptr + last, mask=has, other=0)
    seg_end = tl.load(cu_ptr + lseg + 1, mask=has, other=0)
    q_hi = last_query(seg_end, last, lpos, LOOKBACK, PERIOD)
    q_hi = tl.where(has, q_hi, 0)
    q_lo = (first // BLOCK_M) * BLOCK_M

    k = tl.load(
        k_ptr + cols[:, None] * (HKV * D) + hk * D + offs_d[None, :],
        mask=c_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    v = tl.load(
        v_ptr + cols[:, None] * (HKV * DV) + hk * DV + offs_dv[None, :],
        mask=c_mask[:, None] & dv_mask[None, :],
        other=0.0,
    )
    if F32_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, G):
        h = hk * G + g
        for start in range(q_lo, q_hi, BLOCK_M):
            rows = start + offs_m
            r_mask = rows < q_hi
            qpos = tl.load(pos_ptr + rows, mask=r_mask, other=-1)
            qseg = tl.load(seg_ptr + rows, mask=r_mask, other=-1)
            q = tl.load(
                q_ptr + rows[:, None] * (HQ * D) + h * D + offs_d[None, :],
                mask=r_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            do = tl.load(
                do_ptr + rows[:, None] * (HQ * DV) + h * DV + offs_dv[None, :],
                mask=r_mask[:, None] & dv_mask[None, :],
                other=0.0,
            )
            if F32_DOT:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(lse_ptr + h * N + rows, mask=r_mask, other=float("-inf"))
            lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)
            delta = tl.load(delta_ptr + h * N + rows, mask=r_mask, other=0.0)
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
    dk = dk * SCALE
    tl.store(
        dk_ptr + cols[:, None] * (HKV * D) + hk * D + offs_d[None, :],
        dk.to(dk_ptr.dtype.element_ty),
        mask=c_mask[:, None] & d_mask[None, :],
    )
    tl.store(
        dv_ptr + cols[:, None] * (HKV * DV) + hk * DV + offs_dv[None, :],
        dv.to(dv_ptr.dtype.element_ty),
        mask=c_mask[:, None] & dv_mask[None, :],
    )
