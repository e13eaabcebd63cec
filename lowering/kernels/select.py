"""Top-k selection of cache positions per (batch, KV head) row: sink + local window + top-k.

A histogram / threshold select (no sort of the row). Each eligible candidate (readable, not after
the query, outside the window) gets an integer key ordered like its score; ineligible ones are
skipped. The k-th largest key is found by radix refinement with 256-bin histograms: a level bins
the keys of the current key range [lo, lo + 2^w) by their top 8 bits, and the bin holding the k-th
key becomes the next range; every key above it is taken. Every pass over a row runs many programs
per row, so 8 rows at batch 1 still fill the GPU; a pass derives the previous levels' thresholds
from their histograms in its prologue (a 256-entry scan), so no pass waits on a separate kernel.

  uint8 scores (Hamming similarities, `reference.hamming_dtype`): the key is the score; one level
  is exact.                                     hist -> compact              (2 reads of the row)
  other scores: the order-preserving int32 image of the score (float bits, negatives flipped) or
  the integer; its range from a min/max pass; three levels leave a final bin at most 256 keys wide,
  whose candidates go to a small buffer that `resolve` ranks exactly.
                              minmax -> hist x3 -> compact -> resolve        (5 reads of the row)

Ties of equal keys are taken by arrival (the reference allows any); so is a final bin holding more
than BUF candidates (then the result is exact up to 256 units in the last place of the scores).
`compact` also writes the sink / local window and the -1 padding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    FLOAT_DTYPES,
    STREAM_STAGES,
    STREAM_WAVES,
    MaskArgs,
    interpreting,
    mask_readable,
    on_kernel_device,
    pow2,
    programs_per_row,
)

KEY_NONE = tl.constexpr(-(2**31))  # not a candidate
KEY_NEGINF = tl.constexpr(-2139095041)  # ordered key of float32 -inf: never chosen
NB = tl.constexpr(256)  # bins per level: 8 bits of the key range
LEVELS = 3  # for keys wider than 8 bits: 32 -> 24 -> 16 -> 8 bits left
BUF = 1024  # final-bin candidates ranked exactly by `resolve`
BLOCK_U8 = 4096  # candidates per step of the streaming passes (uint8 scores: 32 bytes a thread)
BLOCK_WIDE = 2048
WIN_BLOCK = tl.constexpr(256)
# per-row int64 state: 0 kmin, 1 kmax, 2 eligible count, 3 taken-above counter, 4 tie counter
STATE = tl.constexpr(8)

SCORE_DTYPES = FLOAT_DTYPES + (torch.uint8, torch.int8, torch.int16, torch.int32)


# ------------------------------------------------------------------------------ device helpers
@triton.jit
def _keys(
    scores_row, pos_row, mask_b, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
    HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
    INT_KEYS: tl.constexpr,
):
    """(key int32, cache position int64) of candidates `offs` of one row; KEY_NONE where ineligible."""
    inb = offs < N
    if HAS_POS:
        cand = tl.load(pos_row + offs.to(tl.int64) * spn, mask=inb, other=-1).to(tl.int64)
    else:
        cand = offs.to(tl.int64)
    elig = inb & (cand >= sink) & (cand <= now - local) & (cand >= 0)
    if HAS_MASK:
        if HAS_POS:
            col = tl.minimum(tl.maximum(cand, 0), L - 1)
        else:
            col = cand  # slots 0..N-1 = positions: keep the loads contiguous
        elig = mask_readable(mask_b, 0, h, col, elig, 0, smh, sml, min_half, MASK_HEADS, MASK_BOOL)
    if INT_KEYS:
        key = tl.load(scores_row + offs * ssn, mask=elig, other=0).to(tl.int32)
    else:
        s = tl.load(scores_row + offs * ssn, mask=elig, other=0).to(tl.float32)
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        elig = elig & (key > KEY_NEGINF) & (s == s)  # -inf and NaN are never chosen
    return tl.where(elig, key, KEY_NONE), cand


@triton.jit
def _bit_length(x):
    """Bits needed for x (int64, >= 0; negative -> 0), by halving (no clz in the interpreter)."""
    n = tl.zeros([], tl.int64)
    for i in tl.static_range(6):
        step = 32 >> i
        big = (x >> step) > 0
        n += tl.where(big, step, 0)
        x = tl.where(big, x >> step, x)
    return n + (x > 0).to(tl.int64)


@triton.jit
def _path(st, hist_ptr, r, R, K, DONE: tl.constexpr, U8: tl.constexpr):
    """(lo, width bits, taken above, need) of row r after the first DONE levels' thresholds."""
    if U8:
        lo = tl.zeros([], tl.int64)
        wb = tl.full([], 8, tl.int64)
    else:
        lo = tl.load(st + 0)
        wb = _bit_length(tl.load(st + 1) - lo)
    need = tl.minimum(tl.load(st + 2), K)
    above = tl.zeros([], tl.int64)
    i = tl.arange(0, NB)
    for lvl in tl.static_range(DONE):
        s = tl.maximum(wb - 8, 0)
        rev = tl.load(hist_ptr + (lvl * R + r) * NB + (i * -1 + (NB - 1))).to(tl.int64)  # top bin first
        ge = tl.cumsum(rev, axis=0)
        first = tl.min(tl.where(above + ge >= need, i, NB), axis=0)
        live = (wb > 0) & (first < NB)
        above = tl.where(live, above + tl.sum(tl.where(i < first, rev, 0), axis=0), above)
        lo = tl.where(live, lo + ((first.to(tl.int64) * -1 + (NB - 1)) << s), lo)
        wb = tl.where(wb > 0, s, wb)
    return lo, wb, above, need


@triton.jit
def _row_setup(tpos_ptr, Hkv, scores_ptr, pos_ptr, mask_ptr, ssb, ssh, spb, sph, smb):
    r = tl.program_id(1)
    b = (r // Hkv).to(tl.int64)
    h = (r % Hkv).to(tl.int64)
    now = tl.load(tpos_ptr).to(tl.int64)  # the launcher passes the last cache position alone
    return r, b, h, now, scores_ptr + b * ssb + h * ssh, pos_ptr + b * spb + h * sph, mask_ptr + b * smb


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _minmax_block(srow, prow, mrow, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml, hi, lo, n,
                  HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
                  MASK_HEADS: tl.constexpr, INT_KEYS: tl.constexpr):
    key, _ = _keys(srow, prow, mrow, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                   HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, INT_KEYS)
    live = key != KEY_NONE
    return tl.maximum(hi, key), tl.minimum(lo, tl.where(live, key, 2**31 - 1)), n + live.to(tl.int32)


@triton.jit
def _minmax_kernel(
    scores_ptr, pos_ptr, tpos_ptr, mask_ptr, state_ptr,
    Hkv, N, L, sink, local, min_half, PROGS,
    ssb, ssh, ssn, spb, sph, spn, smb, smh, sml,
    BLOCK: tl.constexpr, HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    MASK_HEADS: tl.constexpr, INT_KEYS: tl.constexpr,
    USE_FOR: tl.constexpr,  # pipelined `for` on GPU; `while` under the interpreter
):
    r, b, h, now, srow, prow, mrow = _row_setup(tpos_ptr, Hkv, scores_ptr, pos_ptr, mask_ptr, ssb, ssh, spb, sph, smb)
    hi = tl.full([BLOCK], KEY_NONE, tl.int32)
    lo = tl.full([BLOCK], 2**31 - 1, tl.int32)
    n = tl.zeros([BLOCK], tl.int32)
    base = tl.arange(0, BLOCK)
    if USE_FOR:
        for start in tl.range(tl.program_id(0) * BLOCK, N, PROGS * BLOCK):
            hi, lo, n = _minmax_block(srow, prow, mrow, h, start + base, N, L, now, sink, local, min_half, ssn, spn,
                                      smh, sml, hi, lo, n, HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, INT_KEYS)
    else:
        start = tl.program_id(0) * BLOCK
        while start < N:
            hi, lo, n = _minmax_block(srow, prow, mrow, h, start + base, N, L, now, sink, local, min_half, ssn, spn,
                                      smh, sml, hi, lo, n, HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, INT_KEYS)
            start += PROGS * BLOCK
    st = state_ptr + r * STATE
    tl.atomic_min(st + 0, tl.min(lo, axis=0).to(tl.int64), sem="relaxed")
    tl.atomic_max(st + 1, tl.max(hi, axis=0).to(tl.int64), sem="relaxed")
    tl.atomic_add(st + 2, tl.sum(n, axis=0).to(tl.int64), sem="relaxed")


@triton.jit
def _hist_block(srow, prow, mrow, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml, lo, wb, s, acc, n,
                HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
                MASK_HEADS: tl.constexpr, INT_KEYS: tl.constexpr):
    key, _ = _keys(srow, prow, mrow, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                   HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, INT_KEYS)
    rel = key.to(tl.int64) - lo
    live = (key != KEY_NONE) & (rel >= 0) & ((rel >> wb) == 0)  # inside the current range
    acc += tl.histogram(tl.where(live, rel >> s, 0).to(tl.int32), NB, mask=live)
    return acc, n + (key != KEY_NONE).to(tl.int32)


@triton.jit
def _hist_kernel(
    scores_ptr, pos_ptr, tpos_ptr, mask_ptr, state_ptr, hist_ptr,
    Hkv, N, L, sink, local, min_half, PROGS, R, K,
    ssb, ssh, ssn, spb, sph, spn, smb, smh, sml,
    LEVEL: tl.constexpr,  # 0-based; the thresholds of levels < LEVEL come from their histograms
    BLOCK: tl.constexpr, HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    MASK_HEADS: tl.constexpr, INT_KEYS: tl.constexpr,
    U8: tl.constexpr,  # uint8 keys: one exact level, which also counts the eligible candidates
    USE_FOR: tl.constexpr,
):
    r, b, h, now, srow, prow, mrow = _row_setup(tpos_ptr, Hkv, scores_ptr, pos_ptr, mask_ptr, ssb, ssh, spb, sph, smb)
    st = state_ptr + r * STATE
    lo, wb, above, need = _path(st, hist_ptr, r, R, K, LEVEL, U8)
    if (wb > 0) & ((LEVEL == 0) | (need > above)):
        s = tl.maximum(wb - 8, 0)
        acc = tl.zeros([NB], tl.int32)
        n = tl.zeros([BLOCK], tl.int32)
        base = tl.arange(0, BLOCK)
        if USE_FOR:
            for start in tl.range(tl.program_id(0) * BLOCK, N, PROGS * BLOCK):
                acc, n = _hist_block(srow, prow, mrow, h, start + base, N, L, now, sink, local, min_half, ssn, spn, smh,
                                     sml, lo, wb, s, acc, n, HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, INT_KEYS)
        else:
            start = tl.program_id(0) * BLOCK
            while start < N:
                acc, n = _hist_block(srow, prow, mrow, h, start + base, N, L, now, sink, local, min_half, ssn, spn, smh,
                                     sml, lo, wb, s, acc, n, HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, INT_KEYS)
                start += PROGS * BLOCK
        tl.atomic_add(hist_ptr + (LEVEL * R + r) * NB + tl.arange(0, NB), acc, mask=acc > 0, sem="relaxed")
        if U8:
            tl.atomic_add(st + 2, tl.sum(n, axis=0).to(tl.int64), sem="relaxed")


@triton.jit
def _compact_block(srow, prow, mrow, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                   st, out_row, sok, bkey_row, bpos_row, lo, top, above, need, CAP,
                   HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
                   MASK_HEADS: tl.constexpr, INT_KEYS: tl.constexpr, USE_BUF: tl.constexpr):
    key, cand = _keys(srow, prow, mrow, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                      HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, INT_KEYS)
    k64 = key.to(tl.int64)
    live = key != KEY_NONE
    up = (live & (k64 >= top)).to(tl.int32)
    n_up = tl.sum(up, axis=0)
    if n_up > 0:
        slot = tl.atomic_add(st + 3, n_up.to(tl.int64), sem="relaxed") + tl.cumsum(up, axis=0) - 1
        tl.store(out_row + slot * sok, cand.to(tl.int32), mask=(up != 0) & (slot < need))  # (bound: memory safety)
    tie = (live & (k64 >= lo) & (k64 < top)).to(tl.int32)
    n_tie = tl.sum(tie, axis=0)
    if n_tie > 0:
        rank = tl.atomic_add(st + 4, n_tie.to(tl.int64), sem="relaxed") + tl.cumsum(tie, axis=0) - 1
        if USE_BUF:
            keep = (tie != 0) & (rank < CAP)
            tl.store(bkey_row + rank, key, mask=keep)
            tl.store(bpos_row + rank, cand.to(tl.int32), mask=keep)
        else:
            tl.store(out_row + (above + rank) * sok, cand.to(tl.int32), mask=(tie != 0) & (above + rank < need))


@triton.jit
def _compact_kernel(
    scores_ptr, pos_ptr, tpos_ptr, mask_ptr, state_ptr, hist_ptr, out_ptr, bkey_ptr, bpos_ptr,
    Hkv, N, L, sink, local, min_half, PROGS, R, K, WIN, CAP,
    ssb, ssh, ssn, spb, sph, spn, smb, smh, sml, sob, soh, sok,
    DONE: tl.constexpr,  # levels whose thresholds define the final bin
    BLOCK: tl.constexpr, HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    MASK_HEADS: tl.constexpr, INT_KEYS: tl.constexpr, U8: tl.constexpr,
    USE_BUF: tl.constexpr,  # final-bin candidates go to the buffer for `resolve` (keys wider than 8 bits)
    USE_FOR: tl.constexpr,
):
    r, b, h, now, srow, prow, mrow = _row_setup(tpos_ptr, Hkv, scores_ptr, pos_ptr, mask_ptr, ssb, ssh, spb, sph, smb)
    st = state_ptr + r * STATE
    lo, wb, above, need = _path(st, hist_ptr, r, R, K, DONE, U8)
    lo = tl.where(need > 0, lo, 2**40)  # nothing to take: no key reaches the final bin
    top = lo + (tl.full([], 1, tl.int64) << wb)  # keys >= top lie above the final bin
    row = out_ptr + b * sob + h * soh
    out_row = row + WIN * sok
    bkey_row = bkey_ptr + r.to(tl.int64) * CAP
    bpos_row = bpos_ptr + r.to(tl.int64) * CAP
    base = tl.arange(0, BLOCK)
    if USE_FOR:
        for start in tl.range(tl.program_id(0) * BLOCK, N, PROGS * BLOCK):
            _compact_block(srow, prow, mrow, h, start + base, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                           st, out_row, sok, bkey_row, bpos_row, lo, top, above, need, CAP,
                           HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, INT_KEYS, USE_BUF)
    else:
        start = tl.program_id(0) * BLOCK
        while start < N:
            _compact_block(srow, prow, mrow, h, start + base, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                           st, out_row, sok, bkey_row, bpos_row, lo, top, above, need, CAP,
                           HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, INT_KEYS, USE_BUF)
            start += PROGS * BLOCK
    if tl.program_id(0) == 0:  # window (reference order: sink, then now-local+1 .. now) and padding
        w0 = 0
        while w0 < WIN:
            j = w0 + tl.arange(0, WIN_BLOCK)
            in_sink = j < sink
            p = tl.where(in_sink, j.to(tl.int64), now - local + 1 + (j - sink))
            ok = (j < WIN) & (p >= 0) & (p <= now) & (in_sink | (p >= sink))
            if HAS_MASK:
                ok = mask_readable(mrow, 0, h, tl.minimum(tl.maximum(p, 0), L - 1), ok, 0, smh, sml,
                                   min_half, MASK_HEADS, MASK_BOOL)
            tl.store(row + j * sok, tl.where(ok, p, -1).to(tl.int32), mask=j < WIN)
            w0 += WIN_BLOCK
        p0 = need
        while p0 < K:
            j = p0 + tl.arange(0, WIN_BLOCK)
            tl.store(out_row + j * sok, tl.full([WIN_BLOCK], -1, tl.int32), mask=j < K)
            p0 += WIN_BLOCK


@triton.jit
def _resolve_kernel(
    state_ptr, hist_ptr, out_ptr, bkey_ptr, bpos_ptr, Hkv, R, K, WIN, CAP, sob, soh, sok,
    DONE: tl.constexpr, CAP_P2: tl.constexpr,
):
    """One program per row: the best `need - above` final-bin candidates, exactly (a descending
    sort of (key, buffer slot) pairs); by arrival when the bin overflowed the buffer."""
    r = tl.program_id(0)
    st = state_ptr + r * STATE
    lo, wb, above, need = _path(st, hist_ptr, r, R, K, DONE, False)
    m = need - above
    n = tl.load(st + 4)
    b = (r // Hkv).to(tl.int64)
    h = (r % Hkv).to(tl.int64)
    out_row = out_ptr + b * sob + h * soh + WIN * sok
    if m > 0:
        i = tl.arange(0, CAP_P2)
        live = i < tl.minimum(n, CAP)
        key = tl.load(bkey_ptr + r.to(tl.int64) * CAP + i, mask=live, other=KEY_NONE)
        if n <= CAP:
            packed = (key.to(tl.int64) << 32) | (i.to(tl.int64) * -1 + (CAP_P2 - 1))  # equal keys: earlier slot first
            order = tl.sort(packed, descending=True)
            take = (order & 0xFFFFFFFF).to(tl.int32) * -1 + (CAP_P2 - 1)
        else:
            take = i
        p = tl.load(bpos_ptr + r.to(tl.int64) * CAP + take, mask=(i < m) & (take < tl.minimum(n, CAP)), other=-1)
        tl.store(out_row + (above + i) * sok, p, mask=i < m)


# ------------------------------------------------------------------------------ launcher
def select_topk_supported(scores, pos, k, sink, local, mask=None, positions=None) -> bool:
    return (
        on_kernel_device(scores, pos, mask, positions)
        and scores.dim() == 3
        and scores.dtype in SCORE_DTYPES
        and pos.dim() == 1 and pos.shape[0] >= 1 and not pos.is_floating_point() and pos.dtype != torch.bool
        and k > 0 and sink >= 0 and local >= 0
        and (mask is None or mask.dtype == torch.bool or mask.dtype in FLOAT_DTYPES)
        and (positions is None or (positions.shape == scores.shape and not positions.is_floating_point()
                                   and positions.dtype != torch.bool))
        and scores.shape[-1] < 2**31 - 2 * (k + sink + local)
    )


def select_topk(scores, pos, k, sink, local, mask=None, positions=None):
    """reference.select_topk: [B,Hkv,sink+local+k] int32 window + top-k positions, -1 padded."""
    B, Hkv, N = scores.shape
    R = B * Hkv
    dev = scores.device
    WIN = sink + local
    out = torch.empty(B, Hkv, WIN + k, dtype=torch.int32, device=dev)
    if R == 0:
        return out
    u8 = scores.dtype == torch.uint8
    levels = 1 if u8 else LEVELS
    state = torch.zeros(R, STATE.value, dtype=torch.int64, device=dev)
    if not u8:
        state[:, 0] = 2**31 - 1  # kmin starts high, kmax low
        state[:, 1] = -(2**31)
    hist = torch.zeros(levels, R, NB.value, dtype=torch.int32, device=dev)
    cap = 1 if u8 else BUF
    bkey = torch.empty(R, cap, dtype=torch.int32, device=dev)
    bpos = torch.empty(R, cap, dtype=torch.int32, device=dev)
    # Inductor's analysis of what a user kernel writes counts every pointer passed to a helper whose
    # result feeds a store address as written; these kernels do that, so they get private copies of
    # their small inputs: no graph input (cache position, mask) or view (a Prism pool) is then
    # functionalised as mutated, which would copy it back, skip CUDA graphs, or alias a stale view.
    pos = pos[-1:].clone()
    if mask is not None and mask.dtype != torch.bool:  # (bool masks are copied by MaskArgs)
        mask = mask.clone()
    ma = MaskArgs(mask, Hkv, scores)
    L = mask.shape[-1] if mask is not None else 1
    has_pos = positions is not None
    if has_pos:
        positions = positions.clone(memory_format=torch.contiguous_format)
    pos_t = positions if has_pos else scores
    sp = positions.stride() if has_pos else (0, 0, 0)
    block = BLOCK_U8 if u8 else BLOCK_WIDE
    progs = programs_per_row(R, triton.cdiv(N, block), dev, waves=STREAM_WAVES)
    flags = dict(HAS_POS=has_pos, HAS_MASK=ma.present, MASK_BOOL=ma.is_bool, MASK_HEADS=ma.heads,
                 INT_KEYS=not scores.is_floating_point(), BLOCK=block, USE_FOR=not interpreting(),
                 num_warps=8 if u8 else 4, num_stages=STREAM_STAGES)
    row = (Hkv, N, L, sink, local, ma.min_half, progs)
    strides = (*scores.stride(), *sp, ma.sb, ma.sh, ma.sl)
    head = (scores, pos_t, pos, ma.tensor, state)
    wt = torch.library.wrap_triton
    if not u8:
        wt(_minmax_kernel)[(progs, R)](*head, *row, *strides, **flags)
    for level in range(levels):
        wt(_hist_kernel)[(progs, R)](*head, hist, *row, R, k, *strides, LEVEL=level, U8=u8, **flags)
    wt(_compact_kernel)[(progs, R)](
        *head, hist, out, bkey, bpos, *row, R, k, WIN, cap, *strides, *out.stride(),
        DONE=levels, U8=u8, USE_BUF=not u8, **flags,
    )
    if not u8:
        wt(_resolve_kernel)[(R,)](state, hist, out, bkey, bpos, Hkv, R, k, WIN, cap, *out.stride(),
                                  DONE=levels, CAP_P2=pow2(cap), num_warps=4)
    return out
