"""Split-K (flash-decoding) attention for one query token per row over a slot store.

Store contract (fixed by the runtime): ``q [B, Hq, D]``; ``k_store [B, Hkv, C, D]``,
``v_store [B, Hkv, C, Dv]`` (C = capacity; heads-major, so one program's slots are contiguous);
``kv_pos [B, C]`` int32 (-1 = empty slot); ``q_pos [B]`` int32; ``n_live [B]`` int32 = number of
leading slots that may hold data. Slots at or beyond ``n_live`` are never read. Masking is by
*position*, never by slot index, so the same kernel serves an append-only causal store, a ring
buffer for a window (C = w slots written in arbitrary order) and a block store.

WHY split-K: a decode step has one query per (row, head), so a kernel that gives each
(row, kv head) one program leaves most of an H100's 132 SMs idle at small batch while each program
streams the whole cache. Splitting the live slots of each row into ``NUM_SPLITS`` chunks gives one
program per (row, kv head, chunk); each writes a partial softmax state (running max ``m``,
normaliser ``l``, unnormalised output ``acc``), and :func:`decode_reduce_kernel` combines them. The
chunk length is computed *in the kernel* from ``n_live`` (a device array), so all splits work on
the live prefix whatever the capacity: the grid is static, the work distribution is not.

WHY a head group per program: with grouped-query attention the ``Hq // Hkv`` query heads sharing
a kv head read the same keys; loading K/V once per group divides the memory traffic (the whole
cost of decode) by the group size. The group is padded to ``BLOCK_H >= 16`` rows so the scores
are a ``tl.dot`` (tensor cores need M >= 16); padded rows are masked.

WHY the combine in the last program (``COMBINE``): at batch 1 the whole
step is a few microseconds of bytes, so a second launch for the combine (plus its wait for the
whole split grid) is a large share of it. Each split program stores its partial state, then takes
a ticket from a per-(row, kv head) counter (an atomic, zeroed before the launch); the program
that draws the last ticket has seen every other split's release and combines the group's
partials itself. One launch per decode step at any split count.

WHY ``LIVE_LOADS``: with positions loaded first and K/V loads predicated on visibility, every
K/V load waits for its position load, a dependent round trip to memory per block. When every
live slot is (or is an empty slot that would be) visible — a causal store, or a ring no longer
than its window — the loads are predicated on the live range only and issue at once; the scores
are still masked by position, and values of invisible slots are zeroed after the load, so empty
slots holding garbage (even NaN) cannot leak. For a window over a long append-only store the
predicated loads stay: they skip the bytes outside the window.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.common import online_softmax, visible


@triton.jit
def decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    kvpos_ptr,
    qpos_ptr,
    nlive_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    o_ptr,
    ticket_ptr,
    CAP: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    LOOKBACK: tl.constexpr,
    PERIOD: tl.constexpr,
    QK_SCALE: tl.constexpr,
    SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    F32_DOT: tl.constexpr,
    LIVE_LOADS: tl.constexpr,
    COMBINE: tl.constexpr,
):
    """One (row b, kv head, split) program: partial softmax over a chunk of the live slots.

    Outputs (fp32): ``m [B, HQ, NUM_SPLITS]`` running max in log2 units, ``l`` its normaliser,
    ``acc [B, HQ, NUM_SPLITS, DV]`` the unnormalised weighted values. When ``NUM_SPLITS == 1``
    no combine follows: ``acc`` is then ``[B, HQ, 1, DV]`` in the output dtype and holds the
    normalised result.

    ``COMBINE`` (``NUM_SPLITS > 1``): :func:`decode_reduce_kernel`'s work in this launch. Each
    program, having stored its partial state, draws a ticket from the counter of its (row, kv
    head) (``ticket_ptr [B * HKV]`` int32, zero at launch); the program with the last ticket
    combines the group's ``HQ // HKV`` query heads into ``o [B, HQ, DV]``. Ordering: the barrier
    makes all of this program's partial stores happen before its ticket (acquire-release, GPU
    scope); the last ticket's acquire then orders every other split's stores before its loads,
    which go to L2 (``.cg``), not to a possibly stale L1. Without ``COMBINE``, ``o`` and
    ``ticket`` are unused placeholders.
    """
    _split_program(q_ptr, k_ptr, v_ptr, kvpos_ptr, qpos_ptr, nlive_ptr, m_ptr, l_ptr, acc_ptr,
                   CAP, HQ, HKV, D, DV, NUM_SPLITS, LOOKBACK, PERIOD, QK_SCALE, SCALE, SOFTCAP,
                   BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_DV, F32_DOT, LIVE_LOADS)
    if COMBINE:
        b = tl.program_id(0)
        hk = tl.program_id(1)
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + b * HKV + hk, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:
            for g in tl.static_range(HQ // HKV):
                _combine_row(m_ptr, l_ptr, acc_ptr, o_ptr,
                             b.to(tl.int64) * HQ + hk * (HQ // HKV) + g, DV, NUM_SPLITS,
                             BLOCK_DV)


@triton.jit
def _split_program(q_ptr, k_ptr, v_ptr, kvpos_ptr, qpos_ptr, nlive_ptr, m_ptr, l_ptr, acc_ptr,
                   CAP: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   DV: tl.constexpr, NUM_SPLITS: tl.constexpr, LOOKBACK: tl.constexpr,
                   PERIOD: tl.constexpr, QK_SCALE: tl.constexpr, SCALE: tl.constexpr,
                   SOFTCAP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, F32_DOT: tl.constexpr,
                   LIVE_LOADS: tl.constexpr):
    """The (row, kv head, split) program's partial state over its chunk, stored (see
    :func:`_store_split`)."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    G = HQ // HKV
    b64 = b.to(tl.int64)
    lo, hi = _split_range(nlive_ptr, b, sp, CAP, NUM_SPLITS, BLOCK_N)
    qpos = tl.load(qpos_ptr + b)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < G
    heads = hk * G + offs_h
    q = _load_query_group(q_ptr, b64, heads, h_mask, HQ, D, BLOCK_D, F32_DOT)
    m_i, l_i, acc = _attend_chunk(
        q, k_ptr + (b64 * HKV + hk) * (CAP * D), v_ptr + (b64 * HKV + hk) * (CAP * DV),
        kvpos_ptr + b64 * CAP, qpos, lo, hi, D, DV, LOOKBACK, PERIOD, QK_SCALE, SCALE,
        SOFTCAP, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_DV, F32_DOT, LIVE_LOADS)
    _store_split(m_ptr, l_ptr, acc_ptr, m_i, l_i, acc, b64 * HQ + heads, h_mask, sp, DV,
                 NUM_SPLITS, BLOCK_DV)


@triton.jit
def _split_range(nlive_ptr, b, sp, CAP: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Slots ``[lo, hi)``: the chunk of row b's live prefix owned by split ``sp``, rounded to
    whole blocks (empty for the splits past the live prefix)."""
    n_live = tl.minimum(tl.load(nlive_ptr + b), CAP)
    chunk = tl.cdiv(tl.cdiv(n_live, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, n_live)
    return lo, hi


@triton.jit
def _load_query_group(q_ptr, b64, heads, h_mask, HQ: tl.constexpr, D: tl.constexpr,
                      BLOCK_D: tl.constexpr, F32_DOT: tl.constexpr):
    """Row b's query heads ``heads`` (one kv head's group, padded to BLOCK_H rows) as a
    ``[BLOCK_H, BLOCK_D]`` tile; padded rows read 0."""
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + b64 * (HQ * D) + heads[:, None] * D + offs_d[None, :],
        mask=h_mask[:, None] & (offs_d < D)[None, :],
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)
    return q


@triton.jit
def _attend_chunk(q, k_base, v_base, kvpos_row, qpos, lo, hi, D: tl.constexpr,
                  DV: tl.constexpr, LOOKBACK: tl.constexpr,
                  PERIOD: tl.constexpr, QK_SCALE: tl.constexpr, SCALE: tl.constexpr,
                  SOFTCAP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, F32_DOT: tl.constexpr,
                  LIVE_LOADS: tl.constexpr):
    """The partial softmax state ``(m, l, acc)`` of the query group over slots ``[lo, hi)`` of
    one row and kv head (``k_base`` / ``v_base`` / ``kvpos_row``: that row's and head's start);
    K/V loads predicated on the live range (``LIVE_LOADS``) or on visibility (module docstring)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + offs_n
        kpos = tl.load(kvpos_row + n, mask=n < hi, other=-1)
        valid = visible(qpos, kpos, LOOKBACK, PERIOD)
        if LIVE_LOADS:  # noqa: SIM108 (a constexpr branch: one side is compiled)
            fetch = n < hi  # issued without waiting for kpos; the scores are masked below
        else:
            # Masked-off slots (empty, outside the window/block) are not fetched: a predicated-
            # off load moves no bytes, so a window over a long append-only store reads ~w slots.
            fetch = valid
        k = tl.load(
            k_base + n[:, None] * D + offs_d[None, :],
            mask=fetch[:, None] & (offs_d < D)[None, :],
            other=0.0,
        )
        v = tl.load(
            v_base + n[:, None] * DV + offs_dv[None, :],
            mask=fetch[:, None] & (offs_dv < DV)[None, :],
            other=0.0,
        )
        if LIVE_LOADS:
            v = tl.where(valid[:, None], v, 0.0)  # an empty slot's garbage (NaN) times p = 0
        m_i, l_i, acc = online_softmax(q, k, v, valid[None, :], m_i, l_i, acc, QK_SCALE, SCALE,
                                       SOFTCAP, F32_DOT)
    return m_i, l_i, acc


@triton.jit
def _store_split(m_ptr, l_ptr, acc_ptr, m_i, l_i, acc, row, h_mask, sp, DV: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Write one split's state for the (row, query head) indices ``row``: normalised output
    when it is the only split, else ``m``, ``l`` and ``acc`` for the reduce kernel."""
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    if NUM_SPLITS == 1:
        # No valid key (empty query, nothing live) leaves l = 0 and acc = 0: output 0.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            acc_ptr + row[:, None] * DV + offs_dv[None, :],
            out.to(acc_ptr.dtype.element_ty),
            mask=h_mask[:, None] & dv_mask[None, :],
        )
    else:
        part = row * NUM_SPLITS + sp
        tl.store(m_ptr + part, m_i, mask=h_mask)
        tl.store(l_ptr + part, l_i, mask=h_mask)
        tl.store(
            acc_ptr + part[:, None] * DV + offs_dv[None, :],
            acc,
            mask=h_mask[:, None] & dv_mask[None, :],
        )


@triton.jit
def decode_reduce_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    o_ptr,
    HQ: tl.constexpr,
    DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Combine the ``NUM_SPLITS`` partial states of one (row, query head) into the output.

    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s; splits that saw no
    valid key carry m = -inf, l = 0, acc = 0 and drop out; if every split is empty, out = 0.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    _combine_row(m_ptr, l_ptr, acc_ptr, o_ptr, b.to(tl.int64) * HQ + h, DV, NUM_SPLITS,
                 BLOCK_DV)


@triton.jit
def _combine_row(m_ptr, l_ptr, acc_ptr, o_ptr, row, DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
    """The output of (row, query head) index ``row`` from its ``NUM_SPLITS`` partial states
    (:func:`decode_reduce_kernel`'s formula); the loads bypass L1 (written by other programs)."""
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    m = tl.load(m_ptr + row * NUM_SPLITS + offs_s, cache_modifier=".cg")
    l_s = tl.load(l_ptr + row * NUM_SPLITS + offs_s, cache_modifier=".cg")
    acc = tl.load(
        acc_ptr + (row * NUM_SPLITS + offs_s)[:, None] * DV + offs_dv[None, :],
        mask=dv_mask[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_safe)
    denom = tl.sum(w * l_s, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(o_ptr + row * DV + offs_dv, out.to(o_ptr.dtype.element_ty), mask=dv_mask)
