"""Kernelised causal linear attention with phi(x) = elu(x) + 1: recurrent decode and chunked packed.

A_t = phi(q_t)^T S_t / phi(q_t)^T z_t,  S_t = sum_{s<=t} phi(k_s) v_s^T,  z_t = sum_{s<=t} phi(k_s).

WHY a recurrent state for decode: the consumer of the keys is a sum, so one step costs
O(D * Dv) per head whatever the sequence length; the runtime keeps ``S [B, Hkv, D, Dv]`` and
``z [B, Hkv, D]`` instead of a key store.

WHY chunks for the packed (prefill / scoring) form: a token-by-token scan is a long serial chain of
tiny updates; the chunked form does a ``BLOCK_T``-token chunk with three matmuls (intra-chunk
causal part ``(phi(Q) phi(K)^T masked) V``, inter-chunk part ``phi(Q) S``, state update
``S += phi(K)^T V``), so the serial chain is ``len / BLOCK_T`` steps of tensor-core work.

phi is evaluated in fp32 and every ``tl.dot`` here takes fp32 operands at ``tf32x3`` precision
(~fp32 accuracy on tensor cores): the normaliser is a long sum of positive terms, and plain TF32
(10-bit mantissa) would not meet a 1e-4 tolerance.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def linear_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    s_ptr,
    z_ptr,
    o_ptr,
    s_out_ptr,
    z_out_ptr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One (row, kv head, Dv tile) program: S += phi(k) v^T, z += phi(k), then the group's outputs.

    ``s_out`` may alias ``s`` (in-place update of the state): each program reads and writes only its
    own Dv tile of S. ``z_out`` must *not* alias ``z``: every Dv tile reads all of z, and only the
    first tile writes z_out.
    """
    b = tl.program_id(0)
    hk = tl.program_id(1)
    pv = tl.program_id(2)
    G: tl.constexpr = HQ // HKV
    bh = b.to(tl.int64) * HKV + hk
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = pv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    v_mask = offs_v < DV
    sd_mask = d_mask[:, None] & v_mask[None, :]

    k = tl.load(k_ptr + bh * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    phik = tl.where(d_mask, tl.where(k > 0.0, k + 1.0, tl.exp(tl.minimum(k, 0.0))), 0.0)
    v = tl.load(v_ptr + bh * DV + offs_v, mask=v_mask, other=0.0).to(tl.float32)
    s_off = (bh * D + offs_d[:, None]) * DV + offs_v[None, :]
    s = tl.load(s_ptr + s_off, mask=sd_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + bh * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    s = s + phik[:, None] * v[None, :]
    z = z + phik
    tl.store(s_out_ptr + s_off, s.to(s_out_ptr.dtype.element_ty), mask=sd_mask)
    tl.store(z_out_ptr + bh * D + offs_d, z.to(z_out_ptr.dtype.element_ty), mask=d_mask & (pv == 0))

    for g in tl.static_range(G):
        row = b.to(tl.int64) * HQ + hk * G + g
        q = tl.load(q_ptr + row * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        phiq = tl.where(d_mask, tl.where(q > 0.0, q + 1.0, tl.exp(tl.minimum(q, 0.0))), 0.0)
        num = tl.sum(phiq[:, None] * s, 0)
        den = tl.sum(phiq * z, 0)
        out = tl.where(den > 0.0, num / tl.where(den > 0.0, den, 1.0), 0.0)
        tl.store(o_ptr + row * DV + offs_v, out.to(o_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def linear_packed_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cu_ptr,
    o_ptr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """One (sequence, query head, Dv tile) program: chunked causal linear attention.

    Grid (S, HQ, cdiv(DV, BLOCK_DV)) with S = len(cu_seqlens) - 1 (static); the sequence bounds
    are loaded from ``cu_seqlens``. Tiling Dv keeps the fp32 state tile ``[D, BLOCK_DV]`` within
    shared memory at D = 128; each tile recomputes the (cheap) intra-chunk scores and normaliser.
    Tokens past ``cu_seqlens[S]`` are not written: the launcher zero-fills ``o``.
    """
    sq = tl.program_id(0)
    h = tl.program_id(1)
    pv = tl.program_id(2)
    hk = h // (HQ // HKV)
    start = tl.load(cu_ptr + sq)
    end = tl.load(cu_ptr + sq + 1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = pv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    v_mask = offs_v < DV
    causal = offs_t[:, None] >= offs_t[None, :]

    state = tl.zeros([BLOCK_D, BLOCK_DV], tl.float32)
    z = tl.zeros([BLOCK_D], tl.float32)
    for c0 in range(start, end, BLOCK_T):
        t = c0 + offs_t
        t_mask = t < end
        td_mask = t_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptr + t[:, None] * (HQ * D) + h * D + offs_d[None, :], mask=td_mask,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t[:, None] * (HKV * D) + hk * D + offs_d[None, :], mask=td_mask,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t[:, None] * (HKV * DV) + hk * DV + offs_v[None, :],
                    mask=t_mask[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
        phiq = tl.where(td_mask, tl.where(q > 0.0, q + 1.0, tl.exp(tl.minimum(q, 0.0))), 0.0)
        phik = tl.where(td_mask, tl.where(k > 0.0, k + 1.0, tl.exp(tl.minimum(k, 0.0))), 0.0)
        a = tl.dot(phiq, tl.trans(phik), input_precision="tf32x3")
        a = tl.where(causal, a, 0.0)
        num = tl.dot(phiq, state, input_precision="tf32x3") + tl.dot(a, v, input_precision="tf32x3")
        den = tl.sum(phiq * z[None, :], 1) + tl.sum(a, 1)
        out = tl.where(den[:, None] > 0.0, num / tl.where(den > 0.0, den, 1.0)[:, None], 0.0)
        tl.store(
            o_ptr + t[:, None] * (HQ * DV) + h * DV + offs_v[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=t_mask[:, None] & v_mask[None, :],
        )
        state += tl.dot(tl.trans(phik), v, input_precision="tf32x3")
        z += tl.sum(phik, 0)
