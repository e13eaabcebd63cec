"""Prism INT2 keys: quantise-and-pack at cache-write time, and the proposal score scan.

Codes: channel c of a key sits at bits 2(c % 16) of word c // 16; per group of g channels an fp16
scale and zero (k ~ zero + scale * code). The write reproduces reference.int2_quantize bit for bit:
scale = (max - min) / 3 with IEEE division (`div_rn`; Triton's `/` is approximate on NVIDIA), both
rounded to the stored dtype, and codes from the *rounded* scale/zero, rounded half to even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import INT2_CODES_PER_WORD
from .common import (
    FLOAT_DTYPES,
    STREAM_STAGES,
    STREAM_WAVES,
    interpreting,
    is_pow2,
    on_kernel_device,
    pow2,
    programs_per_row,
    upcast_dot,
)

INT2_BLOCK_L = 128  # keys per step of the score scan (rows of each per-word MMA)


# ---------------------------------------------------------------------------------- write
@triton.jit
def _int2_write_kernel(
    k_ptr, codes_ptr, scale_ptr, zero_ptr, pos_ptr,
    H, T,
    skb, skh, skt, skd,
    scb, sch, scl, scw,
    ssb, ssh, ssl, ssm,
    szb, szh, szl, szm,
    spt,
    D: tl.constexpr,  # head dim (power of two): one program holds whole keys
    M: tl.constexpr,  # groups per key; D // M channels share a scale and zero
    BLOCK_T: tl.constexpr,  # new tokens per program
):
    GS: tl.constexpr = D // M
    NW: tl.constexpr = D // 16
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < T
    d = tl.arange(0, D)
    x = tl.load(k_ptr + b * skb + h * skh + t[:, None] * skt + d[None, :] * skd, mask=live[:, None], other=0.0)
    xg = tl.reshape(x.to(tl.float32), (BLOCK_T, M, GS))
    lo = tl.min(xg, axis=2)
    hi = tl.max(xg, axis=2)
    s_st = tl.math.div_rn(hi - lo, 3.0).to(scale_ptr.dtype.element_ty)
    z_st = lo.to(zero_ptr.dtype.element_ty)
    s = s_st.to(tl.float32)
    z = z_st.to(tl.float32)
    slot = tl.load(pos_ptr + t * spt, mask=live, other=0).to(tl.int64)
    m = tl.arange(0, M)
    tl.store(scale_ptr + b * ssb + h * ssh + slot[:, None] * ssl + m[None, :] * ssm, s_st, mask=live[:, None])
    tl.store(zero_ptr + b * szb + h * szh + slot[:, None] * szl + m[None, :] * szm, z_st, mask=live[:, None])
    pos_scale = s > 0
    u = tl.math.div_rn(xg - z[:, :, None], tl.where(pos_scale, s, 1.0)[:, :, None])
    # round half to even, as torch.round; clamping to [0, 4] first changes no code in 0..3 and makes
    # u - floor(u) exact
    u = tl.minimum(tl.maximum(u, 0.0), 4.0)
    f = tl.floor(u)
    frac = u - f
    fi = f.to(tl.int32)
    up = (frac > 0.5) | ((frac == 0.5) & ((fi & 1) == 1))
    code = tl.minimum(fi + up.to(tl.int32), 3)
    code = tl.where(pos_scale[:, :, None], code, 0)
    code = tl.reshape(code, (BLOCK_T, NW, 16))
    shifts = 2 * tl.arange(0, 16)
    words = tl.sum(code << shifts[None, None, :], axis=2)  # distinct bit pairs: the sum is the OR
    w = tl.arange(0, NW)
    tl.store(codes_ptr + b * scb + h * sch + slot[:, None] * scl + w[None, :] * scw, words, mask=live[:, None])


def int2_write_supported(codes, scale, zero, k, pos) -> bool:
    if not on_kernel_device(codes, scale, zero, k, pos):
        return False
    if k.dim() != 4 or codes.dim() != 4 or scale.dim() != 4 or zero.dim() != 4 or pos.dim() != 1:
        return False
    D = k.shape[-1]
    M = scale.shape[-1]
    return (
        k.dtype in FLOAT_DTYPES
        and codes.dtype == torch.int32
        and scale.dtype in FLOAT_DTYPES
        and zero.dtype == scale.dtype
        and not pos.is_floating_point()
        and is_pow2(D) and 16 <= D <= 512
        and M > 0 and D % M == 0 and is_pow2(M)
        and codes.shape[-1] * INT2_CODES_PER_WORD == D
        and zero.shape[-1] == M
        and pos.shape[0] == k.shape[2]
        and k.shape[:2] == codes.shape[:2] == scale.shape[:2] == zero.shape[:2]
    )


def int2_write(codes, scale, zero, k, pos, reset: bool = False) -> None:
    """Quantise k [B,H,T,D] and write codes/scale/zero at positions pos [T] (reference.int2_write)."""
    from .signatures import clear_after

    B, H, T, D = k.shape
    M = scale.shape[-1]
    if B * H * T > 0:
        BLOCK_T = min(pow2(T), max(1, 2048 // D))
        grid = (triton.cdiv(T, BLOCK_T), B * H)
        torch.library.wrap_triton(_int2_write_kernel)[grid](
            k, codes, scale, zero, pos,
            H, T,
            *k.stride(), *codes.stride(), *scale.stride(), *zero.stride(), pos.stride(0),
            D=D, M=M, BLOCK_T=BLOCK_T,
        )
    if reset:
        for t in (codes, scale, zero):
            clear_after(t, pos)


# ---------------------------------------------------------------------------------- scores
@triton.jit
def _int2_scores_block(
    q_row, c_row, s_row, z_row, o_row, start, L, sqh, sqd, scl, scw, ssl, ssm, szl, szm, sol,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, M: tl.constexpr, BLOCK_L: tl.constexpr,
    DOT_PRECISION: tl.constexpr, OP_DTYPE: tl.constexpr,
):
    """Scores of BLOCK_L keys: per 16-channel word, one [BLOCK_L, 16] x [16, G_PAD] MMA of the
    codes (exact in the operand dtype) against the queries, summed per scale group."""
    GS: tl.constexpr = D // M
    WPG: tl.constexpr = GS // 16
    g = tl.arange(0, G_PAD)
    gmask = g < G
    shifts = 2 * tl.arange(0, 16)
    c16 = tl.arange(0, 16)
    offs = start + tl.arange(0, BLOCK_L)
    live = offs < L
    o64 = offs.to(tl.int64)
    acc = tl.zeros([BLOCK_L, G_PAD], dtype=tl.float32)
    for m in tl.static_range(M):
        dot = tl.zeros([BLOCK_L, G_PAD], dtype=tl.float32)
        qsum = tl.zeros([G_PAD], dtype=tl.float32)
        for w in tl.static_range(WPG):
            word = tl.load(c_row + o64 * scl + (m * WPG + w) * scw, mask=live, other=0)
            code = (word[:, None] >> shifts[None, :]) & 3  # [BLOCK_L, 16]
            qw = tl.load(q_row + g[None, :] * sqh + (m * GS + w * 16 + c16)[:, None] * sqd, mask=gmask[None, :], other=0.0)
            dot = tl.dot(code.to(OP_DTYPE), qw.to(OP_DTYPE), dot, input_precision=DOT_PRECISION)
            qsum += tl.sum(qw.to(tl.float32), axis=0)
        sc = tl.load(s_row + o64 * ssl + m * ssm, mask=live, other=0.0).to(tl.float32)
        z = tl.load(z_row + o64 * szl + m * szm, mask=live, other=0.0).to(tl.float32)
        acc += sc[:, None] * dot + z[:, None] * qsum[None, :]
    acc = tl.where(gmask[None, :], acc, float("-inf"))
    tl.store(o_row + o64 * sol, tl.max(acc, axis=1), mask=live)


@triton.jit
def _int2_scores_kernel(
    q_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr,
    Hkv, L, PROGS,
    sqb, sqh, sqd,
    scb, sch, scl, scw,
    ssb, ssh, ssl, ssm,
    szb, szh, szl, szm,
    sob, soh, sol,
    G: tl.constexpr,  # query heads per KV head: all scored in one program, so codes are read once
    G_PAD: tl.constexpr,  # G padded to a tl.dot width (>= 16)
    D: tl.constexpr,  # head dim (power of two)
    M: tl.constexpr,  # groups per key: one MMA per group, then scale and zero per key
    BLOCK_L: tl.constexpr,  # keys per loop step (rows of the per-group MMA)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 queries (exact); bf16/fp16 queries and codes 0..3 are exact as is
    OP_DTYPE: tl.constexpr,  # MMA operand dtype: the query's (codes 0..3 are exact in every float dtype)
    USE_FOR: tl.constexpr,  # pipelined `for` on GPU; `while` under the interpreter
):
    pid = tl.program_id(0)
    r = tl.program_id(1)
    b = (r // Hkv).to(tl.int64)
    h = (r % Hkv).to(tl.int64)
    q_row = q_ptr + b * sqb + (h * G) * sqh
    c_row = codes_ptr + b * scb + h * sch
    s_row = scale_ptr + b * ssb + h * ssh
    z_row = zero_ptr + b * szb + h * szh
    o_row = out_ptr + b * sob + h * soh
    if USE_FOR:
        for start in tl.range(pid * BLOCK_L, L, PROGS * BLOCK_L):  # grid-stride
            _int2_scores_block(q_row, c_row, s_row, z_row, o_row, start, L, sqh, sqd, scl, scw, ssl, ssm, szl, szm,
                               sol, G, G_PAD, D, M, BLOCK_L, DOT_PRECISION, OP_DTYPE)
    else:
        start = pid * BLOCK_L
        while start < L:
            _int2_scores_block(q_row, c_row, s_row, z_row, o_row, start, L, sqh, sqd, scl, scw, ssl, ssm, szl, szm,
                               sol, G, G_PAD, D, M, BLOCK_L, DOT_PRECISION, OP_DTYPE)
            start += PROGS * BLOCK_L


_OP_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def int2_scores_supported(q, codes, scale, zero) -> bool:
    if not on_kernel_device(q, codes, scale, zero):
        return False
    if q.dim() != 4 or codes.dim() != 4 or scale.dim() != 4 or zero.dim() != 4:
        return False
    D = q.shape[-1]
    M = scale.shape[-1]
    return (
        q.dtype in FLOAT_DTYPES
        and q.shape[2] == 1
        and codes.dtype == torch.int32
        and scale.dtype in FLOAT_DTYPES
        and zero.dtype in FLOAT_DTYPES
        and is_pow2(D) and 16 <= D <= 512
        and codes.shape[-1] * INT2_CODES_PER_WORD == D
        and M > 0 and D % M == 0 and is_pow2(M) and D // M >= 16
        and zero.shape == scale.shape
        and scale.shape[:3] == codes.shape[:3]
        and q.shape[0] == codes.shape[0]
        and q.shape[1] % codes.shape[1] == 0
    )


def int2_scores(q, codes, scale, zero) -> torch.Tensor:
    """max over the group of <q, dequantised k>: [B,Hkv,L] float32 (reference.int2_scores)."""
    B, Hq, _, D = q.shape
    Hkv, L = codes.shape[1], codes.shape[2]
    M = scale.shape[-1]
    G = Hq // Hkv
    out = torch.empty(B, Hkv, L, dtype=torch.float32, device=codes.device)
    if B * Hkv * L == 0:
        return out
    BLOCK_L = INT2_BLOCK_L
    progs = programs_per_row(B * Hkv, triton.cdiv(L, BLOCK_L), codes.device, waves=STREAM_WAVES)
    torch.library.wrap_triton(_int2_scores_kernel)[(progs, B * Hkv)](
        q, codes, scale, zero, out,
        Hkv, L, progs,
        q.stride(0), q.stride(1), q.stride(3),
        *codes.stride(), *scale.stride(), *zero.stride(), *out.stride(),
        G=G, G_PAD=max(16, pow2(G)), D=D, M=M, BLOCK_L=BLOCK_L,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        OP_DTYPE=_OP_DTYPE[torch.float32 if upcast_dot(q.dtype) else q.dtype],
        USE_FOR=not interpreting(),
        num_warps=4, num_stages=STREAM_STAGES,
    )
    return out
