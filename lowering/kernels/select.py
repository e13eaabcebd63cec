"""Top-k selection of cache positions per (batch, KV head) row: sink + local window + top-k.

No sort, and no histogram over the whole row. Every score becomes an order-preserving int32 key
(the float32 bit pattern with the negative half flipped; ineligible candidates get a key below
-inf). Then, per row:

1. `sample`   (one program per row) reads a stratified sample of S candidates (S/8 runs of 8
              contiguous ones; the whole row when N <= S), and bisects it for two keys that bracket
              the k-th largest key of the row with high probability (an 8-way search): T_hi at
              sample rank r - delta, T_lo at rank r + delta, r = k S / N. When N <= S the bracket is exact
              (T_lo = T_hi = the k-th key). It also zeroes the row's counters.
2. `filter`   (several programs per row, grid-stride, one pass over the scores) writes every
              candidate above T_hi straight into the output (slots from an atomic counter), appends
              (key, position) of every candidate inside [T_lo, T_hi] to a per-row buffer of CAP
              entries, and counts the eligible candidates.
3. `resolve`  (one program per row) writes the sink/local window, checks the bracket held (above
              <= k <= above + inside, buffer not overflowed), picks the missing k - above entries
              from the buffer (search for the exact threshold key, ties broken by buffer order;
              a bracket of one key value takes any of them), pads with -1, or flags the row.
4. `fallback` (one program per row; returns at once unless flagged) redoes a flagged row exactly
              by bisection over the whole row. Rare: the sample missed, or a wide bracket held more
              than CAP candidates. Correct always, slow (one SM per row, ~32 passes over the row).

One read of the scores (plus the sample), cheap per-element work (compare, cumsum), so the pass is
bandwidth-bound; integer (Hamming) and float scores take the same path. Ties at the threshold are
broken arbitrarily, the order inside the top-k part is arbitrary, as the reference allows.
"""

from __future__ import annotations

import math

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

# (constexpr: jit code may only read globals that are)
KEY_NONE = tl.constexpr(-(2**31))  # not a candidate (ineligible, or score -inf / negative NaN)
KEY_NEGINF = tl.constexpr(-2139095041)  # ordered key of float32 -inf (0xFF800000, low 31 bits flipped)
KEY_MAX = tl.constexpr(2**31 - 1)

SAMPLE = 4096  # sampled candidates per row (one program holds them in registers)
SAMPLE_RUN = 8  # contiguous candidates per sample run: one 32-byte sector; short runs keep clustered
#                scores (a relevant passage) from inflating the sample's variance
DELTA_SIGMA = 5.0  # bracket half-width: DELTA_SIGMA * sqrt(r) + r * DELTA_REL + DELTA_ABS sample ranks
DELTA_REL = 1.0 / 16
DELTA_ABS = 8.0
FILTER_BLOCK = 1024
RESOLVE_BLOCK = 16384  # bracket candidates a resolve program bisects in registers (more: looped from L2)
SCAN_BLOCK = 2048  # chunk of the looped paths (window, copies, resolve overflow, fallback)
SEARCH_WAYS = 8  # thresholds per block-wide count in the sample / resolve searches

# Flags shared by the selection kernels (constexpr, so each combination compiles only its code):
#   HAS_POS     candidates are positions[b, h, :] (a Prism pool) rather than slots 0..N-1
#   HAS_MASK    gather the mask at each candidate (and window position): a position is eligible
#               when any query head of the KV head may read it (reference.valid_positions)
#   MASK_BOOL   bool mask (read as uint8) vs additive float (masked when <= finfo.min / 2)
#   MASK_HEADS  mask heads per KV head: G for a per-query-head mask, else 1 (broadcast, stride 0)
SCORE_DTYPES = FLOAT_DTYPES + (torch.float64, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


# ------------------------------------------------------------------------------ device helpers
@triton.jit
def _row_keys(
    scores_row, pos_row, mask_ptr_b, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
    HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
):
    """(ordered key, cache position) of candidates `offs` of one row; KEY_NONE where not eligible."""
    inb = offs < N
    if HAS_POS:
        cand = tl.load(pos_row + offs.to(tl.int64) * spn, mask=inb, other=-1).to(tl.int64)
    else:
        cand = offs.to(tl.int64)
    elig = inb & (cand >= sink) & (cand <= now - local) & (cand >= 0)
    if HAS_MASK:
        col = tl.minimum(tl.maximum(cand, 0), L - 1)
        elig = mask_readable(mask_ptr_b, 0, h, col, elig, 0, smh, sml, min_half, MASK_HEADS, MASK_BOOL)
    s = tl.load(scores_row + offs.to(tl.int64) * ssn, mask=elig, other=0).to(tl.float32)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    # an eligible -inf is never chosen (reference: `top > -inf`)
    key = tl.where(elig & (key > KEY_NEGINF), key, KEY_NONE)
    return key, cand


@triton.jit
def _search_regs(key, j, lo, hi, slack, WAYS: tl.constexpr):
    """A key t in [lo, hi] with j <= count(key >= t) <= j + slack, keys in registers. With slack 0,
    count(key >= t) >= j and count(key > t) <= j: a top-j cut (take every key > t, then keys == t
    up to j). Returns lo when count(key >= lo) < j.

    WAYS-way search: each step counts the keys at WAYS thresholds in one block-wide reduction and
    keeps the sub-range holding the answer (log2(WAYS) bits per reduction, the latency that
    matters in these one-program-per-row kernels). Callers start from the keys' min / max.
    """
    i = tl.arange(0, WAYS)
    done = lo >= hi
    while not done:
        span = hi - lo + 1
        t = lo + (span * i) // WAYS  # t[0] = lo
        c = tl.sum((key[:, None] >= t[None, :]).to(tl.int32), axis=0)
        ok = c >= j  # non-increasing in i; equal thresholds give equal counts, so the largest i of a
        best = tl.max(tl.where(ok, i, 0), axis=0)  # run is taken and the next threshold is larger
        c_best = tl.sum(tl.where(i == best, c, 0), axis=0)
        hi = tl.where(best == WAYS - 1, hi, lo + (span * (best + 1)) // WAYS - 1)
        lo = lo + (span * best) // WAYS
        done = (lo >= hi) | ((c_best >= j) & (c_best <= j + slack))
    return lo


@triton.jit
def _count_ge_buf(key_ptr, n, t, BLOCK: tl.constexpr):
    c = tl.zeros([], tl.int32)
    start = 0
    while start < n:
        offs = start + tl.arange(0, BLOCK)
        k = tl.load(key_ptr + offs, mask=offs < n, other=KEY_NONE)
        c += tl.sum((k >= t).to(tl.int32), axis=0)
        start += BLOCK
    return c


@triton.jit
def _fill(out_row, sok, lo, hi, value, BLOCK: tl.constexpr):
    start = lo
    while start < hi:
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_row + offs * sok, tl.full([BLOCK], value, tl.int32), mask=offs < hi)
        start += BLOCK


# ------------------------------------------------------------------------------ kernels
@triton.jit
def _sample_kernel(
    scores_ptr, pos_ptr, tpos_ptr, mask_ptr, state_ptr, cnt_ptr,
    Hkv, N, L, now_off, sink, local, min_half, RANK_HI, RANK_LO, SLACK, RUN_STRIDE,
    ssb, ssh, ssn, spb, sph, spn, smb, smh, sml,
    S: tl.constexpr,  # sampled candidates (all of them in registers)
    WAYS: tl.constexpr,  # thresholds counted per block-wide reduction of the searches
    RUN: tl.constexpr,  # contiguous candidates per sample run
    HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
):
    r = tl.program_id(0)
    b = (r // Hkv).to(tl.int64)
    h = (r % Hkv).to(tl.int64)
    now = tl.load(tpos_ptr + now_off).to(tl.int64)
    c4 = tl.arange(0, 4)
    tl.store(cnt_ptr + r * 4 + c4, tl.zeros([4], tl.int32))
    j = tl.arange(0, S)
    offs = (j // RUN) * RUN_STRIDE + j % RUN  # RUN_STRIDE = RUN when the sample is the whole row
    key, cand = _row_keys(
        scores_ptr + b * ssb + h * ssh, pos_ptr + b * spb + h * sph, mask_ptr + b * smb, h, offs,
        N, L, now, sink, local, min_half, ssn, spn, smh, sml,
        HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS,
    )
    valid = key > KEY_NEGINF
    n_s = tl.sum(valid.to(tl.int32), axis=0)
    lo0 = tl.min(tl.where(valid, key, KEY_MAX), axis=0).to(tl.int64)  # the answers lie within the keys
    hi0 = tl.max(key, axis=0).to(tl.int64)
    # T_hi may sit up to SLACK ranks above RANK_HI, T_lo up to SLACK below RANK_LO: the bracket only
    # widens, and the early stop saves block-wide counts
    t_hi = _search_regs(key, tl.maximum(RANK_HI - SLACK, 1), lo0, hi0, SLACK, WAYS)
    t_hi = tl.where(RANK_HI < 1, KEY_MAX, tl.where(RANK_HI > n_s, KEY_NEGINF, t_hi))
    t_lo = _search_regs(key, RANK_LO, lo0, hi0, SLACK, WAYS)
    t_lo = tl.where(RANK_LO < 1, KEY_MAX, tl.where(RANK_LO > n_s, KEY_NEGINF, t_lo))
    tl.store(state_ptr + r * 2, t_lo.to(tl.int32))
    tl.store(state_ptr + r * 2 + 1, t_hi.to(tl.int32))


@triton.jit
def _filter_block(
    scores_row, pos_row, mask_b, h, start, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
    cnt_row, out_row, sok, ckey_row, cpos_row, t_lo, t_hi, KK, CAP,
    BLOCK: tl.constexpr, HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    MASK_HEADS: tl.constexpr,
):
    """One block of the filter pass; returns its count of eligible candidates."""
    offs = start + tl.arange(0, BLOCK)
    key, cand = _row_keys(
        scores_row, pos_row, mask_b, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
        HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS,
    )
    above = (key > t_hi).to(tl.int32)
    n_above = tl.sum(above, axis=0)
    if n_above > 0:
        base = tl.atomic_add(cnt_row, n_above, sem="relaxed")
        slot = base + tl.cumsum(above, axis=0) - 1
        tl.store(out_row + slot * sok, cand.to(tl.int32), mask=(above != 0) & (slot < KK))
    inside = ((key >= tl.maximum(t_lo, KEY_NEGINF + 1)) & (key <= t_hi)).to(tl.int32)
    n_inside = tl.sum(inside, axis=0)
    if n_inside > 0:
        base = tl.atomic_add(cnt_row + 1, n_inside, sem="relaxed")
        slot = base + tl.cumsum(inside, axis=0) - 1
        keep = (inside != 0) & (slot < CAP)
        tl.store(ckey_row + slot, key, mask=keep)
        tl.store(cpos_row + slot, cand.to(tl.int32), mask=keep)
    return tl.sum((key > KEY_NEGINF).to(tl.int32), axis=0)


@triton.jit
def _filter_kernel(
    scores_ptr, pos_ptr, tpos_ptr, mask_ptr, out_ptr, state_ptr, cnt_ptr, ckey_ptr, cpos_ptr,
    Hkv, N, L, now_off, sink, local, min_half, KK, WIN, CAP, PROGS,
    ssb, ssh, ssn, spb, sph, spn, smb, smh, sml, sob, soh, sok,
    BLOCK: tl.constexpr,  # candidates per step; one atomic per step and category reserves output slots
    HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
    USE_FOR: tl.constexpr,  # pipelined `for` on GPU; `while` under the interpreter
):
    pid = tl.program_id(0)
    r = tl.program_id(1)
    b = (r // Hkv).to(tl.int64)
    h = (r % Hkv).to(tl.int64)
    now = tl.load(tpos_ptr + now_off).to(tl.int64)
    t_lo = tl.load(state_ptr + r * 2)
    t_hi = tl.load(state_ptr + r * 2 + 1)
    scores_row = scores_ptr + b * ssb + h * ssh
    pos_row = pos_ptr + b * spb + h * sph
    mask_b = mask_ptr + b * smb
    out_row = out_ptr + b * sob + h * soh + WIN * sok
    ckey_row = ckey_ptr + r.to(tl.int64) * CAP
    cpos_row = cpos_ptr + r.to(tl.int64) * CAP
    cnt_row = cnt_ptr + r * 4
    n_valid = tl.zeros([], tl.int32)
    if USE_FOR:
        for start in tl.range(pid * BLOCK, N, PROGS * BLOCK):  # grid-stride
            n_valid += _filter_block(
                scores_row, pos_row, mask_b, h, start, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                cnt_row, out_row, sok, ckey_row, cpos_row, t_lo, t_hi, KK, CAP,
                BLOCK, HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS,
            )
    else:
        start = pid * BLOCK
        while start < N:
            n_valid += _filter_block(
                scores_row, pos_row, mask_b, h, start, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                cnt_row, out_row, sok, ckey_row, cpos_row, t_lo, t_hi, KK, CAP,
                BLOCK, HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS,
            )
            start += PROGS * BLOCK
    tl.atomic_add(cnt_row + 2, n_valid, sem="relaxed")


@triton.jit
def _take_from_buffer(ckey_row, cpos_row, n, thr, take_eq, out_row, sok, o_gt, o_eq, BLOCK: tl.constexpr):
    """Write buffer entries with key > thr, and the first `take_eq` entries equal to thr."""
    seen_eq = tl.zeros([], tl.int32)
    start = 0
    while start < n:
        offs = start + tl.arange(0, BLOCK)
        live = offs < n
        k = tl.load(ckey_row + offs, mask=live, other=KEY_NONE)
        p = tl.load(cpos_row + offs, mask=live, other=-1)
        gt = (k > thr).to(tl.int32)
        eq = (k == thr).to(tl.int32)
        rank_gt = tl.cumsum(gt, axis=0) - 1
        rank_eq = seen_eq + tl.cumsum(eq, axis=0) - 1
        tl.store(out_row + (o_gt + rank_gt) * sok, p, mask=gt != 0)
        tl.store(out_row + (o_eq + rank_eq) * sok, p, mask=(eq != 0) & (rank_eq < take_eq))
        o_gt += tl.sum(gt, axis=0)
        seen_eq += tl.sum(eq, axis=0)
        start += BLOCK


@triton.jit
def _resolve_kernel(
    tpos_ptr, mask_ptr, out_ptr, state_ptr, cnt_ptr, ckey_ptr, cpos_ptr, fail_ptr,
    Hkv, L, now_off, sink, local, min_half, K, KK, WIN, CAP,
    smb, smh, sml, sob, soh, sok,
    RES_BLOCK: tl.constexpr,  # bracket candidates searched in registers; beyond, a looped bisection
    WAYS: tl.constexpr,
    BLOCK: tl.constexpr,  # chunk of the window / padding / copy loops
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
):
    r = tl.program_id(0)
    b = (r // Hkv).to(tl.int64)
    h = (r % Hkv).to(tl.int64)
    now = tl.load(tpos_ptr + now_off).to(tl.int64)
    row = out_ptr + b * sob + h * soh
    # sink + local window (reference order): sink positions, then now-local+1 .. now
    start = 0
    while start < WIN:
        i = start + tl.arange(0, BLOCK)
        live = i < WIN
        in_sink = i < sink
        p = tl.where(in_sink, i.to(tl.int64), now - local + 1 + (i - sink))
        ok = live & (p >= 0) & (p <= now) & (in_sink | (p >= sink))
        if HAS_MASK:
            ok = mask_readable(mask_ptr + b * smb, 0, h, tl.minimum(tl.maximum(p, 0), L - 1), ok, 0, smh, sml,
                               min_half, MASK_HEADS, MASK_BOOL)
        tl.store(row + i * sok, tl.where(ok, p, -1).to(tl.int32), mask=live)
        start += BLOCK
    # top-k part
    out_row = row + WIN * sok
    n_above = tl.load(cnt_ptr + r * 4)
    n_inside = tl.load(cnt_ptr + r * 4 + 1)
    n_valid = tl.load(cnt_ptr + r * 4 + 2)
    t_lo = tl.load(state_ptr + r * 2)
    t_hi = tl.load(state_ptr + r * 2 + 1)
    lo_eff = tl.maximum(t_lo, KEY_NEGINF + 1)
    need = tl.minimum(n_valid, KK)
    m = need - n_above
    single = lo_eff >= t_hi  # the bracket is one key value: any m of its entries will do
    ok = (n_above <= need) & (m <= n_inside) & tl.where(single, m <= CAP, n_inside <= CAP)
    ckey_row = ckey_ptr + r.to(tl.int64) * CAP
    cpos_row = cpos_ptr + r.to(tl.int64) * CAP
    if ok:
        if m > 0:
            if single:
                start = 0
                while start < m:
                    i = start + tl.arange(0, BLOCK)
                    p = tl.load(cpos_row + i, mask=i < m, other=-1)
                    tl.store(out_row + (n_above + i) * sok, p, mask=i < m)
                    start += BLOCK
            else:
                lo = lo_eff.to(tl.int64)
                hi = t_hi.to(tl.int64)
                if n_inside <= RES_BLOCK:
                    jj = tl.arange(0, RES_BLOCK)
                    live = jj < n_inside
                    keys = tl.load(ckey_row + jj, mask=live, other=KEY_NONE)
                    lo = tl.min(tl.where(live, keys, KEY_MAX), axis=0).to(tl.int64)
                    hi = tl.max(keys, axis=0).to(tl.int64)
                    thr = _search_regs(keys, m, lo, hi, 0, WAYS)
                    n_gt = tl.sum((keys > thr).to(tl.int32), axis=0)
                else:
                    while lo < hi:
                        mid = lo + (hi - lo + 1) // 2
                        okm = _count_ge_buf(ckey_row, n_inside, mid, BLOCK) >= m
                        lo = tl.where(okm, mid, lo)
                        hi = tl.where(okm, hi, mid - 1)
                    thr = lo
                    n_gt = _count_ge_buf(ckey_row, n_inside, thr + 1, BLOCK)
                _take_from_buffer(ckey_row, cpos_row, n_inside, thr, m - n_gt, out_row, sok,
                                  n_above, n_above + n_gt, BLOCK)
        _fill(out_row, sok, need, K, -1, BLOCK)
        tl.store(fail_ptr + r, 0)
    else:
        tl.store(fail_ptr + r, 1)


@triton.jit
def _fallback_kernel(
    scores_ptr, pos_ptr, tpos_ptr, mask_ptr, out_ptr, state_ptr, cnt_ptr, fail_ptr,
    Hkv, N, L, now_off, sink, local, min_half, K, KK, WIN,
    ssb, ssh, ssn, spb, sph, spn, smb, smh, sml, sob, soh, sok,
    BLOCK: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
):
    r = tl.program_id(0)
    if tl.load(fail_ptr + r) != 0:
        b = (r // Hkv).to(tl.int64)
        h = (r % Hkv).to(tl.int64)
        now = tl.load(tpos_ptr + now_off).to(tl.int64)
        scores_row = scores_ptr + b * ssb + h * ssh
        pos_row = pos_ptr + b * spb + h * sph
        mask_b = mask_ptr + b * smb
        out_row = out_ptr + b * sob + h * soh + WIN * sok
        n_above = tl.load(cnt_ptr + r * 4)
        n_inside = tl.load(cnt_ptr + r * 4 + 1)
        n_valid = tl.load(cnt_ptr + r * 4 + 2)  # exact: the filter counted every eligible candidate
        t_lo = tl.load(state_ptr + r * 2).to(tl.int64)
        t_hi = tl.load(state_ptr + r * 2 + 1).to(tl.int64)
        lo_eff = tl.maximum(t_lo, KEY_NEGINF + 1)
        need = tl.minimum(n_valid, KK)
        # the filter's exact counts still say on which side of the bracket the threshold lies
        lo = tl.full([], KEY_NEGINF + 1, tl.int64)
        hi = tl.full([], KEY_MAX, tl.int64)
        if n_above >= need:
            lo = tl.minimum(t_hi + 1, KEY_MAX)
        elif n_above + n_inside >= need:
            lo = lo_eff
            hi = t_hi
        else:
            hi = tl.maximum(lo_eff - 1, KEY_NEGINF + 1)
        if need > 0:
            while lo < hi:
                mid = lo + (hi - lo + 1) // 2
                c = tl.zeros([], tl.int32)
                start = 0
                while start < N:
                    offs = start + tl.arange(0, BLOCK)
                    key, cand = _row_keys(
                        scores_row, pos_row, mask_b, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                        HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS,
                    )
                    c += tl.sum((key >= mid).to(tl.int32), axis=0)
                    start += BLOCK
                okm = c >= need
                lo = tl.where(okm, mid, lo)
                hi = tl.where(okm, hi, mid - 1)
            thr = lo.to(tl.int32)
            # pass 1: entries above the threshold; pass 2: fill up with entries equal to it
            o_gt = tl.zeros([], tl.int32)
            start = 0
            while start < N:
                offs = start + tl.arange(0, BLOCK)
                key, cand = _row_keys(
                    scores_row, pos_row, mask_b, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                    HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS,
                )
                gt = (key > thr).to(tl.int32)
                tl.store(out_row + (o_gt + tl.cumsum(gt, axis=0) - 1) * sok, cand.to(tl.int32), mask=gt != 0)
                o_gt += tl.sum(gt, axis=0)
                start += BLOCK
            o = o_gt
            start = 0
            while start < N:
                offs = start + tl.arange(0, BLOCK)
                key, cand = _row_keys(
                    scores_row, pos_row, mask_b, h, offs, N, L, now, sink, local, min_half, ssn, spn, smh, sml,
                    HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS,
                )
                eq = (key == thr).to(tl.int32)
                slot = o + tl.cumsum(eq, axis=0) - 1
                tl.store(out_row + slot * sok, cand.to(tl.int32), mask=(eq != 0) & (slot < need))
                o += tl.sum(eq, axis=0)
                start += BLOCK
        _fill(out_row, sok, need, K, -1, BLOCK)


# ------------------------------------------------------------------------------ launchers
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


def bracket_ranks(kk: int, n: int, sample: int) -> tuple[int, int]:
    """Sample ranks (1-based) whose keys bracket the kk-th largest of n candidates (host ints)."""
    if kk >= n:
        return n + 1, n + 1  # every eligible candidate is taken: both keys -inf, all of them "above"
    if n <= sample:
        return kk, kk  # the sample is the row: exact threshold
    rf = kk * sample / n
    delta = DELTA_SIGMA * math.sqrt(rf) + DELTA_REL * rf + DELTA_ABS
    return math.floor(rf - delta), math.ceil(rf + delta)


def select_topk_impl(scores, pos, k, sink, local, mask=None, positions=None, *,
                     sample: int = SAMPLE, run: int = SAMPLE_RUN, ranks=None, cap=None):
    """select_topk plus its diagnostics: (out, fail [R] int32, counters [R, 4] int32).

    `sample`, `run`, `ranks` (override of the two bracket ranks) and `cap` exist for tests (force
    the sampled path on small rows, force misses and overflows) and for tuning on the GPU.
    """
    B, Hkv, N = scores.shape
    R = B * Hkv
    dev = scores.device
    WIN = sink + local
    kk = min(k, N)
    out = torch.empty(B, Hkv, WIN + k, dtype=torch.int32, device=dev)
    fail = torch.empty(R, dtype=torch.int32, device=dev)
    cnt = torch.empty(R, 4, dtype=torch.int32, device=dev)
    if R == 0:
        return out, fail, cnt
    S = pow2(min(sample, max(N, 1)))
    run = min(run, S)
    exact = N <= S
    rank_hi, rank_lo = ranks if ranks is not None else bracket_ranks(kk, N, S)
    slack = 0 if exact or ranks is not None else max(1, (rank_lo - rank_hi) // 8)
    run_stride = run if exact else N // (S // run)
    if cap is None:
        cap = N if exact else min(N, max(2 * kk + 1024, N // 8))
    cap = max(int(cap), 1)
    state = torch.empty(R, 2, dtype=torch.int32, device=dev)
    ckey = torch.empty(R, cap, dtype=torch.int32, device=dev)
    cpos = torch.empty(R, cap, dtype=torch.int32, device=dev)
    ma = MaskArgs(mask, Hkv, scores)
    L = mask.shape[-1] if mask is not None else 1
    has_pos = positions is not None
    pos_t = positions if has_pos else scores
    sp = positions.stride() if has_pos else (0, 0, 0)
    now_off = (pos.shape[0] - 1) * pos.stride(0)
    flags = dict(HAS_POS=has_pos, HAS_MASK=ma.present, MASK_BOOL=ma.is_bool, MASK_HEADS=ma.heads)
    common = (Hkv, N, L, now_off, sink, local, ma.min_half)
    strides = (*scores.stride(), *sp, ma.sb, ma.sh, ma.sl)
    wt = torch.library.wrap_triton
    wt(_sample_kernel)[(R,)](
        scores, pos_t, pos, ma.tensor, state, cnt,
        *common, rank_hi, rank_lo, slack, run_stride,
        *strides,
        S=S, WAYS=SEARCH_WAYS, RUN=run, **flags,
        num_warps=8,
    )
    progs = programs_per_row(R, triton.cdiv(N, FILTER_BLOCK), dev, waves=STREAM_WAVES)
    wt(_filter_kernel)[(progs, R)](
        scores, pos_t, pos, ma.tensor, out, state, cnt, ckey, cpos,
        *common, kk, WIN, cap, progs,
        *strides, *out.stride(),
        BLOCK=FILTER_BLOCK, **flags, USE_FOR=not interpreting(),
        num_warps=4, num_stages=STREAM_STAGES,
    )
    wt(_resolve_kernel)[(R,)](
        pos, ma.tensor, out, state, cnt, ckey, cpos, fail,
        Hkv, L, now_off, sink, local, ma.min_half, k, kk, WIN, cap,
        ma.sb, ma.sh, ma.sl, *out.stride(),
        RES_BLOCK=RESOLVE_BLOCK, WAYS=SEARCH_WAYS, BLOCK=SCAN_BLOCK,
        HAS_MASK=ma.present, MASK_BOOL=ma.is_bool, MASK_HEADS=ma.heads,
        num_warps=8,
    )
    wt(_fallback_kernel)[(R,)](
        scores, pos_t, pos, ma.tensor, out, state, cnt, fail,
        *common, k, kk, WIN,
        *strides, *out.stride(),
        BLOCK=SCAN_BLOCK, **flags,
        num_warps=8,
    )
    return out, fail, cnt


def select_topk(scores, pos, k, sink, local, mask=None, positions=None) -> torch.Tensor:
    """[B,Hkv,sink+local+k] int32: sink, local window, then the top-k eligible candidates (any order)."""
    return select_topk_impl(scores, pos, k, sink, local, mask, positions)[0]
