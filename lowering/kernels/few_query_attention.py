"""Dense attention of a few queries (a verify step's gamma + 1): split-K flash-decoding over the cache.

SDPA's kernels split the keys across programs for one query only: at 128K x batch 4 (8B shape, H100)
cuDNN takes 0.69 ms a layer for one query and 2.66 ms for five, one program walking all 128K keys
per (batch, head) (`bench/results/verify-attention-*.json`). Here a program owns one KV head and a
slice of the cache: it loads all G*T query rows of the head ([ROWS_PAD, D], row g*T + t for query
head h*G + g and query t), walks its slice BLOCK_N contiguous keys at a time, each K/V tile read
once for all of them, and runs an online softmax per row with the row's own mask; the splits'
partials are merged by `common.combine_splits`. A row with nothing readable gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    combine_splits, dot, FLOAT_DTYPES, interpreting, is_pow2, MAX_SPLITS, MaskView, on_kernel_device, pdl,
    online_softmax, pdl_enter, pow2, row_of, softmax_start, split_keys, split_partials, store_partials,
    upcast_dot,
)

# padded G * T rows x head dim (twice that for fp32 queries): the query and output tiles a program
# holds in registers; past it they spill (compile_check: 64 rows of fp32 128-dim heads do)
MAX_QUERY_TILE = 16384
# Launch defaults, module constants so a bench can --set them (bench/verify_attention.py --tune).
# 8 waves: at 128K x batch 4, five queries, a program walking 14.5K keys (2 waves) reached 65% of the
# read bandwidth (1.05 ms a layer), one walking 4K (8 waves) 97% (0.705 ms); at batch 1, 2 waves were
# 3% faster (0.185 against 0.192 ms) (bench/results/verify-attention-2026-12-07-h100-tune.json)
TILE_BYTES = 16384  # bytes of a K tile a step: 64 keys of a bf16 128-dim head (3 stages of K and V: 96 KiB)
STAGES = 3
WARPS = 4
WAVES = 8  # programs per SM the split count aims for


@triton.jit
def _few_query_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr,
    sm_scale, Hkv, L_UNITS, SPLIT_BLOCKS, NSPLIT,
    sqb, sqh, sqt, sqd,
    skb, skh, skl, skd,
    svb, svh, svl, svd,
    smb, smh, smt, sml,
    sob, soh, sot, sod,
    G: tl.constexpr,  # query heads per KV head
    T: tl.constexpr,  # queries
    ROWS_PAD: tl.constexpr,  # G * T padded to a power of two >= 16 (a tl.dot width); padded rows never stored
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_BOOL: tl.constexpr,  # bool mask: False -> -inf; else additive float
    MASK_HEADS: tl.constexpr,  # mask heads per KV head: G (per-head mask) or 1 (broadcast, stride 0)
    SPLIT: tl.constexpr,  # several programs per KV head: write partials for the combine kernel
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_FOR: tl.constexpr,  # `for` loop (pipelined on GPU); a `while` under the interpreter
    ALIGN: tl.constexpr,  # the cache length and the mask's batch / head / query strides are multiples of it
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # Multiples of ALIGN by construction, so the compiler vectorises the mask's loads even where the
    # launch sees a symbolic cache length (one graph for every length: no integer to specialise on)
    L, smb, smh, smt = L_UNITS * ALIGN, smb * ALIGN, smh * ALIGN, smt * ALIGN
    SPLIT_LEN = SPLIT_BLOCKS * BLOCK_N
    r, sp = tl.program_id(0), tl.program_id(1)
    b, h = row_of(r, Hkv)
    rows = tl.arange(0, ROWS_PAD)
    live = rows < G * T
    g, t = rows // T, rows % T
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    q = tl.load(q_ptr + b * sqb + (h * G + g)[:, None] * sqh + t[:, None] * sqt + d[None, :] * sqd,
                mask=live[:, None], other=0.0)
    k_row = k_ptr + b * skb + h * skh
    v_row = v_ptr + b * svb + h * svh
    if MASK_HEADS == 1:
        mask_rows = mask_ptr + b * smb + h * smh + t * smt  # smh is 0: one mask head for all
    else:
        mask_rows = mask_ptr + b * smb + (h * MASK_HEADS + g) * smh + t * smt
    sm_scale, m_i, l_i = softmax_start(sm_scale, ROWS_PAD)
    acc = tl.zeros([ROWS_PAD, DV], tl.float32)
    lo = sp * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, L)
    if USE_FOR:
        for start in tl.range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _tile(q, k_row, v_row, mask_rows, start, hi, m_i, l_i, acc, sm_scale, live,
                                  skl, skd, svl, svd, sml, D, DV, BLOCK_N, HAS_MASK, MASK_BOOL, DOT_PRECISION, UPCAST)
    else:
        start = lo
        while start < hi:
            m_i, l_i, acc = _tile(q, k_row, v_row, mask_rows, start, hi, m_i, l_i, acc, sm_scale, live,
                                  skl, skd, svl, svd, sml, D, DV, BLOCK_N, HAS_MASK, MASK_BOOL, DOT_PRECISION, UPCAST)
            start += BLOCK_N
    if SPLIT:
        store_partials(pm_ptr, pl_ptr, pacc_ptr, (r * NSPLIT + sp) * ROWS_PAD, rows, live, m_i, l_i, acc, DV)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * sob + (h * G + g)[:, None] * soh + t[:, None] * sot + dv[None, :] * sod,
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _tile(q, k_row, v_row, mask_rows, start, hi, m_i, l_i, acc, sm_scale, live,
          skl, skd, svl, svd, sml,
          D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
          DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    offs = start + tl.arange(0, BLOCK_N)
    inside = offs < hi
    pos = offs.to(tl.int64)
    kt = tl.load(k_row + pos[:, None] * skl + tl.arange(0, D)[None, :] * skd, mask=inside[:, None], other=0.0)
    vt = tl.load(v_row + pos[:, None] * svl + tl.arange(0, DV)[None, :] * svd, mask=inside[:, None], other=0.0)
    s = dot(q, tl.trans(kt), DOT_PRECISION, UPCAST) * sm_scale  # [ROWS_PAD, BLOCK_N] fp32
    ok = live[:, None] & inside[None, :]
    if HAS_MASK:
        if MASK_BOOL:
            mv = tl.load(mask_rows[:, None] + pos[None, :] * sml, mask=ok, other=0)
            ok = ok & (mv != 0)
        else:
            s = s + tl.load(mask_rows[:, None] + pos[None, :] * sml, mask=ok, other=0.0).to(tl.float32)
    s = tl.where(ok, s, float("-inf"))
    return online_softmax(s, vt, m_i, l_i, acc, DOT_PRECISION, UPCAST)


def few_query_attention_supported(q, k, v, scale=None, mask=None) -> bool:
    if not on_kernel_device(q, k, v, mask):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return False
    D, DV = q.shape[-1], v.shape[-1]
    return (
        q.dtype in FLOAT_DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and k.shape[-1] == D
        and is_pow2(D) and 16 <= D <= 256
        and is_pow2(DV) and 16 <= DV <= 256
        and max(16, pow2(q.shape[1] // k.shape[1] * q.shape[2])) * max(D, DV) * (2 if q.element_size() == 4 else 1)
        <= MAX_QUERY_TILE
        and (mask is None or mask.dtype == torch.bool or mask.dtype in FLOAT_DTYPES)
    )


def few_query_attention(q, k, v, scale=None, mask=None, *, block_n=None, warps=None, stages=None, waves=None,
                        max_splits=MAX_SPLITS) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v per KV head for q [B, Hq, T, D]: [B, Hq, T, DV] in q's dtype.


    block_n / warps / stages / waves / max_splits are tuning knobs (unset: the module constants)."""
    B, Hq, T, D = q.shape
    Hkv, L, DV = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    R = B * Hkv
    if B * Hq * T == 0 or L == 0:
        return torch.zeros(B, Hq, T, DV, dtype=q.dtype, device=q.device)
    out = torch.empty(B, Hq, T, DV, dtype=q.dtype, device=q.device)
    sm_scale = D**-0.5 if scale is None else float(scale)
    fp32 = q.element_size() == 4  # half the keys a tile and 8 warps, or the tiles spill (compile_check)
    block = block_n or max(16, TILE_BYTES // (max(D, DV) * q.element_size() * (2 if fp32 else 1)))
    rows_pad = max(16, pow2(G * T))
    splits, split_len = split_keys(L, block, R, waves or WAVES, max_splits, q.device)
    pm, pl, pacc = split_partials(R, splits, rows_pad, out)
    ma = MaskView(mask, Hkv, q)
    # a guard, not a number, on a symbolic length: one graph for aligned lengths (what generate() allocates)
    align = 16 if all(x % 16 == 0 for x in (L, ma.sb, ma.sh, ma.st)) else 1
    torch.library.wrap_triton(_few_query_kernel)[(R, splits)](
        q, k, v, ma.tensor, out, pm, pl, pacc,
        sm_scale, Hkv, L // align, split_len // block, splits,
        *q.stride(), *k.stride(), *v.stride(),
        ma.sb // align, ma.sh // align, ma.st // align, ma.sl,
        *out.stride(),
        G=G, T=T, ROWS_PAD=rows_pad, D=D, DV=DV, BLOCK_N=block,
        HAS_MASK=ma.present, MASK_BOOL=ma.is_bool, MASK_HEADS=ma.heads,
        SPLIT=splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=upcast_dot(q.dtype),
        USE_FOR=not interpreting(), ALIGN=align,
        num_warps=warps or (8 if fp32 else WARPS), num_stages=stages or STAGES,
        **pdl(q.device),
    )
    if splits > 1:
        combine_splits(pm, pl, pacc, out, G, rows_pad, splits)
    return out
