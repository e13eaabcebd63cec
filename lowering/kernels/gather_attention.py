"""Sparse decode attention: split-K flash-decoding over per-KV-head index lists (page size 1).

Grid (B*Hkv, splits): a program loads the G queries of one KV head, walks its slice of the index
list BLOCK_N entries at a time, gathers those K rows (each selected row is read once per KV head,
for all G query heads), computes [G, BLOCK_N] logits, runs an online softmax and accumulates the
gathered V rows. With one split the program normalises and writes the output itself; otherwise a
small combine kernel merges the partial (max, sumexp, acc) of the splits. Entries of -1 are
skipped, mask values are gathered at each selected position per query head, and a head with
nothing readable gets zeros (as the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    combine_splits, split_keys, split_partials, FLOAT_DTYPES, MAX_SPLITS, dot, group_queries, interpreting, is_pow2, MaskView, on_kernel_device, pdl,
    online_softmax, pdl_enter, pow2, row_of, softmax_start, store_partials, upcast_dot,
)


# Launch defaults, module constants so a bench can --set them: few, large tiles a program, as each
# tile's gathers cost a memory latency that little else hides at few rows.
# kernel_tuning's best at every shape of 32K-128K x batch 1-16 (bench/results/kernel-tuning-2026-12-05-attention.json)
TILE_BYTES = 32768  # bytes of a K tile a step: 128 rows of a bf16 128-dim head, 64 of a 256-dim one
MAX_ROWS, FP32_MAX_ROWS = 128, 64  # fp32 operands at 128 rows spill on sm_90 (tests/ops/test_op_compile.py)
ATTN_WAVES = 2  # programs per SM the split count aims for
ATTN_WARPS = 4


@triton.jit
def _attn_tile(
    q, k_row, v_row, idx_row, mask_row, start, end, m_i, l_i, acc, sm_scale,
    skl, skd, svl, svd, sik, smh, sml, g, gm,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    offs = start + tl.arange(0, BLOCK_N)
    idx = tl.load(idx_row + offs * sik, mask=offs < end, other=-1).to(tl.int64)
    valid = idx >= 0
    d = tl.arange(0, D)
    kt = tl.load(k_row + idx[:, None] * skl + d[None, :] * skd, mask=valid[:, None], other=0.0)
    # V's gather is issued beside K's, before the logits need K: one memory latency a tile, not two
    # (at few rows a program walks 1-4 tiles, so nothing else hides the second).
    dv = tl.arange(0, DV)
    vt = tl.load(v_row + idx[:, None] * svl + dv[None, :] * svd, mask=valid[:, None], other=0.0)
    s = dot(q, tl.trans(kt), DOT_PRECISION, UPCAST) * sm_scale  # [G_PAD, BLOCK_N] fp32
    s = tl.where(valid[None, :], s, float("-inf"))
    if HAS_MASK:
        if MASK_HEADS == 1:  # one mask row for all G heads: one load per selected position
            mv = tl.load(mask_row + idx * sml, mask=valid, other=1 if MASK_BOOL else 0.0)[None, :]
        else:
            mv = tl.load(mask_row + g[:, None] * smh + idx[None, :] * sml, mask=gm[:, None] & valid[None, :],
                         other=1 if MASK_BOOL else 0.0)
        if MASK_BOOL:
            s = tl.where(mv != 0, s, float("-inf"))
        else:
            s = s + mv.to(tl.float32)
    return online_softmax(s, vt, m_i, l_i, acc, DOT_PRECISION, UPCAST)


@triton.jit
def _sparse_attn_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, mask_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr,
    sm_scale, Hkv, NIDX, SPLIT_LEN, NSPLIT,
    sqb, sqh, sqd,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    sib, sih, sik,
    smb, smh, sml,
    sob, soh, sod,
    G: tl.constexpr,  # query heads per KV head: one program serves all of them, so K/V rows are read once
    G_PAD: tl.constexpr,  # G padded to a tl.dot width (>= 16); padded rows are never stored
    D: tl.constexpr,  # head dims (powers of two): whole rows in registers, unrolled dots
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,  # selected rows gathered per step
    HAS_MASK: tl.constexpr,  # no mask: no mask loads compiled in
    MASK_BOOL: tl.constexpr,  # bool mask: False -> -inf; else additive float
    MASK_HEADS: tl.constexpr,  # mask heads per KV head: G (per-head mask) or 1 (broadcast, stride 0)
    SPLIT: tl.constexpr,  # several programs per row: write partials for the combine kernel
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 inputs exact (tf32 would cost ~1e-3)
    UPCAST: tl.constexpr,  # interpreter only: bf16 dot operands go through fp32
    USE_FOR: tl.constexpr,  # `for` loop (pipelined on GPU); a `while` under the interpreter
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    r, sp = tl.program_id(0), tl.program_id(1)
    b, h = row_of(r, Hkv)
    g = tl.arange(0, G_PAD)
    gm = g < G
    q = group_queries(q_ptr, b, h, sqb, sqh, sqd, G, G_PAD, D)
    k_row = k_ptr + b * skb + h * skh
    v_row = v_ptr + b * svb + h * svh
    idx_row = idx_ptr + b * sib + h * sih
    mask_row = mask_ptr + b * smb + (h * MASK_HEADS) * smh
    sm_scale, m_i, l_i = softmax_start(sm_scale, G_PAD)
    acc = tl.zeros([G_PAD, DV], tl.float32)
    lo = sp * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, NIDX)
    if USE_FOR:
        for start in tl.range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attn_tile(
                q, k_row, v_row, idx_row, mask_row, start, hi, m_i, l_i, acc, sm_scale,
                skl, skd, svl, svd, sik, smh, sml, g, gm,
                D, DV, BLOCK_N, HAS_MASK, MASK_BOOL, MASK_HEADS, DOT_PRECISION, UPCAST,
            )
    else:
        start = lo
        while start < hi:
            m_i, l_i, acc = _attn_tile(
                q, k_row, v_row, idx_row, mask_row, start, hi, m_i, l_i, acc, sm_scale,
                skl, skd, svl, svd, sik, smh, sml, g, gm,
                D, DV, BLOCK_N, HAS_MASK, MASK_BOOL, MASK_HEADS, DOT_PRECISION, UPCAST,
            )
            start += BLOCK_N
    dv = tl.arange(0, DV)
    if SPLIT:  # the G real heads' partials (padded rows are never read)
        store_partials(pm_ptr, pl_ptr, pacc_ptr, (r * NSPLIT + sp) * G_PAD, g, gm, m_i, l_i, acc, DV)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + b * sob + (h * G + g)[:, None] * soh + dv[None, :] * sod,
            out.to(out_ptr.dtype.element_ty), mask=gm[:, None],
        )


def sparse_decode_attention_supported(q, k, v, indices, scale=None, mask=None) -> bool:
    if not on_kernel_device(q, k, v, indices, mask):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or indices.dim() != 3:
        return False
    D, DV = q.shape[-1], v.shape[-1]
    return (
        q.dtype in FLOAT_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[2] == 1
        and k.shape[-1] == D
        and is_pow2(D) and 16 <= D <= 256
        and is_pow2(DV) and 16 <= DV <= 256
        and not indices.is_floating_point()
        and indices.dtype != torch.bool
        and q.shape[1] % k.shape[1] == 0
        and (mask is None or mask.dtype == torch.bool or mask.dtype in FLOAT_DTYPES)
    )


def sparse_decode_attention(q, k, v, indices, scale=None, mask=None, *, block_n=None, warps=None, stages=None,
                            waves=None, max_splits=MAX_SPLITS) -> torch.Tensor:
    """softmax(q k[idx]^T * scale + mask[idx]) v[idx] per KV head: [B,Hq,1,Dv] in q's dtype.

    block_n / warps / stages / waves (programs per SM the split count aims for) / max_splits are
    tuning knobs; unset, they take the module constants above (bench/kernel_tuning.py's choice)."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    DV = v.shape[-1]
    G = Hq // Hkv
    R = B * Hkv
    NIDX = indices.shape[-1]
    if B * Hq == 0 or NIDX == 0:
        return torch.zeros(B, Hq, 1, DV, dtype=q.dtype, device=q.device)
    out = torch.empty(B, Hq, 1, DV, dtype=q.dtype, device=q.device)
    sm_scale = D**-0.5 if scale is None else float(scale)
    rows = FP32_MAX_ROWS if q.element_size() >= 4 else MAX_ROWS
    BLOCK_N = block_n or min(rows, max(16, TILE_BYTES // (max(D, DV) * q.element_size())))
    stages = stages or (2 if BLOCK_N >= 64 else 3)
    waves = waves or ATTN_WAVES
    warps = warps or ATTN_WARPS
    G_PAD = max(16, pow2(G))
    splits, split_len = split_keys(NIDX, BLOCK_N, R, waves, max_splits, q.device)
    pm, pl, pacc = split_partials(R, splits, G_PAD, out)
    ma = MaskView(mask, Hkv, indices)
    torch.library.wrap_triton(_sparse_attn_kernel)[(R, splits)](
        q, k, v, indices, ma.tensor, out, pm, pl, pacc,
        sm_scale, Hkv, NIDX, split_len, splits,
        q.stride(0), q.stride(1), q.stride(3),
        *k.stride(), *v.stride(), *indices.stride(),
        ma.sb, ma.sh, ma.sl,
        out.stride(0), out.stride(1), out.stride(3),
        G=G, G_PAD=G_PAD, D=D, DV=DV, BLOCK_N=BLOCK_N,
        HAS_MASK=ma.present, MASK_BOOL=ma.is_bool, MASK_HEADS=ma.heads,
        SPLIT=splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=upcast_dot(q.dtype),
        USE_FOR=not interpreting(),
        num_warps=warps, num_stages=stages,
        **pdl(q.device),
    )
    if splits > 1:
        combine_splits(pm, pl, pacc, out, G, G_PAD, splits)
    return out
