"""Prism INT2 keys: quantise-and-pack at cache-write time, and the proposal score scan.

Codes: channel c of a key sits at bits 2(c % 16) of word c // 16; per group of g channels an fp16
scale and zero (k ~ zero + scale * code), a key's M scales then M zeros side by side in `params`
(one 16-byte record at D = 128, g = 32: a gathered key reads two sectors, not three). The write
reproduces reference.int2_quantize bit for bit: scale = (max - min) / 3 with IEEE division
(`div_rn`; Triton's `/` is approximate on NVIDIA), both rounded to the stored dtype, and codes from
the *rounded* scale/zero, rounded half to even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import INT2_CODES_PER_WORD
from .common import (
    FLOAT_DTYPES, STREAM_STAGES, STREAM_WAVES, interpreting, is_pow2, on_kernel_device, pdl, pdl_enter, pow2,
    programs_per_row, row_of, upcast_dot,
)

INT2_BLOCK_L = 128  # keys per step of the score scan (rows of its MMA)
# Cache slots (B * Hkv * L, L the cache's capacity) from which the scan builds its MMA operands in
# place (variant 3, fewer instructions a tile) rather than joining halves (variant 2, shorter
# latency a tile): the fewer instructions pay where a program scans enough tiles to hide the longer latency.
# kernel_tuning's crossover over full caches (bench/results/kernel-tuning-2026-12-02.json)
INT2_IN_PLACE_MIN_KEYS = 1 << 22
# A refined layer's pool scan: its tiles' codes loaded a tile ahead by hand and its slots two (no
# load of a step then waits on another: the codes' and params' addresses come from the slots), its
# keys a step, programs per SM and pipeline depth: its own, not the cache scan's.
# kernel_tuning's best geometric mean over 32K-128K x batch 1-16 (bench/results/kernel-tuning-2026-12-03-pool.json)
POOL_CODES_AHEAD = True
POOL_BLOCK_L, POOL_WAVES, POOL_STAGES = 64, 4, 2


# ---------------------------------------------------------------------------------- write
@triton.jit
def _int2_write_kernel(
    k_ptr, codes_ptr, params_ptr, pos_ptr,
    H, T,
    skb, skh, skt, skd,
    scb, sch, scl, scw,
    srb, srh, srl, srm,
    spt,
    D: tl.constexpr,  # head dim (power of two): one program holds whole keys
    M: tl.constexpr,  # groups per key; D // M channels share a scale and zero
    BLOCK_T: tl.constexpr,  # new tokens per program
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
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
    s_st = tl.math.div_rn(hi - lo, 3.0).to(params_ptr.dtype.element_ty)
    z_st = lo.to(params_ptr.dtype.element_ty)
    s = s_st.to(tl.float32)
    z = z_st.to(tl.float32)
    slot = tl.load(pos_ptr + t * spt, mask=live, other=0).to(tl.int64)
    m = tl.arange(0, M)
    rec = params_ptr + b * srb + h * srh + slot[:, None] * srl
    tl.store(rec + m[None, :] * srm, s_st, mask=live[:, None])
    tl.store(rec + (M + m)[None, :] * srm, z_st, mask=live[:, None])
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


def int2_write_supported(codes, params, k, pos) -> bool:
    if not on_kernel_device(codes, params, k, pos):
        return False
    if k.dim() != 4 or codes.dim() != 4 or params.dim() != 4 or pos.dim() != 1:
        return False
    D = k.shape[-1]
    M = params.shape[-1] // 2
    return (
        k.dtype in FLOAT_DTYPES
        and codes.dtype == torch.int32
        and params.dtype in FLOAT_DTYPES
        and is_pow2(D) and 16 <= D <= 512
        and params.shape[-1] == 2 * M and M > 0 and D % M == 0 and is_pow2(M)
        and codes.shape[-1] * INT2_CODES_PER_WORD == D
        and pos.shape[0] == k.shape[2]
        and k.shape[:2] == codes.shape[:2] == params.shape[:2]
    )


def int2_write(codes, params, k, pos) -> None:
    """Quantise k [B,H,T,D] and write codes and params at positions pos [T] (reference.int2_write)."""
    B, H, T, D = k.shape
    M = params.shape[-1] // 2
    if B * H * T > 0:
        BLOCK_T = min(pow2(T), max(1, 2048 // D))
        grid = (triton.cdiv(T, BLOCK_T), B * H)
        torch.library.wrap_triton(_int2_write_kernel)[grid](
            k, codes, params, pos,
            H, T,
            *k.stride(), *codes.stride(), *params.stride(), pos.stride(0),
            D=D, M=M, BLOCK_T=BLOCK_T,
            **pdl(k.device),
        )


# ---------------------------------------------------------------------------------- scores
@triton.jit
def _int2_scales(r_row, keys, live, srl, srm, M: tl.constexpr, M_PAD: tl.constexpr):
    """The scales and zeros of the keys at slots `keys` as float32 [BLOCK_L, M_PAD] (0 where not
    live), from each key's one record of params."""
    m = tl.arange(0, M_PAD)
    lm = live[:, None] & (m < M)[None, :]
    rec = r_row + keys[:, None] * srl
    sc = tl.load(rec + m[None, :] * srm, mask=lm, other=0.0).to(tl.float32)
    z = tl.load(rec + (M + m)[None, :] * srm, mask=lm, other=0.0).to(tl.float32)
    return sc, z


@triton.jit
def _cache_keys(start, filled, BLOCK_L: tl.constexpr):
    """A proposal's tile: slots start.. of the cache, live while written."""
    keys = (start + tl.arange(0, BLOCK_L)).to(tl.int64)
    return keys, keys < filled


@triton.jit
def _pool_keys(p_row, start, N, filled, spn, BLOCK_L: tl.constexpr):
    """A refined layer's tile: entries start.. of its pool, the slots they hold (-1: empty, not live)."""
    offs = start + tl.arange(0, BLOCK_L)
    keys = tl.load(p_row + offs.to(tl.int64) * spn, mask=offs < N, other=-1).to(tl.int64)
    return keys, (keys >= 0) & (keys < filled)


@triton.jit
def _int2_words(c_row, keys, live, scl, scw, D: tl.constexpr):
    """The packed codes [BLOCK_L, D // 16] of the keys at slots `keys` (0 where not live)."""
    w = tl.arange(0, D // 16)
    return tl.load(c_row + keys[:, None] * scl + w[None, :] * scw, mask=live[:, None], other=0)


@triton.jit
def _int2_scores_tile(
    q_bd, qsum, qmag, magic, words, sc, z, live,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr, DOT_PRECISION: tl.constexpr, OP_DTYPE: tl.constexpr, VARIANT: tl.constexpr,
    MAGIC_VALUE: tl.constexpr, HALF: tl.constexpr,
):
    """Scores [BLOCK_L] of a tile of keys (-inf where not live; words, sc, z: their packed codes,
    scales and zeros): their codes as a [BLOCK_L, D] tile of small floats times the block-diagonal query matrix
    [D, M_PAD * G_PAD] (column m * G_PAD + g holds query head g on the channels of scale group m)
    in one MMA; then per key and head sum_m scale_m * dot_m + zero_m * qsum_m, and the max over
    the heads.

    VARIANT 0 unpacks each code (shift, mask, convert). VARIANT 2 makes two codes per 32-bit op:
    (word >> 2i) & 0x00030003 | magic puts channels i and i + 8 of a word, plus a constant 2^k,
    in the low and high halves as two 16-bit floats (k = 7 for bf16, 10 for fp16), joined back into
    channel order for one MMA on the natural tile; the constant's share, 2^k * qsum, is taken off
    with the zero. VARIANT 3 builds each pair register where the MMA reads it, one shift per two registers:
    register r (operand columns 16 w + 2 r + h, h the half) is (word >> 4 (r % 4)) & (0x00030003 <<
    2 (r // 4)) | magic, i.e. channels i = 2 (r % 4) + r // 4 (low half) and 8 + i (high half) as
    code * 4^(r // 4). A thread's operand registers r and r + 4 share the shift and no halves move;
    the query rows follow the columns' channels, scaled by 4^-(r // 4) (exact), and the constant's
    share, 2^k times the scaled rows' sum (qmag), is taken off the dot."""
    if VARIANT == 3:  # pair registers in the MMA's order: no halves moved
        r = tl.arange(0, 8)
        pair = ((words[:, :, None] >> (4 * (r % 4))[None, None, :]) & (0x00030003 << (2 * (r // 4)))[None, None, :]) | magic
        lo = pair.to(tl.int16).to(HALF, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(HALF, bitcast=True)
        tile = tl.reshape(tl.join(lo, hi), (BLOCK_L, D)).to(OP_DTYPE)
        part = tl.dot(tile, q_bd, input_precision=DOT_PRECISION)
    elif VARIANT == 2:  # two codes an op, halves joined back into channel order
        pair = ((words[:, :, None] >> (2 * tl.arange(0, 8))[None, None, :]) & 0x00030003) | magic
        lo = pair.to(tl.int16).to(HALF, bitcast=True)
        hi = (pair >> 16).to(tl.int16).to(HALF, bitcast=True)
        tile = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (BLOCK_L, D)).to(OP_DTYPE)
        part = tl.dot(tile, q_bd, input_precision=DOT_PRECISION)
    else:
        codes = (words[:, :, None] >> (2 * tl.arange(0, 16))[None, None, :]) & 3
        tile = tl.reshape(codes, (BLOCK_L, D)).to(OP_DTYPE)
        part = tl.dot(tile, q_bd, input_precision=DOT_PRECISION)  # [BLOCK_L, M_PAD * G_PAD]
    if VARIANT == 3:  # the constant's share, off the dot: the scaled rows' sums differ from qsum
        part = part - MAGIC_VALUE * qmag[None, :]
    part = tl.reshape(part, (BLOCK_L, M_PAD, G_PAD))
    if VARIANT == 2:  # the constant's share, with the zero: 2^k * scale * qsum (fewer registers)
        z = z - sc * MAGIC_VALUE
    acc = tl.sum(part * sc[:, :, None], axis=1) + tl.sum(z[:, :, None] * qsum[None, :, :], axis=1)
    acc = tl.where((tl.arange(0, G_PAD) < G)[None, :], acc, float("-inf"))
    return tl.where(live, tl.max(acc, axis=1), float("-inf"))


@triton.jit
def _unwritten_tile(o_row, start, L, sol, BLOCK_L: tl.constexpr):
    """Slots not written yet: never read, scored -inf."""
    offs = start + tl.arange(0, BLOCK_L)
    tl.store(o_row + offs.to(tl.int64) * sol, tl.full([BLOCK_L], float("-inf"), tl.float32), mask=offs < L)


@triton.jit
def _tile_keys(p_row, start, N, filled, spn, POOL: tl.constexpr, BLOCK_L: tl.constexpr):
    if POOL:
        keys, live = _pool_keys(p_row, start, N, filled, spn, BLOCK_L)
    else:
        keys, live = _cache_keys(start, filled, BLOCK_L)
    return keys, live


@triton.jit
def _scan_step(
    q_bd, qsum, qmag, magic, c_row, r_row, o_row, p_row, keys, live, words, sc, z, live_c, start, STEP, N, filled,
    width, scl, scw, srl, srm, spn, sol,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr, POOL: tl.constexpr, DOT_PRECISION: tl.constexpr, OP_DTYPE: tl.constexpr,
    VARIANT: tl.constexpr, MAGIC_VALUE: tl.constexpr, HALF: tl.constexpr, AHEAD: tl.constexpr,
):
    """Score and store the tile at `start`; return the next step's state, loaded ahead of its use.
    The state: slots `keys` / `live`, scales and zeros `sc`, `z`, liveness `live_c` of the tile to
    score. With AHEAD also its codes `words`, while `keys` / `live` are already the tile after it:
    no load of a step then waits on another (a pool's slots -> that tile's codes and params)."""
    if AHEAD:
        keys_next, live_next = _tile_keys(p_row, start + 2 * STEP, N, filled, spn, POOL, BLOCK_L)
        words_next = _int2_words(c_row, keys, live, scl, scw, D)
        sc_next, z_next = _int2_scales(r_row, keys, live, srl, srm, M, M_PAD)
        live_c_next = live
    else:
        keys_next, live_next = _tile_keys(p_row, start + STEP, N, filled, spn, POOL, BLOCK_L)
        sc_next, z_next = _int2_scales(r_row, keys_next, live_next, srl, srm, M, M_PAD)
        words_next = words  # unused
        words = _int2_words(c_row, keys, live, scl, scw, D)
        live_c_next = live_next
    score = _int2_scores_tile(q_bd, qsum, qmag, magic, words, sc, z, live_c,
                              G, G_PAD, D, M_PAD, BLOCK_L, DOT_PRECISION, OP_DTYPE, VARIANT, MAGIC_VALUE, HALF)
    offs = start + tl.arange(0, BLOCK_L)
    tl.store(o_row + offs.to(tl.int64) * sol, score, mask=offs < width)
    return keys_next, live_next, words_next, sc_next, z_next, live_c_next


@triton.jit
def _int2_scan(
    q_ptr, codes_ptr, params_ptr, tpos_ptr, pool_ptr, out_ptr,
    Hkv, L, N, PROGS, magic,
    sqb, sqh, sqd, scb, sch, scl, scw, srb, srh, srl, srm, spb, sph, spn, sob, soh, sol,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr, HAS_POS: tl.constexpr, POOL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    OP_DTYPE: tl.constexpr, VARIANT: tl.constexpr, MAGIC_VALUE: tl.constexpr, HALF: tl.constexpr,
    USE_FOR: tl.constexpr, PACKED: tl.constexpr, AHEAD: tl.constexpr,
):
    """Both scans' body: over the cache's L slots (a proposal), or over the N entries of a pool of
    slots (POOL, a refined layer: the scores of entry n at out[.., n])."""
    if PACKED:  # known strides let the loads vectorise (16 B of codes, 8 B of scales) and pipeline
        scl = D // 16
        scw = 1
        srl = 2 * M
        srm = 1
    pid = tl.program_id(0)
    r = tl.program_id(1)
    b, h = row_of(r, Hkv)
    filled = tl.minimum(tl.load(tpos_ptr).to(tl.int64) + 1, L) if HAS_POS else tl.zeros([], tl.int64) + L
    GS: tl.constexpr = D // M
    c = tl.arange(0, D)
    n = tl.arange(0, M_PAD * G_PAD)
    if VARIANT == 3:  # row 16 w + 2 r + h: channel 16 w + 8 h + 2 (r % 4) + r // 4, scaled by 4^-(r // 4)
        reg = (c % 16) // 2  # the operand register of the row's column pair
        ch = (c // 16) * 16 + 8 * (c % 2) + 2 * (reg % 4) + reg // 4
    else:
        ch = c
    own = ((ch[:, None] // GS) == (n // G_PAD)[None, :]) & ((n % G_PAD) < G)[None, :]
    q_head = q_ptr + b * sqb + (h * G + n % G_PAD)[None, :] * sqh
    qv = tl.load(q_head + ch[:, None] * sqd, mask=own, other=0.0).to(tl.float32)
    qsum = tl.reshape(tl.sum(qv, axis=0), (M_PAD, G_PAD))
    if VARIANT == 3:
        qv = qv * tl.where(reg < 4, 1.0, 0.25)[:, None]  # a power of two: exact
    qmag = tl.sum(qv, axis=0)  # VARIANT 3: the scaled rows' sums (the constant's share)
    q_bd = qv.to(OP_DTYPE)
    c_row = codes_ptr + b * scb + h * sch
    r_row = params_ptr + b * srb + h * srh
    o_row = out_ptr + b * sob + h * soh
    p_row = pool_ptr + b * spb + h * sph
    # A proposal scores the tiles holding written keys, then marks the unwritten rest (-inf, never
    # read): no branch in the scoring loop, so its loads are software-pipelined. A pool's entries
    # are all scored (empty ones -inf). The first tile's state is loaded here (_scan_step).
    STEP = PROGS * BLOCK_L
    first = pid * BLOCK_L
    stop = N if POOL else filled  # the scoring loop's end
    width = N if POOL else L  # the output row's
    rest = first + tl.cdiv(tl.maximum(stop - first, 0), STEP) * STEP
    keys, live = _tile_keys(p_row, first, N, filled, spn, POOL, BLOCK_L)
    sc, z = _int2_scales(r_row, keys, live, srl, srm, M, M_PAD)
    live_c = live
    if AHEAD:
        words = _int2_words(c_row, keys, live, scl, scw, D)
        keys, live = _tile_keys(p_row, first + STEP, N, filled, spn, POOL, BLOCK_L)
    else:
        words = tl.zeros([BLOCK_L, D // 16], tl.int32)  # unused
    if USE_FOR:
        for start in tl.range(first, stop, STEP):  # grid-stride
            keys, live, words, sc, z, live_c = _scan_step(
                q_bd, qsum, qmag, magic, c_row, r_row, o_row, p_row, keys, live, words, sc, z, live_c, start, STEP,
                N, filled, width, scl, scw, srl, srm, spn, sol, G, G_PAD, D, M, M_PAD, BLOCK_L, POOL,
                DOT_PRECISION, OP_DTYPE, VARIANT, MAGIC_VALUE, HALF, AHEAD)
        if not POOL:
            for start in tl.range(rest, L, STEP):
                _unwritten_tile(o_row, start, L, sol, BLOCK_L)
    else:
        start = first
        while start < stop:
            keys, live, words, sc, z, live_c = _scan_step(
                q_bd, qsum, qmag, magic, c_row, r_row, o_row, p_row, keys, live, words, sc, z, live_c, start, STEP,
                N, filled, width, scl, scw, srl, srm, spn, sol, G, G_PAD, D, M, M_PAD, BLOCK_L, POOL,
                DOT_PRECISION, OP_DTYPE, VARIANT, MAGIC_VALUE, HALF, AHEAD)
            start += STEP
        if not POOL:
            start = rest
            while start < L:
                _unwritten_tile(o_row, start, L, sol, BLOCK_L)
                start += STEP


# Two kernels of one body, so that a profile names a proposal's scan and a refined layer's apart.
@triton.jit
def _int2_scores_kernel(
    q_ptr, codes_ptr, params_ptr, tpos_ptr, out_ptr,
    Hkv, L, PROGS,
    magic,  # VARIANT 2, 3: two copies of the 16-bit float 2^k (0x43004300 bf16, 0x64006400 fp16), an argument
    # so that it sits in a register and each (code & mask) | magic is one instruction
    sqb, sqh, sqd,
    scb, sch, scl, scw,
    srb, srh, srl, srm,  # params: a key's M scales, then its M zeros
    sob, soh, sol,
    G: tl.constexpr,  # query heads per KV head: all scored in one program, so codes are read once
    G_PAD: tl.constexpr,  # G padded to a power of two
    D: tl.constexpr,  # head dim (power of two)
    M: tl.constexpr,  # scale groups per key
    M_PAD: tl.constexpr,  # M padded so that M_PAD * G_PAD >= 16 (the MMA's narrowest N)
    BLOCK_L: tl.constexpr,  # keys per loop step (rows of the MMA)
    HAS_POS: tl.constexpr,  # stop at the query's position (slots after it hold no key yet)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 queries (exact); bf16/fp16 queries and codes 0..3 are exact as is
    OP_DTYPE: tl.constexpr,  # MMA operand dtype: the query's (fp32 under the interpreter)
    VARIANT: tl.constexpr,  # how codes become MMA operands (see _int2_scores_tile)
    MAGIC_VALUE: tl.constexpr,  # VARIANT 2, 3: 2^k as a float (128 or 1024)
    HALF: tl.constexpr,  # VARIANT 2, 3: that 16-bit float type
    USE_FOR: tl.constexpr,  # pipelined `for` on GPU; `while` under the interpreter
    PACKED: tl.constexpr,  # rows of codes, scales and zeros are contiguous: strides become constants
    AHEAD: tl.constexpr,  # codes loaded a tile ahead by hand (_scan_step), not by the pipeliner
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    _int2_scan(q_ptr, codes_ptr, params_ptr, tpos_ptr, tpos_ptr, out_ptr, Hkv, L, L, PROGS, magic,
               sqb, sqh, sqd, scb, sch, scl, scw, srb, srh, srl, srm, 0, 0, 0, sob, soh, sol,
               G, G_PAD, D, M, M_PAD, BLOCK_L, HAS_POS, False, DOT_PRECISION, OP_DTYPE, VARIANT, MAGIC_VALUE, HALF,
               USE_FOR, PACKED, AHEAD)


@triton.jit
def _int2_pool_scores_kernel(
    q_ptr, codes_ptr, params_ptr, tpos_ptr, pool_ptr, out_ptr,
    Hkv, L, N, PROGS, magic,
    sqb, sqh, sqd,
    scb, sch, scl, scw,
    srb, srh, srl, srm,
    spb, sph, spn,  # the pool [B, Hkv, N] of cache slots
    sob, soh, sol,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_L: tl.constexpr, HAS_POS: tl.constexpr, DOT_PRECISION: tl.constexpr, OP_DTYPE: tl.constexpr,
    VARIANT: tl.constexpr, MAGIC_VALUE: tl.constexpr, HALF: tl.constexpr, USE_FOR: tl.constexpr,
    PACKED: tl.constexpr, AHEAD: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    _int2_scan(q_ptr, codes_ptr, params_ptr, tpos_ptr, pool_ptr, out_ptr, Hkv, L, N, PROGS, magic,
               sqb, sqh, sqd, scb, sch, scl, scw, srb, srh, srl, srm, spb, sph, spn, sob, soh, sol,
               G, G_PAD, D, M, M_PAD, BLOCK_L, HAS_POS, True, DOT_PRECISION, OP_DTYPE, VARIANT, MAGIC_VALUE, HALF,
               USE_FOR, PACKED, AHEAD)


_OP_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def int2_scores_supported(q, codes, params, pos=None, positions=None) -> bool:
    if not on_kernel_device(q, codes, params, pos, positions):
        return False
    if q.dim() != 4 or codes.dim() != 4 or params.dim() != 4:
        return False
    D = q.shape[-1]
    M = params.shape[-1] // 2
    return (
        q.dtype in FLOAT_DTYPES
        and q.shape[2] == 1
        and codes.dtype == torch.int32
        and params.dtype in FLOAT_DTYPES
        and is_pow2(D) and 16 <= D <= 256
        and codes.shape[-1] * INT2_CODES_PER_WORD == D
        and params.shape[-1] == 2 * M and M > 0 and D % M == 0 and is_pow2(M)
        and params.shape[:3] == codes.shape[:3]
        and q.shape[0] == codes.shape[0]
        and q.shape[1] % codes.shape[1] == 0
        and (pos is None or (pos.dim() == 1 and pos.shape[0] >= 1 and not pos.is_floating_point()))
        and (positions is None or (positions.dim() == 3 and positions.shape[:2] == codes.shape[:2]
                                   and not positions.is_floating_point() and positions.dtype != torch.bool))
    )


def int2_scores(q, codes, params, pos=None, positions=None, *, block_l=None, warps=4,
                stages=None, waves=None, variant=None, ahead=None) -> torch.Tensor:
    """max over the group of <q, dequantised k>: [B,Hkv,L] float32, or [B,Hkv,N] at the slots
    `positions` [B,Hkv,N] (reference.int2_scores). Unset, the launch knobs (ahead: codes loaded a
    tile ahead by hand) are the cache scan's over the cache and the POOL_ constants over a pool."""
    pool = positions is not None
    block_l = block_l or (POOL_BLOCK_L if pool else INT2_BLOCK_L)
    stages = stages or (POOL_STAGES if pool else STREAM_STAGES)
    waves = waves or (POOL_WAVES if pool else STREAM_WAVES)
    ahead = (POOL_CODES_AHEAD and pool) if ahead is None else ahead
    B, Hq, _, D = q.shape
    Hkv, L = codes.shape[1], codes.shape[2]
    N = L if positions is None else positions.shape[-1]
    M = params.shape[-1] // 2
    G = Hq // Hkv
    out = torch.empty(B, Hkv, N, dtype=torch.float32, device=codes.device)
    if B * Hkv * N == 0:
        return out
    G_PAD = pow2(G)
    progs = programs_per_row(B * Hkv, triton.cdiv(N, block_l), codes.device, waves=waves)
    op = torch.float32 if upcast_dot(q.dtype) or interpreting() else q.dtype
    half = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else None
    if half is None:
        variant = 0  # fp32 queries: the exact path
    elif variant is None:
        variant = 3 if B * Hkv * N >= INT2_IN_PLACE_MIN_KEYS else 2
    tpos = pos[-1:] if pos is not None else codes
    magic = 0x43004300 if half == torch.bfloat16 else 0x64006400
    strides = (q.stride(0), q.stride(1), q.stride(3), *codes.stride(), *params.stride())
    if positions is None:
        kernel = _int2_scores_kernel
        args = (q, codes, params, tpos, out, Hkv, L, progs, magic, *strides, *out.stride())
    else:
        kernel = _int2_pool_scores_kernel
        args = (q, codes, params, tpos, positions, out, Hkv, L, N, progs, magic, *strides, *positions.stride(),
                *out.stride())
    torch.library.wrap_triton(kernel)[(progs, B * Hkv)](
        *args,
        G=G, G_PAD=G_PAD, D=D, M=M, M_PAD=max(M, 16 // min(G_PAD, 16)), BLOCK_L=block_l,
        HAS_POS=pos is not None,
        DOT_PRECISION="ieee" if op == torch.float32 else "tf32",
        OP_DTYPE=_OP_DTYPE[op],
        VARIANT=variant,
        MAGIC_VALUE=128.0 if half == torch.bfloat16 else 1024.0,
        HALF=_OP_DTYPE[half or torch.float16],
        USE_FOR=not interpreting(),
        PACKED=codes.stride()[2:] == (D // 16, 1) and params.stride()[2:] == (2 * M, 1),
        AHEAD=bool(ahead),
        num_warps=warps, num_stages=stages,
        **pdl(codes.device),
    )
    return out
