"""Attention mass per candidate (Prism refined layers over a pool; the oracle over all L slots).

Two kernels over grid (splits, B*Hkv). The first gathers candidate K rows (each read once per KV
head for all G query heads), writes the [G, N] logits to a float32 scratch and per split the
running (max, sumexp) of every query head. The second merges those statistics into each head's
softmax normaliser and writes sum over the group of exp(logit - max) / sumexp. Re-reading the
scratch (4G bytes per candidate) is cheaper than re-reading K (2D bytes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (
    FLOAT_DTYPES, MAX_SPLITS, dot, group_queries, interpreting, is_pow2, mask_readable, MaskView, num_sms,
    on_kernel_device, pdl, pdl_enter, pow2, row_of, softmax_start, upcast_dot,
)


MASS_WAVES = 4  # programs per SM the logits stage's split count aims for
# candidates a step of the logits stage at head dims <= 128 (half beyond): twice 64's bytes in flight
# a program; kernel_step's best (bench/results/kernel-tuning-2026-12-04-mass-logits.json)
MASS_BLOCK_N = 128
MASS_WARPS = 4
MASS_STAGES = 3  # the pipelined loop's stages (Triton's default on sm_90)


@triton.jit
def _mass_tile(
    q, k_row, pos_row, mask_row, mask_ptr_b, h, scr_row, start, N, L, m_i, l_i, sm_scale, min_half,
    skl, skd, spn, smh, sml, N_SCR, g, gm,
    D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_POS: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    offs = start + tl.arange(0, BLOCK_N)
    inb = offs < N
    if HAS_POS:
        cand = tl.load(pos_row + offs * spn, mask=inb, other=-1).to(tl.int64)
        live = inb & (cand >= 0)
    else:
        cand = offs.to(tl.int64)
        live = inb
    readable = live
    if HAS_MASK:
        readable = mask_readable(mask_ptr_b, 0, h, cand, live, 0, smh, sml, min_half, MASK_HEADS, MASK_BOOL)
    d = tl.arange(0, D)
    # rows no query head may read are never fetched (the oracle over a mostly unwritten cache skips them)
    kt = tl.load(k_row + cand[:, None] * skl + d[None, :] * skd, mask=readable[:, None], other=0.0)
    s = dot(q, tl.trans(kt), DOT_PRECISION, UPCAST) * sm_scale  # [G_PAD, BLOCK_N]
    if HAS_MASK:
        if not MASK_BOOL:
            mv = tl.load(mask_row + g[:, None] * smh + cand[None, :] * sml, mask=gm[:, None] & live[None, :], other=0.0)
            s = s + mv.to(tl.float32)
        elif MASK_HEADS > 1:  # a head may not read what another head of its group reads
            mv = tl.load(mask_row + g[:, None] * smh + cand[None, :] * sml, mask=gm[:, None] & live[None, :], other=0)
            s = tl.where(mv != 0, s, float("-inf"))
    s = tl.where(readable[None, :], s, float("-inf"))
    tl.store(scr_row + g[:, None] * N_SCR + offs[None, :], s, mask=gm[:, None] & inb[None, :])
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
    return m_new, l_i


@triton.jit
def _mass_logits_kernel(
    q_ptr, k_ptr, pos_ptr, mask_ptr, scr_ptr, pm_ptr, pl_ptr,
    sm_scale, min_half, Hkv, N, L, SPLIT_LEN, NSPLIT,
    sqb, sqh, sqd,
    skb, skh, skl, skd,
    spb, sph, spn,
    smb, smh, sml,
    G: tl.constexpr,  # query heads per KV head: each candidate K row is read once for all of them
    G_PAD: tl.constexpr,  # tl.dot width (>= 16)
    D: tl.constexpr,  # head dim (power of two)
    BLOCK_N: tl.constexpr,  # candidates per step
    HAS_POS: tl.constexpr,  # candidates are positions[b, h, :] (gathered rows) instead of slots 0..N-1
    HAS_MASK: tl.constexpr,  # no mask: every candidate row is readable, no mask loads
    MASK_BOOL: tl.constexpr,  # bool masks gate readability (per head if it has heads); float masks are added per head
    MASK_HEADS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" keeps fp32 inputs exact
    UPCAST: tl.constexpr,  # interpreter only: bf16 dot operands go through fp32
    USE_FOR: tl.constexpr,  # pipelined `for` on GPU, `while` under the interpreter
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    sp, r = tl.program_id(0), tl.program_id(1)
    b, h = row_of(r, Hkv)
    k_row = k_ptr + b * skb + h * skh
    pos_row = pos_ptr + b * spb + h * sph
    mask_ptr_b = mask_ptr + b * smb
    mask_row = mask_ptr_b + (h * MASK_HEADS) * smh
    scr_row = scr_ptr + r.to(tl.int64) * G * N
    g = tl.arange(0, G_PAD)
    gm = g < G
    q = group_queries(q_ptr, b, h, sqb, sqh, sqd, G, G_PAD, D)
    sm_scale, m_i, l_i = softmax_start(sm_scale, G_PAD)
    lo = sp * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, N)
    if USE_FOR:
        for start in tl.range(lo, hi, BLOCK_N):
            m_i, l_i = _mass_tile(
                q, k_row, pos_row, mask_row, mask_ptr_b, h, scr_row, start, hi, L, m_i, l_i, sm_scale, min_half,
                skl, skd, spn, smh, sml, N, g, gm,
                D, BLOCK_N, HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, DOT_PRECISION, UPCAST,
            )
    else:
        start = lo
        while start < hi:
            m_i, l_i = _mass_tile(
                q, k_row, pos_row, mask_row, mask_ptr_b, h, scr_row, start, hi, L, m_i, l_i, sm_scale, min_half,
                skl, skd, spn, smh, sml, N, g, gm,
                D, BLOCK_N, HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, DOT_PRECISION, UPCAST,
            )
            start += BLOCK_N
    base = (r * NSPLIT + sp) * G_PAD
    tl.store(pm_ptr + base + g, m_i)
    tl.store(pl_ptr + base + g, l_i)


@triton.jit
def row_stats(pm_ptr, pl_ptr, r, NSPLIT, G: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """Row r's softmax max and 1 / sumexp per query head, merged over its splits' (max, sumexp)."""
    s = tl.arange(0, S_PAD)
    g = tl.arange(0, G_PAD)
    part = (r * NSPLIT + s)[:, None] * G_PAD + g[None, :]
    live = (s < NSPLIT)[:, None] & (g < G)[None, :]
    ms = tl.load(pm_ptr + part, mask=live, other=float("-inf"))
    ls = tl.load(pl_ptr + part, mask=live, other=0.0)
    top = tl.max(ms, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a head with nothing readable: all weights 0
    total = tl.sum(ls * tl.exp(ms - top[None, :]), axis=0)
    return top, 1.0 / tl.maximum(total, 1e-30)


@triton.jit
def group_mass(scr_row, offs, ok, N, top, inv, G: tl.constexpr, G_PAD: tl.constexpr):
    """Sum over the group's query heads of softmax weights at candidates offs, from the logits scratch
    row [G, N] and row_stats. One head at a time, in head order: [len(offs)] vectors only (a
    [G_PAD, len] tile would hold G_PAD / G times the registers), and every kernel that ranks a
    mass (the normalise kernel, the selections' key passes) adds the same terms in the same order."""
    g = tl.arange(0, G_PAD)
    acc = tl.zeros(offs.shape, tl.float32)
    for j in tl.static_range(G):
        t = tl.sum(tl.where(g == j, top, 0.0), axis=0)
        w = tl.sum(tl.where(g == j, inv, 0.0), axis=0)
        lg = tl.load(scr_row + j * N + offs, mask=ok, other=float("-inf"))
        acc += tl.exp(lg - t) * w
    return acc


@triton.jit
def _mass_normalise_kernel(
    scr_ptr, pm_ptr, pl_ptr, out_ptr,
    Hkv, N, SPLIT_LEN, NSPLIT,
    sob, soh, son,
    G: tl.constexpr, G_PAD: tl.constexpr,
    S_PAD: tl.constexpr,  # splits padded to a power of two: a row's statistics fit in registers
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    sp = tl.program_id(0)
    r = tl.program_id(1)
    b, h = row_of(r, Hkv)
    top, inv = row_stats(pm_ptr, pl_ptr, r, NSPLIT, G, G_PAD, S_PAD)
    scr_row = scr_ptr + r.to(tl.int64) * G * N
    start = sp * SPLIT_LEN
    hi = tl.minimum(start + SPLIT_LEN, N)
    while start < hi:
        offs = start + tl.arange(0, BLOCK_N)
        inb = offs < hi
        tl.store(out_ptr + b * sob + h * soh + offs * son, group_mass(scr_row, offs, inb, N, top, inv, G, G_PAD), mask=inb)
        start += BLOCK_N


def mass_scores_supported(q, k, scale=None, mask=None, positions=None) -> bool:
    if not on_kernel_device(q, k, mask, positions):
        return False
    if q.dim() != 4 or k.dim() != 4:
        return False
    D = q.shape[-1]
    return (
        q.dtype in FLOAT_DTYPES
        and k.dtype == q.dtype
        and q.shape[2] == 1
        and k.shape[-1] == D
        and is_pow2(D) and 16 <= D <= 256
        and q.shape[1] % k.shape[1] == 0
        and (mask is None or mask.dtype == torch.bool or mask.dtype in FLOAT_DTYPES)
        and (
            positions is None
            or (positions.dim() == 3 and positions.shape[:2] == k.shape[:2] and not positions.is_floating_point()
                and positions.dtype != torch.bool)
        )
    )


class Logits(NamedTuple):
    """What the first stage of mass_scores leaves: each candidate's logits per query head in a
    float32 scratch [R, G, N] and, per split of a row, every head's running (max, sumexp)."""

    scratch: torch.Tensor
    pm: torch.Tensor
    pl: torch.Tensor
    splits: int
    split_len: int
    G: int
    G_PAD: int


def mass_logits(q, k, scale=None, mask=None, positions=None) -> Logits:
    """The logits stage over every slot, or the candidates `positions` [B,Hkv,N] (R*N > 0)."""
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    R = B * Hkv
    N = L if positions is None else positions.shape[-1]
    G_PAD = max(16, pow2(G))
    sm_scale = D**-0.5 if scale is None else float(scale)
    BLOCK_N = MASS_BLOCK_N if D <= 128 else MASS_BLOCK_N // 2
    blocks = triton.cdiv(N, BLOCK_N)
    splits = max(1, min(MAX_SPLITS, blocks, triton.cdiv(MASS_WAVES * num_sms(q.device), R)))
    split_len = triton.cdiv(blocks, splits) * BLOCK_N
    splits = triton.cdiv(N, split_len)
    scratch = torch.empty(R * G * N, dtype=torch.float32, device=q.device)
    pm = torch.empty(R * splits * G_PAD, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    ma = MaskView(mask, Hkv, k)
    pos = positions if positions is not None else pm  # unused without positions
    sp = positions.stride() if positions is not None else (0, 0, 0)
    torch.library.wrap_triton(_mass_logits_kernel)[(splits, R)](
        q, k, pos, ma.tensor, scratch, pm, pl,
        sm_scale, ma.min_half, Hkv, N, L, split_len, splits,
        q.stride(0), q.stride(1), q.stride(3),
        *k.stride(), *sp,
        ma.sb, ma.sh, ma.sl,
        G=G, G_PAD=G_PAD, D=D, BLOCK_N=BLOCK_N,
        HAS_POS=positions is not None, HAS_MASK=ma.present, MASK_BOOL=ma.is_bool, MASK_HEADS=ma.heads,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=upcast_dot(q.dtype),
        USE_FOR=not interpreting(),
        num_warps=MASS_WARPS, num_stages=MASS_STAGES,
        **pdl(q.device),
    )
    return Logits(scratch, pm, pl, splits, split_len, G, G_PAD)


def mass_scores(q, k, scale=None, mask=None, positions=None) -> torch.Tensor:
    """Sum over each KV head's query heads of the softmax weight of every candidate: [B,Hkv,N] fp32."""
    B, Hkv = q.shape[0], k.shape[1]
    N = k.shape[2] if positions is None else positions.shape[-1]
    out = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
    if B * Hkv * N == 0:
        return out
    lg = mass_logits(q, k, scale, mask, positions)
    torch.library.wrap_triton(_mass_normalise_kernel)[(lg.splits, B * Hkv)](
        lg.scratch, lg.pm, lg.pl, out,
        Hkv, N, lg.split_len, lg.splits,
        *out.stride(),
        G=lg.G, G_PAD=lg.G_PAD, S_PAD=pow2(lg.splits), BLOCK_N=256,
        num_warps=4,
        **pdl(q.device),
    )
    return out
