"""HashAttention signatures: sign-bit packing, the signature-cache write and the Hamming scan.

A signature word holds 32 sign bits: bit j of word w is set iff x[..., 32w + j] > 0. Scores are
32W - Hamming(q, k) summed over the G query heads of a KV head; every key word is read once per KV
head and scored against all G query words in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..reference import WORD_BITS, hamming_dtype
from .common import (
    FLOAT_DTYPES, STREAM_STAGES, STREAM_WAVES, count, counts_total, counts_zero, interpreting, on_kernel_device, pdl,
    pdl_enter, pow2, programs_per_row, row_chunk, row_of, slots_eligible,
)


# ------------------------------------------------------------------------------ packing
@triton.jit
def _pack_kernel(
    x_ptr, out_ptr, pos_ptr,
    H, T, W,
    sxb, sxh, sxt, sxd,
    sob, soh, sot, sow,
    spt,
    HAS_POS: tl.constexpr,  # scatter row t to out[..., pos[t], :] (signature_write) instead of out[..., t, :]
    BLOCK: tl.constexpr,  # (token, word) items per program; each item loads 32 logits
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)  # int64 row offsets: caches can exceed 2**31 elements
    h = (bh % H).to(tl.int64)
    items = pid * BLOCK + tl.arange(0, BLOCK)
    live = items < T * W
    t = items // W
    w = items % W
    j = tl.arange(0, 32)
    x = tl.load(
        x_ptr + b * sxb + h * sxh + t[:, None] * sxt + (w[:, None] * 32 + j[None, :]) * sxd,
        mask=live[:, None], other=0.0,
    )
    bits = (x > 0).to(tl.int32) << j[None, :]
    # distinct bits never carry, so the sum is the OR (and cheap: a generic tl.reduce crawls in the
    # interpreter); bit 31 lands in the sign bit, int32 two's complement as the reference
    word = tl.sum(bits, axis=1)
    if HAS_POS:
        row = tl.load(pos_ptr + t * spt, mask=live, other=0).to(tl.int64)
    else:
        row = t.to(tl.int64)
    tl.store(out_ptr + b * sob + h * soh + row * sot + w * sow, word, mask=live)


def _pack_block(items: int) -> int:
    return min(128, pow2(items))


def pack_signs_supported(x: torch.Tensor) -> bool:
    return on_kernel_device(x) and x.dtype in FLOAT_DTYPES and x.dim() >= 1 and x.shape[-1] % WORD_BITS == 0


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """[..., 32W] float -> [..., W] int32 (reference.pack_signs)."""
    *lead, bits = x.shape
    W = bits // WORD_BITS
    out = torch.empty(*lead, W, dtype=torch.int32, device=x.device)
    x2 = x.reshape(-1, bits)
    R = x2.shape[0]
    if R == 0 or W == 0:
        return out
    o2 = out.view(R, W)
    BLOCK = _pack_block(R * W)
    grid = (triton.cdiv(R * W, BLOCK), 1)
    torch.library.wrap_triton(_pack_kernel)[grid](
        x2, o2, x2,  # pos_ptr unused
        1, R, W,
        0, 0, x2.stride(0), x2.stride(1),
        0, 0, o2.stride(0), o2.stride(1),
        0,
        HAS_POS=False, BLOCK=BLOCK,
        **pdl(x.device),
    )
    return out


def signature_write_supported(cache: torch.Tensor, logits: torch.Tensor, pos: torch.Tensor) -> bool:
    return (
        on_kernel_device(cache, logits, pos)
        and cache.dtype == torch.int32
        and cache.dim() == 4
        and logits.dim() == 4
        and logits.dtype in FLOAT_DTYPES
        and logits.shape[:2] == cache.shape[:2]
        and logits.shape[3] == cache.shape[3] * WORD_BITS
        and pos.dim() == 1
        and pos.shape[0] == logits.shape[2]
        and not pos.is_floating_point()
    )


def signature_write(cache: torch.Tensor, logits: torch.Tensor, pos: torch.Tensor) -> None:
    """cache[:, :, pos] = pack_signs(logits) in one fused kernel."""
    B, H, T, _ = logits.shape
    W = cache.shape[3]
    if B * H * T * W > 0:
        BLOCK = _pack_block(T * W)
        grid = (triton.cdiv(T * W, BLOCK), B * H)
        torch.library.wrap_triton(_pack_kernel)[grid](
            logits, cache, pos,
            H, T, W,
            *logits.stride(),
            *cache.stride(),
            pos.stride(0),
            HAS_POS=True, BLOCK=BLOCK,
            **pdl(cache.device),
        )


# ------------------------------------------------------------------------------ Hamming
@triton.jit
def _byte_sum(x):
    """Sum of the four byte fields of x (each < 256) as an int32."""
    y = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)
    return (y & 0xFFFF) + (y >> 16)


@triton.jit
def _hamming_block(q_row, k_row, o_row, start, L, sqh, sqw, skl, skw, sol,
                   G: tl.constexpr, W: tl.constexpr, BLOCK_L: tl.constexpr):
    offs = start + tl.arange(0, BLOCK_L)
    live = offs < L
    dist = tl.zeros([BLOCK_L], dtype=tl.int32)
    acc = tl.zeros([BLOCK_L], dtype=tl.int32)  # four byte-wide partial popcounts (each <= 8 per term)
    for w in tl.static_range(W):
        kw = tl.load(k_row + offs.to(tl.int64) * skl + w * skw, mask=live, other=0)
        for g in tl.static_range(G):
            qw = tl.load(q_row + g * sqh + w * sqw)
            x = kw ^ qw
            # SWAR popcount up to byte fields; arithmetic shifts are harmless: the masks drop the
            # sign-extended bits, so it is exact on int32 (interpreter and GPU alike).
            x = x - ((x >> 1) & 0x55555555)
            x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
            x = (x + (x >> 4)) & 0x0F0F0F0F
            acc += x
            if (w * G + g) % 31 == 30:  # byte fields hold <= 31 terms of <= 8: flush before overflow
                dist += _byte_sum(acc)
                acc = tl.zeros([BLOCK_L], dtype=tl.int32)
    dist += _byte_sum(acc)
    tl.store(o_row + offs * sol, (G * W * 32 - dist).to(o_row.dtype.element_ty), mask=live)


@triton.jit
def _hamming_kernel(
    q_ptr, k_ptr, out_ptr,
    Hkv, L, PROGS,
    sqb, sqh, sqw,
    skb, skh, skl, skw,
    sob, soh, sol,
    G: tl.constexpr,  # query heads per KV head: all G query words are scored against each key word in registers
    W: tl.constexpr,  # words per signature: unrolled
    BLOCK_L: tl.constexpr,  # keys per loop step (4 B each per word)
    USE_FOR: tl.constexpr,  # pipelined `for` on GPU; `while` under the interpreter (its `range` breaks on numpy >= 2.4)
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    r = tl.program_id(1)
    b, h = row_of(r, Hkv)
    k_row = k_ptr + b * skb + h * skh
    o_row = out_ptr + b * sob + h * soh
    q_row = q_ptr + b * sqb + (h * G) * sqh
    if USE_FOR:
        for start in tl.range(pid * BLOCK_L, L, PROGS * BLOCK_L):  # grid-stride
            _hamming_block(q_row, k_row, o_row, start, L, sqh, sqw, skl, skw, sol, G, W, BLOCK_L)
    else:
        start = pid * BLOCK_L
        while start < L:
            _hamming_block(q_row, k_row, o_row, start, L, sqh, sqw, skl, skw, sol, G, W, BLOCK_L)
            start += PROGS * BLOCK_L


def hamming_scores_supported(q_sig: torch.Tensor, k_sig: torch.Tensor) -> bool:
    return (
        on_kernel_device(q_sig, k_sig)
        and q_sig.dtype == torch.int32
        and k_sig.dtype == torch.int32
        and q_sig.dim() == 3
        and k_sig.dim() == 4
        and q_sig.shape[0] == k_sig.shape[0]
        and q_sig.shape[1] % k_sig.shape[1] == 0
        and q_sig.shape[2] == k_sig.shape[3]
        and k_sig.shape[3] <= 64
    )


def hamming_scores(q_sig: torch.Tensor, k_sig: torch.Tensor) -> torch.Tensor:
    """[B,Hq,W] x [B,Hkv,L,W] int32 -> [B,Hkv,L] (reference.hamming_dtype): sum over the group of
    32W - Hamming."""
    B, Hq, W = q_sig.shape
    Hkv, L = k_sig.shape[1], k_sig.shape[2]
    out = torch.empty(B, Hkv, L, dtype=hamming_dtype(Hq // Hkv, W), device=k_sig.device)
    if B * Hkv * L == 0:
        return out
    BLOCK_L = 1024 if L >= 1024 else max(16, pow2(L))
    progs = programs_per_row(B * Hkv, triton.cdiv(L, BLOCK_L), k_sig.device, waves=STREAM_WAVES)
    torch.library.wrap_triton(_hamming_kernel)[(progs, B * Hkv)](
        q_sig, k_sig, out,
        Hkv, L, progs,
        *q_sig.stride(),
        *k_sig.stride(),
        *out.stride(),
        G=Hq // Hkv, W=W, BLOCK_L=BLOCK_L, USE_FOR=not interpreting(),
        num_warps=4, num_stages=STREAM_STAGES,
        **pdl(k_sig.device),
    )
    return out


# ------------------------------------------------------------------------------ hash_select keys
@triton.jit
def _popcount(x, HW_POPC: tl.constexpr):
    """Bits set in each int32 (the hardware instruction on the GPU, SWAR in the interpreter)."""
    if HW_POPC:
        return libdevice.popc(x)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    y = (x & 0x00FF00FF) + ((x >> 8) & 0x00FF00FF)
    return (y & 0xFFFF) + (y >> 16)


@triton.jit
def _hash_keys_block(
    k_row, mask_b, keys_row, h, offs, lo_c, hi_c, N, min_half, scored,
    skl, skw, smh, sml, qflat, c0, c1, c2, c3,
    G: tl.constexpr, G_PAD: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr, KEY_BITS: tl.constexpr,
    LB: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
    HW_POPC: tl.constexpr,
):
    """Keys of one block of cache slots (int32 offsets: a row holds < 2**31 slots; the row pointers
    carry the int64 part)."""
    row = offs < N  # loads and the store cover whole blocks (vectorised); a block is one program's
    elig = slots_eligible(offs, lo_c, hi_c, row, mask_b, h, min_half, smh, sml, HAS_MASK, MASK_BOOL, MASK_HEADS)
    qi = tl.arange(0, W_PAD * G_PAD)
    dist = tl.zeros(offs.shape, tl.int32)
    for w in tl.static_range(W):
        kw = tl.load(k_row + offs * skl + w * skw, mask=row & scored, other=0)
        for g in tl.static_range(G):  # one query word at a time: [BLOCK] vectors only, no cross-lane sums
            qw = tl.sum(tl.where(qi == w * G_PAD + g, qflat, 0), axis=0)
            dist += _popcount(kw ^ qw, HW_POPC)
    key = tl.where(scored, G * W * 32 - dist + 1, 1)  # nothing to rank when all are taken
    key = tl.where(elig, key, 0)
    tl.store(keys_row + offs, key.to(keys_row.dtype.element_ty), mask=row)
    return count(c0, c1, c2, c3, key >> (KEY_BITS - LB), elig, 1 << LB)


@triton.jit
def _hash_keys_kernel(
    q_ptr, k_ptr, tpos_ptr, start_ptr, mask_ptr, keys_ptr, cum_ptr,
    Hkv, N, sink, local, K, min_half, PROGS,
    sqb, sqh, sqd, skb, skh, skl, skw, smb, smh, sml,
    G: tl.constexpr,  # query heads per KV head: their G query words are scored against each key word in registers
    G_PAD: tl.constexpr,
    W: tl.constexpr,  # words per signature: unrolled
    W_PAD: tl.constexpr,
    KEY_BITS: tl.constexpr,  # 8, or 16 when similarities exceed 254
    LB: tl.constexpr,  # bits per radix level (this pass counts the top LB bits)
    BLOCK: tl.constexpr,
    HAS_START: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
    HW_POPC: tl.constexpr,  # the popc instruction (GPU); SWAR under the interpreter
    USE_FOR: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    """Key pass of hash_select: pack the query signs, score the chunk's keys by Hamming similarity
    summed over the KV head's query heads, key = similarity + 1 (0: not a candidate)."""
    pdl_enter(PDL)
    p, r = tl.program_id(0), tl.program_id(1)
    b, h = row_of(r, Hkv)
    # the query's and the row's first position, loaded here: a helper given these pointers would seem to write them
    now, first = tl.load(tpos_ptr).to(tl.int32), tl.load(start_ptr + b, mask=HAS_START, other=0).to(tl.int32)
    lo_c, hi_c, blk, end = row_chunk(now, first, p, N, sink, local, PROGS, BLOCK, False)
    scored = (hi_c - lo_c) > K
    gi = tl.arange(0, G_PAD)
    qi = tl.arange(0, W_PAD * G_PAD)
    j = tl.arange(0, 32)
    qflat = tl.zeros([W_PAD * G_PAD], tl.int32)  # query word (w, g) at w * G_PAD + g
    for w in tl.static_range(W):
        x = tl.load(q_ptr + b * sqb + (h * G + gi)[:, None] * sqh + (w * 32 + j)[None, :] * sqd,
                    mask=(gi < G)[:, None], other=0.0)
        word = tl.sum((x > 0).to(tl.int32) << j[None, :], axis=1)  # distinct bits: the sum is the OR
        for g in tl.static_range(G):
            qflat = tl.where(qi == w * G_PAD + g, tl.sum(tl.where(gi == g, word, 0), axis=0), qflat)
    k_row = k_ptr + b * skb + h * skh
    mask_b = mask_ptr + b * smb
    keys_row = keys_ptr + r.to(tl.int64) * N
    base = tl.arange(0, BLOCK)
    c0, c1, c2, c3 = counts_zero(BLOCK, 1 << LB)
    if USE_FOR:
        for i in tl.range(blk, end):
            c0, c1, c2, c3 = _hash_keys_block(k_row, mask_b, keys_row, h, i * BLOCK + base, lo_c, hi_c, N, min_half, scored,
                                   skl, skw, smh, sml, qflat, c0, c1, c2, c3,
                                   G, G_PAD, W, W_PAD, KEY_BITS, LB, HAS_MASK, MASK_BOOL, MASK_HEADS, HW_POPC)
    else:
        while blk < end:
            c0, c1, c2, c3 = _hash_keys_block(k_row, mask_b, keys_row, h, blk * BLOCK + base, lo_c, hi_c, N, min_half, scored,
                                   skl, skw, smh, sml, qflat, c0, c1, c2, c3,
                                   G, G_PAD, W, W_PAD, KEY_BITS, LB, HAS_MASK, MASK_BOOL, MASK_HEADS, HW_POPC)
            blk += 1
    acc = counts_total(c0, c1, c2, c3, 1 << LB)
    tl.store(cum_ptr + (r * PROGS + p) * (1 << LB) + tl.arange(0, 1 << LB), tl.cumsum(acc, 0, reverse=True))
