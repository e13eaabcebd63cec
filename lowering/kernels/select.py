"""Top-k selection of cache positions per (batch, KV head) row: sink + local window + top-k.

A deterministic radix select with no sort, no atomics and no zero-filled scratch. Every candidate
gets a ranking key (`reference.selection_keys`; 0 = not eligible): 8 bits for Hamming similarities
of up to 254 (the fused `hash_select` path), else 16 bits (float scores rounded to bfloat16, small
integers offset). The grid is (P, rows); program p of a row owns a contiguous chunk of its
candidates, whole blocks, so its loads stay aligned. The candidates of a cache row stop at the
query (pos[-1]) minus the local window: slots beyond, written or not, are never read.

  keys   each program writes its chunk's keys and the suffix-cumulative histogram of their top
         byte (count of keys >= b, for b in 0..255): a row of `cum` per program
  hist2  (16-bit keys) every program sums the row's histograms, finds the top byte t1 of the
         k-th key, and histograms the low byte of its chunk's keys whose top byte is t1
  select every program derives the k-th key t (the threshold), how many keys are above it (A) and
         equal to it (T), and from the programs before it how many of each came earlier. Keys
         above t are all taken; of the T ties m = k - A are taken, spread evenly over them in
         candidate order (`reference.choose`: a multiply-high per tie, no sort). A taken
         candidate's output slot is the number of taken ones before it, so the chosen list comes
         out in candidate order, the same on every run.

Program 0 of each row also writes the sink / local window and the -1 padding.

Adaptive budget (`mass` < 1, float scores that are attention masses; reference.trim_to_mass):
the key pass also sums each chunk's masses (the bfloat16 values of its keys), the select pass
writes the key of every candidate it takes beside it, and one program per row trims the list:
a 15-step bisection over the key space finds the largest key whose taken candidates at or above
it hold p of the row's mass, then the kept candidates are compacted in their order, -1 after.

Nested (`select_nested`, Prism's proposal: a pool of the best k and the best k_inner within it):
the inner selection is the best k_inner of the pool by the same keys, so the key pass and its
level-0 counts serve both; the deeper levels count twice (each its own prefix, into a second
`cum`), and the select pass writes both lists from one read of the keys. Where both cuts fall on
the same key, the inner list spreads its ties over the pool's taken ties, not over all of them.
From 128 rows the passes select the pool alone and one program a row takes the inner list from
the pool's keys (`_row_select_kernel`, the same choice; faster only where rows fill the GPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..reference import WORD_BITS
from .mass import group_mass, mass_logits, mass_scores_supported, row_stats
from .common import (
    FLOAT_DTYPES, PACKED_RUN, count, counts_total, counts_zero, eligible, interpreting, mask_readable, MaskView,
    octave, on_kernel_device, pdl, pdl_enter, pow2, programs_per_row, row_chunk, row_of, slots_eligible,
)

# `_row_select_kernel`, one program a row, walks its pool serially, so it pays only where rows alone
# fill the GPU; with few rows, many programs a row (the passes) spread it. bench/kernel_tuning.py times both.
ROW_MAX = 16384  # the largest pool it selects from
# (batch x KV heads) rows from which it is the default (bench/results/kernel-tuning-2026-12-01-rows.json)
ROW_MIN_ROWS = 128
ROW_CHUNK, ROW_WARPS = 4096, 16  # its passes' step (8 candidates a thread; `_take` counts a step in 16 bits) and width
MAX_PROGS = 64  # programs per row; each keeps one 256-entry row of counts per level
# with 256-bin levels: every program of a later pass reads all the row's counts, which costs more
# than more programs spread (bench/results/kernel-tuning-2026-12-01-select.json)
WIDE_PROGS = 16
WIN_BLOCK = tl.constexpr(256)
# Launch defaults (BLOCK, LEVEL_BITS, WAVES; HASH_BLOCK, HASH_LEVEL_BITS, HASH_WAVES): the float path
# reads 4-byte scores, so few wide levels win; the Hamming path is instruction-bound on its
# histogram, so 16-bin levels (two for 8-bit keys) and many programs win.
# kernel_tuning's best (bench/results/kernel-tuning-2026-11-30.json)
BLOCK = 2048  # candidates per step of every pass (all passes of one select cut the same chunks)
# A float selection over a cache row (not a pool) with fewer rows than the row kernel's takes
# blocks of WIDE_BLOCK where that still makes ~2 programs an SM (rows x blocks >= WIDE_MIN_PROGRAMS;
# a program takes 1-2 blocks under the default cap), and at up to WIDE_CAP_ROWS rows up to WIDE_CAP
# programs a row (one for each of a 128K row's 32 blocks; more would double the counts each later
# program reads, P_PAD); with fewer programs (32K at batch 1) BLOCK under WIDE_PROGS is faster.
# kernel_tuning's best (bench/results/kernel-tuning-2026-12-02.json)
WIDE_BLOCK, WIDE_MIN_PROGRAMS, WIDE_CAP, WIDE_CAP_ROWS = 4096, 256, 32, 8
LEVEL_BITS = 8  # bits per radix level: 16-bit keys in two
WAVES = 4
HASH_BLOCK, HASH_LEVEL_BITS, HASH_WAVES = 1024, 4, 16
# 8-bit Hamming keys in one 256-bin level where each program's chunk is at most HASH_ONE_LEVEL_BLOCKS
# blocks (at most HASH_WIDE_CAP programs a row: only the select pass reads their counts), else in
# two 16-bin levels: one level saves the level pass, but its 256-bin histogram costs more a block
# than the packed 16-bin counts, so one level loses where a program's chunk is long.
# Up to HASH_STRETCH_CAP programs a row where a few blocks past 32 x 4 would make chunks of 5.
# kernel_step's best at 32K-128K x batch 1-16 (bench/results/kernels-2026-12-03-1644-hash-lb8-cap32.json)
HASH_WIDE_CAP, HASH_ONE_LEVEL_BLOCKS, HASH_STRETCH_CAP = 32, 4, 40
SCORE_KIND = {torch.float32: 0, torch.float16: 0, torch.bfloat16: 0, torch.uint8: 1, torch.int8: 2, torch.int16: 3}


# ------------------------------------------------------------------------------ value helpers
@triton.jit
def float_key16(s):
    """16-bit key of float32 scores: the top half of their order-preserving int32 image."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, (bits >> 16) + 32768, (~bits) >> 16)


@triton.jit
def key_mass(key):
    """The bfloat16-truncated value of a nonnegative float score from its float_key16 (0 below)."""
    return tl.where(key > 32768, ((key - 32768) << 16).to(tl.float32, bitcast=True), 0.0)


@triton.jit
def threshold(rowcum, need, NB: tl.constexpr):
    """Largest bin b whose suffix count reaches `need`, and the count above that bin."""
    i = tl.arange(0, NB)
    t = tl.maximum(tl.max(tl.where(rowcum >= need, i, -1), axis=0), 0)
    above = tl.sum(tl.where(i == t + 1, rowcum, 0), axis=0)
    return t, above


@triton.jit
def descend(cum_ptr, deep_ptr, r, p, R, PROGS, K, DONE: tl.constexpr, LB: tl.constexpr, P_PAD: tl.constexpr):
    """Walk the first DONE radix levels of row r from the per-program suffix counts in `cum`
    ([levels, R, PROGS, 2^LB], a private scratch; levels after the first from `deep_ptr`, which is
    cum_ptr itself or a nested selection's own counts): the key prefix holding the k-th key, how
    many keys to take (min(k, eligible)), how many lie above the prefix, how many of those sit in
    the chunks of programs before p; and, at the last level, the row's and those chunks' ties."""
    NB: tl.constexpr = 1 << LB
    i = tl.arange(0, NB)
    pp = tl.arange(0, P_PAD)
    earlier = pp < p
    prefix = tl.zeros([], tl.int32)
    need = tl.zeros([], tl.int32)
    above = tl.zeros([], tl.int32)
    a_before = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    t_before = tl.zeros([], tl.int32)
    for lvl in tl.static_range(DONE):
        if lvl == 0:
            counts = cum_ptr + r * PROGS * NB
        else:
            counts = deep_ptr + (lvl * R + r) * PROGS * NB
        rowcum = tl.sum(tl.load(counts + pp[:, None] * NB + i[None, :], mask=(pp < PROGS)[:, None], other=0), axis=0)
        if lvl == 0:
            need = tl.minimum(tl.sum(tl.where(i == 0, rowcum, 0), axis=0), K)
        t, up = threshold(rowcum, need - above, NB)
        # the earlier chunks' counts at bins t + 1 and t: two column loads, not selects over the tile
        up_before = tl.sum(tl.load(counts + pp * NB + t + 1, mask=earlier & (t + 1 < NB), other=0), axis=0)
        a_before += up_before
        if lvl == DONE - 1:
            ties = tl.sum(tl.where(i == t, rowcum, 0), axis=0) - up
            t_before = tl.sum(tl.load(counts + pp * NB + t, mask=earlier, other=0), axis=0) - up_before
        above += up
        prefix = prefix * NB + t
    return prefix, need, above, a_before, ties, t_before


# ------------------------------------------------------------------------------ key pass (scores)
@triton.jit
def _score_keys_block(
    scores_row, pos_row, mask_b, keys_row, h, offs, lo_c, hi_c, first, now, sink, local, N, L, min_half,
    ssn, spn, smh, sml, c0, c1, c2, c3, top, inv, msum,
    HAS_POS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
    KIND: tl.constexpr, LB: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, TRIM: tl.constexpr,
):
    # Loads and the store cover the row's whole blocks (offs < N: in bounds, and a mask Triton can
    # vectorise), values outside [lo_c, hi_c) are masked: a block belongs to one program only.
    row = offs < N
    if HAS_POS:
        live = (offs >= lo_c) & (offs < hi_c)
        cand = tl.load(pos_row + offs * spn, mask=live, other=-1).to(tl.int32)
        elig = eligible(cand, live, first, now, sink, local, mask_b, h, L, min_half, smh, sml, HAS_MASK, MASK_BOOL, MASK_HEADS)
    else:
        elig = slots_eligible(offs, lo_c, hi_c, row, mask_b, h, min_half, smh, sml, HAS_MASK, MASK_BOOL, MASK_HEADS)
    if KIND == 0 or KIND == 4:
        if KIND == 0:
            s = tl.load(scores_row + offs * ssn, mask=row, other=0.0).to(tl.float32)
        else:  # mass_scores' values, from its logits and row statistics (what its normalise kernel writes)
            s = group_mass(scores_row, offs, row, N, top, inv, G, G_PAD)
        elig = elig & (s == s) & (s > float("-inf"))
        key = float_key16(s)
    elif KIND == 1:
        key = tl.load(scores_row + offs * ssn, mask=row, other=0).to(tl.int32) + 1
    elif KIND == 2:
        key = tl.load(scores_row + offs * ssn, mask=row, other=0).to(tl.int32) + 129
    else:  # int16: -32768 shares key 1 with -32767 (16-bit keys keep 0 for "not a candidate")
        key = tl.maximum(tl.load(scores_row + offs * ssn, mask=row, other=0).to(tl.int32) + 32768, 1)
    key = tl.where(elig, key, 0)
    tl.store(keys_row + offs, key.to(keys_row.dtype.element_ty), mask=row)
    if TRIM:  # the chunk's mass, as the selection ranks it
        msum += tl.sum(key_mass(key), axis=0)
    c0, c1, c2, c3 = count(c0, c1, c2, c3, key >> (16 - LB), elig, 1 << LB)
    return c0, c1, c2, c3, msum


@triton.jit
def _score_keys_kernel(
    scores_ptr, pos_ptr, tpos_ptr, start_ptr, mask_ptr, keys_ptr, cum_ptr, pm_ptr, pl_ptr, tot_ptr,
    Hkv, N, L, sink, local, min_half, PROGS, NSPLIT,
    ssb, ssh, ssn, spb, sph, spn, smb, smh, sml,
    BLOCK: tl.constexpr,
    LB: tl.constexpr,  # bits per radix level: 2^LB histogram bins (16-bit keys: 16 / LB levels)
    HAS_POS: tl.constexpr,  # candidates are positions[b, h, :] (a Prism pool) instead of cache slots 0..N-1
    HAS_START: tl.constexpr,  # per-batch first real position (left padding): the sink starts there
    HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    MASK_HEADS: tl.constexpr,  # mask heads per KV head (G for a per-head mask, else 1)
    KIND: tl.constexpr,  # 0 float scores (bf16-rounded keys), 1 uint8, 2 int8, 3 int16 (wide Hamming sums),
                         # 4 mass_scores from its logits scratch [R, G, N] and split statistics pm / pl (NSPLIT a row)
    G: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr,  # KIND 4: query heads per row, splits padded
    TRIM: tl.constexpr,  # adaptive budget: also write the chunk's mass to tot_ptr [R, PROGS]
    USE_FOR: tl.constexpr,  # pipelined `for` on GPU; `while` under the interpreter
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    p, r = tl.program_id(0), tl.program_id(1)
    b, h = row_of(r, Hkv)
    scores_row = scores_ptr + b * ssb + h * ssh
    pos_row = pos_ptr + b * spb + h * sph
    mask_b = mask_ptr + b * smb
    keys_row = keys_ptr + r.to(tl.int64) * N
    # the query's and the row's first position, loaded here: a helper given these pointers would seem to write them
    now, first = tl.load(tpos_ptr).to(tl.int32), tl.load(start_ptr + b, mask=HAS_START, other=0).to(tl.int32)
    lo_c, hi_c, blk, end = row_chunk(now, first, p, N, sink, local, PROGS, BLOCK, HAS_POS)
    base = tl.arange(0, BLOCK)
    if KIND == 4:
        top, inv = row_stats(pm_ptr, pl_ptr, r, NSPLIT, G, G_PAD, S_PAD)
    else:
        top = tl.zeros([G_PAD], tl.float32)
        inv = top
    c0, c1, c2, c3 = counts_zero(BLOCK, 1 << LB)
    msum = tl.zeros([], tl.float32)
    if USE_FOR:
        for i in tl.range(blk, end):
            c0, c1, c2, c3, msum = _score_keys_block(
                scores_row, pos_row, mask_b, keys_row, h, i * BLOCK + base, lo_c, hi_c, first, now, sink, local, N, L, min_half,
                ssn, spn, smh, sml, c0, c1, c2, c3, top, inv, msum,
                HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, KIND, LB, G, G_PAD, TRIM)
    else:
        while blk < end:
            c0, c1, c2, c3, msum = _score_keys_block(
                scores_row, pos_row, mask_b, keys_row, h, blk * BLOCK + base, lo_c, hi_c, first, now, sink, local, N, L,
                min_half, ssn, spn, smh, sml, c0, c1, c2, c3, top, inv, msum,
                HAS_POS, HAS_MASK, MASK_BOOL, MASK_HEADS, KIND, LB, G, G_PAD, TRIM)
            blk += 1
    acc = counts_total(c0, c1, c2, c3, 1 << LB)
    tl.store(cum_ptr + (r * PROGS + p) * (1 << LB) + tl.arange(0, 1 << LB), tl.cumsum(acc, 0, reverse=True))
    if TRIM:
        tl.store(tot_ptr + r * PROGS + p, msum)


# ------------------------------------------------------------------------------ deeper levels
@triton.jit
def _hist_block(keys_row, offs, N, prefix, prefix_in, c0, c1, c2, c3, d0, d1, d2, d3,
                SHIFT: tl.constexpr, LB: tl.constexpr, NESTED: tl.constexpr):
    """Count one block's digits under the prefix (and, nested, under the inner selection's: with
    256 bins both in one 512-bin histogram in c0, a key under both prefixes counted as the outer's)."""
    NB: tl.constexpr = 1 << LB
    # whole blocks: the key pass wrote 0 ("not a candidate") outside [lo_c, hi_c) in them
    key = tl.load(keys_row + offs, mask=offs < N, other=0).to(tl.int32) & 0xFFFF
    digit = (key >> SHIFT) & (NB - 1)
    # Non-candidates (key 0) fall in bin 0 under the prefix 0 only, which never moves a threshold:
    # the k-th key is a candidate's (>= 1), so where the prefix is 0 its digit here is >= 1 or a
    # lower level's digit is, and bins above the threshold's never hold key 0.
    m_out = (key >> (SHIFT + LB)) == prefix
    if NESTED:
        m_in = (key >> (SHIFT + LB)) == prefix_in
        if NB == 16:
            c0, c1, c2, c3 = count(c0, c1, c2, c3, digit, m_out, NB)
            d0, d1, d2, d3 = count(d0, d1, d2, d3, digit, m_in, NB)
        else:
            c0 += tl.histogram(tl.where(m_out, digit, NB + digit), 2 * NB, mask=m_out | m_in)
    else:
        c0, c1, c2, c3 = count(c0, c1, c2, c3, digit, m_out, NB)
    return c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _hist_kernel(
    tpos_ptr, start_ptr, keys_ptr, cum_ptr,
    Hkv, N, sink, local, K, K_IN, PROGS,
    LEVEL: tl.constexpr,  # this level's digit; the levels above come from their counts in `cum`
    KEY_BITS: tl.constexpr, LB: tl.constexpr, BLOCK: tl.constexpr, P_PAD: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_START: tl.constexpr,
    NESTED: tl.constexpr,  # also count for the inner selection (top K_IN), into the second half of `cum`
    USE_FOR: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    p, r, R = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    b, _ = row_of(r, Hkv)
    # the query's and the row's first position, loaded here: a helper given these pointers would seem to write them
    now, first = tl.load(tpos_ptr).to(tl.int32), tl.load(start_ptr + b, mask=HAS_START, other=0).to(tl.int32)
    lo_c, hi_c, blk, end = row_chunk(now, first, p, N, sink, local, PROGS, BLOCK, HAS_POS)
    NB: tl.constexpr = 1 << LB
    cum_in = cum_ptr + (KEY_BITS // LB) * R * PROGS * NB
    prefix, _, _, _, _, _ = descend(cum_ptr, cum_ptr, r, p, R, PROGS, K, LEVEL, LB, P_PAD)
    prefix_in = prefix
    if NESTED:
        prefix_in, _, _, _, _, _ = descend(cum_ptr, cum_in, r, p, R, PROGS, K_IN, LEVEL, LB, P_PAD)
    keys_row = keys_ptr + r.to(tl.int64) * N
    base = tl.arange(0, BLOCK)
    SHIFT: tl.constexpr = KEY_BITS - (LEVEL + 1) * LB
    if NESTED and NB != 16:
        c0 = tl.zeros([2 * NB], tl.int32)
        c1, c2, c3, d0, d1, d2, d3 = c0, c0, c0, c0, c0, c0, c0
    else:
        c0, c1, c2, c3 = counts_zero(BLOCK, NB)
        d0, d1, d2, d3 = counts_zero(BLOCK, NB)
    if USE_FOR:
        for j in tl.range(blk, end):
            c0, c1, c2, c3, d0, d1, d2, d3 = _hist_block(keys_row, j * BLOCK + base, N, prefix, prefix_in,
                                                         c0, c1, c2, c3, d0, d1, d2, d3, SHIFT, LB, NESTED)
    else:
        while blk < end:
            c0, c1, c2, c3, d0, d1, d2, d3 = _hist_block(keys_row, blk * BLOCK + base, N, prefix, prefix_in,
                                                         c0, c1, c2, c3, d0, d1, d2, d3, SHIFT, LB, NESTED)
            blk += 1
    if NESTED and NB != 16:
        halves = tl.reshape(c0, [2, NB])
        which = tl.arange(0, 2)[:, None]
        outer = tl.sum(tl.where(which == 0, halves, 0), axis=0)
        inner = tl.where(prefix_in == prefix, outer, tl.sum(tl.where(which == 1, halves, 0), axis=0))
    else:
        outer = counts_total(c0, c1, c2, c3, NB)
        inner = counts_total(d0, d1, d2, d3, NB)
    at = ((LEVEL * R + r) * PROGS + p) * NB + tl.arange(0, NB)
    tl.store(cum_ptr + at, tl.cumsum(outer, 0, reverse=True))
    if NESTED:
        tl.store(cum_in + at, tl.cumsum(inner, 0, reverse=True))


# ------------------------------------------------------------------------------ select pass
@triton.jit
def _spread_of(thr, m, T):
    """The tie rule of `reference.choose` for taking m of T ties at key thr (scalars): the
    threshold the select pass compares with and the multiplier c = ceil(m 2^32 / T) (uint32).
    When all ties are taken (m >= T, where c would not fit) they count as above: the threshold
    drops by one and c = 0 takes none of the keys equal to it."""
    every = m >= T
    c = ((m.to(tl.int64) << 32) + T - 1) // tl.maximum(T, 1)
    return tl.where(every, thr - 1, thr), tl.where(every, 0, c).to(tl.uint32)


@triton.jit
def _tie_rank(j, c):
    """(taken ties among the first j, floor(j c / 2^32); whether tie j is taken): one wide multiply. Tie j is taken when j c and
    (j + 1) c differ in their top 32 bits, i.e. when the low 32 bits of j c reach 2^32 - c."""
    prod = j.to(tl.uint32).to(tl.uint64) * c.to(tl.uint64)
    return (prod >> 32).to(tl.int32), prod.to(tl.uint32) > (0xFFFFFFFF - c.to(tl.int64)).to(tl.uint32)


@triton.jit
def _take(above, tie, cand, out_row, sok, c, a_run, t_run, key, key_row, KEYS: tl.constexpr):
    """Write the taken candidates of one block at their ranks: all `above`, and the ties that the
    spread rule takes (`_tie_rank`); KEYS: their keys too, at the same ranks of `key_row`. Returns
    the updated running counts and which ties were taken."""
    packed = above.to(tl.int32) + (tie.to(tl.int32) << 16)  # one scan for both counts
    ex = tl.cumsum(packed, 0) - packed
    a_ex = a_run + (ex & 0xFFFF)
    t_ex = t_run + (ex >> 16)
    ranked, next_taken = _tie_rank(t_ex, c)
    tie_taken = tie & next_taken
    tl.store(out_row + (a_ex + ranked).to(tl.int64) * sok, cand.to(tl.int32), mask=above | tie_taken)
    if KEYS:
        tl.store(key_row + a_ex + ranked, key.to(key_row.dtype.element_ty), mask=above | tie_taken)
    total = tl.sum(packed, 0)
    return a_run + (total & 0xFFFF), t_run + (total >> 16), tie_taken


@triton.jit
def _take_block(keys_row, pos_row, offs, N, spn, out_row, sok, thr, c, a_run, t_run,
                in_row, sik, thr_in, c_in, pooled, a_in, t_in, ckey_row,
                HAS_POS: tl.constexpr, NESTED: tl.constexpr, TRIM: tl.constexpr):
    """One block of the select pass: its keys read once, taken into the list (and the inner list).
    The key pass wrote 0 ("not a candidate") outside the chunk's range [lo_c, hi_c) and for the
    ineligible, so key > 0 is the whole test. (The positions of a pool are read here but feed only
    stored values, never an address.) The threshold is a candidate's key (>= 1) or above every key.
    The inner list chooses within the list: its ties are the list's taken ties where both cut the
    same key and the list takes only some of them (`pooled`), else all keys at its own threshold
    (all of which the list holds)."""
    key = tl.load(keys_row + offs, mask=offs < N, other=0).to(tl.int32) & 0xFFFF
    if HAS_POS:
        cand = tl.load(pos_row + offs * spn, mask=key > 0, other=-1)
    else:
        cand = offs
    a_run, t_run, tie_taken = _take(key > thr, key == thr, cand, out_row, sok, c, a_run, t_run, key, ckey_row, TRIM)
    if NESTED:
        tie_in = tl.where(pooled, tie_taken, key == thr_in)
        a_in, t_in, _ = _take(key > thr_in, tie_in, cand, in_row, sik, c_in, a_in, t_in, key, ckey_row, False)
    return a_run, t_run, a_in, t_in


@triton.jit
def _threshold_of(cum_ptr, deep_ptr, r, p, R, PROGS, K, LEVELS: tl.constexpr, LB: tl.constexpr, P_PAD: tl.constexpr):
    """The k-th key, how many to take, the select pass's threshold and tie multiplier
    (`_spread_of`), this chunk's running counts, and how many keys lie above the k-th and at it."""
    thr, need, above, a_run, ties, t_run = descend(cum_ptr, deep_ptr, r, p, R, PROGS, K, LEVELS, LB, P_PAD)
    thr = tl.where(need > 0, thr, 1 << 20)  # nothing to take: no key reaches it
    take, c = _spread_of(thr, need - above, ties)
    a_take = tl.where(take < thr, a_run + t_run, a_run)  # all ties taken: the earlier chunks' count as above
    return thr, need, take, c, a_take, t_run, above, ties


@triton.jit
def _pad(out_row, sok, need, K):
    """-1 in the list's slots [need, K): fewer eligible candidates than the budget."""
    p0 = tl.maximum(need, 0)
    while p0 < K:
        jp = p0 + tl.arange(0, WIN_BLOCK)
        tl.store(out_row + jp * sok, tl.full([WIN_BLOCK], -1, tl.int32), mask=jp < K)
        p0 += WIN_BLOCK


@triton.jit
def _window(row, sok, row_in, sik, first, now, sink, local, mask_b, h, L, min_half, smh, sml,
            HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr, NESTED: tl.constexpr):
    """A list's first sink + local slots, in the reference's order: the sink from the row's first
    position, then now - local + 1 .. now; -1 where unreadable or before the row (NESTED: also the inner list's)."""
    WIN = sink + local
    w0 = 0
    while w0 < WIN:
        jw = w0 + tl.arange(0, WIN_BLOCK)
        in_sink = jw < sink
        q = tl.where(in_sink, first + jw, now - local + 1 + (jw - sink))
        ok = (jw < WIN) & (q >= 0) & (q <= now) & (in_sink | (q >= first + sink))
        if HAS_MASK:
            ok = mask_readable(mask_b, 0, h, tl.minimum(tl.maximum(q, 0), L - 1), ok, 0, smh, sml, min_half,
                               MASK_HEADS, MASK_BOOL)
        win = tl.where(ok, q, -1).to(tl.int32)
        tl.store(row + jw * sok, win, mask=jw < WIN)
        if NESTED:
            tl.store(row_in + jw * sik, win, mask=jw < WIN)
        w0 += WIN_BLOCK


@triton.jit
def _select_kernel(
    tpos_ptr, start_ptr, pos_ptr, mask_ptr, keys_ptr, cum_ptr, out_ptr, inner_ptr, ckey_ptr,
    Hkv, N, L, sink, local, K, K_IN, min_half, PROGS,
    spb, sph, spn, smb, smh, sml, sob, soh, sok, sib, sih, sik,
    BLOCK: tl.constexpr, P_PAD: tl.constexpr,
    LEVELS: tl.constexpr, LB: tl.constexpr,  # KEY_BITS = LEVELS * LB
    HAS_POS: tl.constexpr, HAS_START: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    MASK_HEADS: tl.constexpr,
    NESTED: tl.constexpr,  # also write the inner selection (top K_IN) to inner_ptr
    TRIM: tl.constexpr,  # also write each taken candidate's key to ckey_ptr [R, K] (for _trim_kernel)
    USE_FOR: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    pdl_enter(PDL)
    p, r, R = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    b, h = row_of(r, Hkv)
    # the query's and the row's first position, loaded here: a helper given these pointers would seem to write them
    now, first = tl.load(tpos_ptr).to(tl.int32), tl.load(start_ptr + b, mask=HAS_START, other=0).to(tl.int32)
    lo_c, hi_c, blk, end = row_chunk(now, first, p, N, sink, local, PROGS, BLOCK, HAS_POS)
    ckey_row = ckey_ptr + r.to(tl.int64) * K
    kth, need, thr, c, a_run, t_run, above, ties = _threshold_of(cum_ptr, cum_ptr, r, p, R, PROGS, K, LEVELS, LB, P_PAD)
    thr_in, c_in, a_in, t_in = thr, c, a_run, t_run
    pooled = False
    if NESTED:
        cum_in = cum_ptr + LEVELS * R * PROGS * (1 << LB)
        kth_in, need_in, thr_in, c_in, a_in, t_in, above_in, _ = _threshold_of(cum_ptr, cum_in, r, p, R, PROGS, K_IN,
                                                                                LEVELS, LB, P_PAD)
        # same cut key, the list taking only some of its ties and the inner list fewer still: the
        # inner takes need_in - above of the list's need - above taken ties (else its own rule
        # gives the same as choosing within the list)
        pooled = (kth_in == kth) & (need_in < need) & (need - above < ties)
        if pooled:
            thr_in, c_in = _spread_of(kth, need_in - above_in, need - above)
            t_in = _tie_rank(t_run, c)[0]

    row = out_ptr + b * sob + h * soh
    out_row = row + (sink + local) * sok
    row_in = inner_ptr + b * sib + h * sih
    in_row = row_in + (sink + local) * sik
    keys_row = keys_ptr + r.to(tl.int64) * N
    pos_row = pos_ptr + b * spb + h * sph
    base = tl.arange(0, BLOCK)
    if USE_FOR:
        for jb in tl.range(blk, end):
            a_run, t_run, a_in, t_in = _take_block(keys_row, pos_row, jb * BLOCK + base, N, spn, out_row, sok,
                                                   thr, c, a_run, t_run, in_row, sik, thr_in, c_in, pooled,
                                                   a_in, t_in, ckey_row,
                                                   HAS_POS, NESTED, TRIM)
    else:
        while blk < end:
            a_run, t_run, a_in, t_in = _take_block(keys_row, pos_row, blk * BLOCK + base, N, spn, out_row, sok,
                                                   thr, c, a_run, t_run, in_row, sik, thr_in, c_in, pooled,
                                                   a_in, t_in, ckey_row,
                                                   HAS_POS, NESTED, TRIM)
            blk += 1

    if p == 0:  # the window and the padding
        _window(row, sok, row_in, sik, first, now, sink, local, mask_ptr + b * smb, h, L, min_half, smh, sml,
                HAS_MASK, MASK_BOOL, MASK_HEADS, NESTED)
        _pad(out_row, sok, need, K)
        if NESTED:
            _pad(in_row, sik, need_in, K_IN)


# ------------------------------------------------------------------------------ adaptive budget
@triton.jit
def mass_cut(key, v, goal):
    """The trim's key threshold over chosen keys (0 elsewhere) and their masses v: the largest key t
    whose chosen at or above it hold `goal` (a monotone predicate: its bits set from the top; key
    32768 is mass 0), or 0 (all stay) when even all fall short or there is no mass."""
    reached = (tl.sum(v, axis=0) >= goal) & (goal > 0)
    t = tl.full([], 32768, tl.int32)
    for bit in tl.static_range(15):
        trial = t | (1 << (14 - bit))
        t = tl.where(tl.sum(tl.where(key >= trial, v, 0.0), axis=0) >= goal, trial, t)
    return tl.where(reached, t, 0)


@triton.jit
def _trim_kernel(
    sel_ptr, ckey_ptr, tot_ptr, out_ptr, p, Hkv, WIN, K, PROGS,
    sob, soh, sok,
    K_PAD: tl.constexpr, W_PAD: tl.constexpr, P_PAD: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    """One row of a selection trimmed to p of its candidates' mass (reference.trim_to_mass): sel
    [B,Hkv,WIN+K] the select pass's list, ckey [R,K] the keys it took, tot [R,PROGS] the key
    pass's chunk masses; writes out (sel's shape and strides). The list is held in registers (the
    launcher widens the program with K) and cut by 15 reductions over it, not by a walk over the
    list in steps, which would load it again for each bisection step."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    b, h = row_of(r, Hkv)
    sel_row = sel_ptr + b * sob + h * soh
    out_row = out_ptr + b * sob + h * soh
    w = tl.arange(0, W_PAD)
    tl.store(out_row + w * sok, tl.load(sel_row + w * sok, mask=w < WIN), mask=w < WIN)
    pp = tl.arange(0, P_PAD)
    goal = p * tl.sum(tl.load(tot_ptr + r * PROGS + pp, mask=pp < PROGS, other=0.0), axis=0)
    j = tl.arange(0, K_PAD)
    cand = tl.load(sel_row + (WIN + j) * sok, mask=j < K, other=-1)
    key = tl.load(ckey_ptr + r.to(tl.int64) * K + j, mask=cand >= 0, other=0).to(tl.int32) & 0xFFFF
    keep = (cand >= 0) & (key >= mass_cut(key, key_mass(key), goal))
    ones = keep.to(tl.int32)
    slot = tl.cumsum(ones, 0) - ones
    kept = tl.sum(ones, axis=0)
    tl.store(out_row + (WIN + slot) * sok, cand, mask=keep)
    tl.store(out_row + (WIN + j) * sok, tl.full([K_PAD], -1, tl.int32), mask=(j < K) & (j >= kept))


# ------------------------------------------------------------------------------ one program a row
@triton.jit
def _row_select_kernel(
    src_ptr, keys_ptr, pos_ptr, tpos_ptr, start_ptr, mask_ptr, out_ptr,
    Hkv, N, NK, L, sink, local, K, min_half,
    spb, sph, spn, smb, smh, sml, sob, soh, sok,
    CHUNK: tl.constexpr,  # candidates per step of each pass (loops, not unrolled: one chunk in registers)
    KEY_BITS: tl.constexpr,  # 16, or 8 (Hamming similarities): one histogram level
    HAS_START: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (common.pdl_enter)
):
    """A nested selection's inner list (reference.select_nested) in one program a row: the best K
    of the row's pool (`pos` [B,Hkv,N], candidate order) by the keys its own key pass wrote to src
    [R, NK] at each candidate's cache slot. The keys gathered into this row's scratch [R, N]; the
    level-0 counts; the level-1 counts under the k-th key's top byte; the taken placed in candidate
    order by the select pass's rule (`_take`); the window. Each pass walks the pool CHUNK keys at
    a time (the scratch stays in cache). One launch for the level and select passes that would
    otherwise count both lists: faster only where the rows alone fill the GPU (ROW_MIN_ROWS), hence
    `_by_rows`."""
    pdl_enter(PDL)
    r = tl.program_id(0)
    b, h = row_of(r, Hkv)
    now, first = tl.load(tpos_ptr).to(tl.int32), tl.load(start_ptr + b, mask=HAS_START, other=0).to(tl.int32)
    pos_row = pos_ptr + b * spb + h * sph
    keys_row = keys_ptr + r.to(tl.int64) * N
    # every candidate's key: a pool's are eligible, > 0 (the key pass wrote 0 for the others)
    c0 = 0
    while c0 < N:
        o = c0 + tl.arange(0, CHUNK)
        ok = o < N
        cand = tl.load(pos_row + o * spn, mask=ok, other=-1).to(tl.int32)
        key = tl.load(src_ptr + r.to(tl.int64) * NK + cand, mask=ok & (cand >= 0), other=0).to(tl.int32)
        tl.store(keys_row + o, (key & ((1 << KEY_BITS) - 1)).to(keys_row.dtype.element_ty), mask=ok)
        c0 += CHUNK
    tl.debug_barrier()  # every thread reads keys other threads stored
    # level 0: how many to take, the top byte of the k-th key
    eligible_n = tl.zeros([], tl.int32)
    hist = tl.zeros([256], tl.int32)
    c0 = 0
    while c0 < N:
        o = c0 + tl.arange(0, CHUNK)
        key = tl.load(keys_row + o, mask=o < N, other=0).to(tl.int32) & 0xFFFF
        eligible_n += tl.sum((key > 0).to(tl.int32), axis=0)
        if KEY_BITS == 16:
            hist += tl.histogram(key >> 8, 256, mask=key > 0)
        c0 += CHUNK
    need = tl.minimum(eligible_n, K)
    t1, above = tl.zeros([], tl.int32), tl.zeros([], tl.int32)
    if KEY_BITS == 16:
        t1, above = threshold(tl.cumsum(hist, 0, reverse=True), need, 256)
    # level 1: its low byte, from the keys under that top byte
    hist = tl.zeros([256], tl.int32)
    c0 = 0
    while c0 < N:
        o = c0 + tl.arange(0, CHUNK)
        key = tl.load(keys_row + o, mask=o < N, other=0).to(tl.int32) & 0xFFFF
        hist += tl.histogram(key & 255, 256, mask=(key > 0) & ((key >> 8) == t1))
        c0 += CHUNK
    lo_cum = tl.cumsum(hist, 0, reverse=True)
    t0, up = threshold(lo_cum, need - above, 256)
    ties = tl.sum(tl.where(tl.arange(0, 256) == t0, lo_cum, 0), axis=0) - up
    above += up
    thr = tl.where(need > 0, t1 * 256 + t0, 1 << 20)  # nothing to take: no key reaches it
    thr, c = _spread_of(thr, need - above, ties)
    # the taken, at their ranks in candidate order
    row = out_ptr + b * sob + h * soh
    out_row = row + (sink + local) * sok
    a_run, t_run = tl.zeros([], tl.int32), tl.zeros([], tl.int32)
    c0 = 0
    while c0 < N:
        o = c0 + tl.arange(0, CHUNK)
        key = tl.load(keys_row + o, mask=o < N, other=0).to(tl.int32) & 0xFFFF
        cand = tl.load(pos_row + o * spn, mask=key > 0, other=-1)
        a_run, t_run, _ = _take(key > thr, key == thr, cand, out_row, sok, c, a_run, t_run, key, keys_row, False)
        c0 += CHUNK
    _window(row, sok, row, sok, first, now, sink, local, mask_ptr + b * smb, h, L, min_half, smh, sml,
            HAS_MASK, MASK_BOOL, MASK_HEADS, False)
    _pad(out_row, sok, need, K)


# ------------------------------------------------------------------------------ launchers
def _is_index(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and t.dtype != torch.bool


def _selection_supported(pos, k, sink, local, mask, start, batch: int, n: int) -> bool:
    """What both selections need of their common arguments (n: candidates per row)."""
    return (
        pos.dim() == 1 and pos.shape[0] >= 1 and _is_index(pos)
        and k > 0 and sink >= 0 and local >= 0
        and (mask is None or mask.dtype == torch.bool or mask.dtype in FLOAT_DTYPES)
        and (start is None or (start.dim() == 1 and start.shape[0] == batch and not start.is_floating_point()))
        and n < 2**31 - 2 * (k + sink + local)
        and (mask is None or n * abs(mask.stride(-1)) < 2**31)  # int32 offsets within a row
    )


def select_topk_supported(scores, pos, k, sink, local, mask=None, positions=None, start=None, mass=1.0) -> bool:
    return (
        on_kernel_device(scores, pos, mask, positions, start)
        and (mass == 1 or scores.is_floating_point())
        and scores.dim() == 3
        and scores.dtype in SCORE_KIND
        and (positions is None or (positions.shape == scores.shape and _is_index(positions)
                                   and scores.shape[-1] * abs(positions.stride(-1)) < 2**31))
        and (positions is not None or mask is None or mask.shape[-1] >= scores.shape[-1])  # a mask for every slot
        and scores.shape[-1] * abs(scores.stride(-1)) < 2**31
        and _selection_supported(pos, k, sink, local, mask, start, scores.shape[0], scores.shape[-1])
    )


def plan_programs(R: int, N: int, device: torch.device, block: int, waves: int, level_bits: int,
                  cap: int | None = None) -> int:
    """Programs per row: enough rows x programs for `waves` per SM, at most one per block and `cap`
    (every program of a later pass reads all the row's counts: programs x 2^level_bits; default
    WIDE_PROGS for 256-bin levels), and with 16-bin levels (packed counts) enough that no chunk
    exceeds PACKED_RUN blocks."""
    cap = cap or (WIDE_PROGS if level_bits == 8 else MAX_PROGS)
    blocks = triton.cdiv(max(N, 1), block)
    progs = max(min(MAX_PROGS, cap, programs_per_row(R, blocks, device, waves=waves)),
                octave(triton.cdiv(blocks, PACKED_RUN), up=True) if level_bits == 4 else 1)
    if progs > MAX_PROGS:
        raise ValueError(f"select: {N} candidates a row need more than {MAX_PROGS} programs of {block}-key blocks")
    return progs


class KeyPass(NamedTuple):
    """What the float key pass (`_score_keys_kernel`) reads: scores [B, Hkv, N] (KIND 0) or, KIND 4,
    mass_logits' scratch with its split statistics pm / pl; tot: the chunks' masses under a trim."""

    scores: torch.Tensor
    strides: tuple
    kind: int
    pm: torch.Tensor
    pl: torch.Tensor
    tot: torch.Tensor
    splits: int
    G: int
    G_PAD: int


def run_select(keys, cum, pos, k, sink, local, ma: MaskView, positions, start, out, progs, key_bits, lb, block, warps,
               inner=None, ckeys=None, row=None, key_pass: KeyPass | None = None):
    """The deeper histogram levels and the select pass over the keys (and level-0 counts in
    `cum`) a key pass wrote, with the same `block` and `progs`: every pass cuts the same chunks.
    key_pass: run the float key pass first (it writes `keys` and the level-0 counts). inner:
    (k_inner, its output) for a nested selection (`cum` then holds a second set of levels,
    `_counts(nested=True)`), its inner list by one program a row over the list's keys where
    `_by_rows` (row: None to decide, or forced), else by the passes counting both lists.
    ckeys [R, k]: where the select pass writes the keys it takes (for the trim)."""
    B, Hkv, _ = out.shape
    R, N = keys.shape
    # one program a row reads each pool entry's key at its cache slot: slots, not a pool's indices
    by_row = inner is not None and positions is None and _by_rows(R, k, row)
    row_inner, inner = (inner, None) if by_row else (None, inner)
    has_pos, has_start = positions is not None, start is not None
    pos_t = positions if has_pos else keys
    sp = positions.stride() if has_pos else (0, 0, 0)
    start_t = start if has_start else pos
    L = ma.tensor.shape[-1] if ma.present else 1
    levels = key_bits // lb
    k_in, out_in = inner if inner is not None else (k, out)
    mask_meta = dict(HAS_MASK=ma.present, MASK_BOOL=ma.is_bool, MASK_HEADS=ma.heads)
    chunks = dict(BLOCK=block, LB=lb, HAS_POS=has_pos, HAS_START=has_start, USE_FOR=not interpreting(), num_warps=warps)
    common = dict(P_PAD=pow2(progs), NESTED=inner is not None, **chunks)
    trim = ckeys is not None
    ckeys = keys if ckeys is None else ckeys  # unwritten without the trim
    if key_pass is not None:
        kp = key_pass
        torch.library.wrap_triton(_score_keys_kernel)[(progs, R)](
            kp.scores, positions if has_pos else kp.scores, pos, start_t, ma.tensor, keys, cum, kp.pm, kp.pl, kp.tot,
            Hkv, N, L, sink, local, ma.min_half, progs, kp.splits, *kp.strides, *sp, ma.sb, ma.sh, ma.sl,
            KIND=kp.kind, G=kp.G, G_PAD=kp.G_PAD, S_PAD=pow2(kp.splits), TRIM=trim, **mask_meta, **chunks, **pdl(keys.device))
    for level in range(1, levels):
        torch.library.wrap_triton(_hist_kernel)[(progs, R)](
            pos, start_t, keys, cum, Hkv, N, sink, local, k, k_in, progs, LEVEL=level, KEY_BITS=key_bits, **common, **pdl(keys.device))
    torch.library.wrap_triton(_select_kernel)[(progs, R)](
        pos, start_t, pos_t, ma.tensor, keys, cum, out, out_in, ckeys,
        Hkv, N, L, sink, local, k, k_in, ma.min_half, progs,
        *sp, ma.sb, ma.sh, ma.sl, *out.stride(), *out_in.stride(),
        LEVELS=levels, TRIM=trim, **mask_meta, **common, **pdl(keys.device))
    if row_inner is not None:
        _row_select(keys, pos, row_inner[0], sink, local, ma, out[..., sink + local:], start, key_bits, row_inner[1])
    return out


def _counts(levels: int, R: int, progs: int, lb: int, nested: bool, dev) -> torch.Tensor:
    """The per-program suffix counts of every radix level (twice for a nested selection)."""
    return torch.empty((2 if nested else 1) * levels, R, progs, 1 << lb, dtype=torch.int32, device=dev)


def cache_row_launch(R: int, N: int, block: int | None, cap: int | None) -> tuple[int, int | None]:
    """(block, cap) of a float selection over R cache rows of N slots: the tuned WIDE_BLOCK
    layout where it is faster, else BLOCK; given knobs are kept."""
    wide = R < ROW_MIN_ROWS and R * triton.cdiv(N, WIDE_BLOCK) >= WIDE_MIN_PROGRAMS
    if block is None:
        block = WIDE_BLOCK if wide else BLOCK
    if cap is None and wide and block == WIDE_BLOCK and R <= WIDE_CAP_ROWS:
        cap = WIDE_CAP
    return block, cap


def select_topk(scores, pos, k, sink, local, mask=None, positions=None, start=None, *, mass=1.0, block=None, warps=4,
                waves=WAVES, level_bits=LEVEL_BITS, cap=None, k_inner=None, row=None):
    """reference.select_topk: [B,Hkv,sink+local+k] int32 window + top-k positions, -1 padded
    (mass < 1: trimmed to that share of the mass). With k_inner (reference.select_nested): that
    list and the one of the best k_inner, both from one key pass over the scores: the inner list
    by one program a row over the list's keys (`_by_rows`; row=True / False force it), else by the
    deeper levels and the select pass counting both. block / warps / waves (programs per SM) /
    level_bits / cap (programs per row) are tuning knobs (bench/kernel_tuning.py); unset, block and
    cap follow `cache_row_launch` over a cache row, else BLOCK and `plan_programs`' cap."""
    B, Hkv, N = scores.shape
    if positions is None and scores.is_floating_point():
        block, cap = cache_row_launch(B * Hkv, N, block, cap)
    return _select(scores, scores.stride(), SCORE_KIND[scores.dtype], None, B, Hkv, N, pos, k, sink, local, mask, positions,
                   start, block or BLOCK, warps, waves, level_bits, cap, k_inner, mass, row)


def mass_select_supported(q, k, scale, mask, positions, pos, budget, sink, local, start=None, mass=1.0) -> bool:
    return (
        positions is not None
        and mass_scores_supported(q, k, scale, mask, positions)
        and on_kernel_device(pos, start)
        and positions.shape[-1] * abs(positions.stride(-1)) < 2**31
        and _selection_supported(pos, budget, sink, local, mask, start, q.shape[0], positions.shape[-1])
    )


def mass_select(q, k, scale, mask, positions, pos, budget, sink, local, start=None, *, mass=1.0, block=BLOCK, warps=4,
                waves=WAVES, level_bits=LEVEL_BITS, cap=None):
    """reference.mass_select: select_topk of the pool `positions` by mass_scores, the key pass
    computing each candidate's mass from the logits stage's scratch (no mass written or read)."""
    B, Hkv, N = positions.shape
    if B * Hkv * N == 0:  # no logits to take (an empty pool still has its window)
        empty = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
        return _select(empty, empty.stride(), SCORE_KIND[empty.dtype], None, B, Hkv, N, pos, budget, sink, local, mask,
                       positions, start, block, warps, waves, level_bits, cap, None, mass)
    lg = mass_logits(q, k, scale, mask, positions)
    return _select(lg.scratch, (Hkv * lg.G * N, lg.G * N, 1), 4, lg, B, Hkv, N, pos, budget, sink, local, mask, positions,
                   start, block, warps, waves, level_bits, cap, None, mass)


def _row_select(src, pos, k, sink, local, ma: MaskView, positions, start, key_bits, out) -> None:
    """select_topk of the pool `positions` [B,Hkv,N] by the keys [R, L] a key pass wrote to `src`
    (`key_bits` wide) into `out` [B,Hkv,sink+local+k], by `_row_select_kernel`: one program a row."""
    B, Hkv, N = positions.shape
    R = B * Hkv
    keys = torch.empty(R, N, dtype=torch.int16, device=positions.device)
    chunk = min(ROW_CHUNK, pow2(N))
    assert chunk < 1 << 15, "`_take` packs a step's two counts in 16 bits each"
    torch.library.wrap_triton(_row_select_kernel)[(R,)](
        src, keys, positions, pos[-1:], start if start is not None else pos, ma.tensor, out,
        Hkv, N, src.shape[-1], ma.tensor.shape[-1] if ma.present else 1, sink, local, k, ma.min_half,
        *positions.stride(), ma.sb, ma.sh, ma.sl, *out.stride(),
        CHUNK=chunk, KEY_BITS=key_bits, HAS_START=start is not None, HAS_MASK=ma.present, MASK_BOOL=ma.is_bool,
        MASK_HEADS=ma.heads,
        num_warps=ROW_WARPS,
        **pdl(keys.device),
    )


def _by_rows(R: int, N: int, row) -> bool:
    """Whether R rows of pools of N are selected by `_row_select_kernel` (row: None to decide, or forced)."""
    return row if row is not None else N <= ROW_MAX and R >= ROW_MIN_ROWS


def _select(scores, strides, kind, logits, B, Hkv, N, pos, k, sink, local, mask, positions, start, block, warps, waves,
            level_bits, cap, k_inner, mass=1.0, row=None):
    """The key pass over scores (or, kind 4, over mass from `logits`, what mass_logits left) and
    run_select's passes (and, mass < 1, the trim; with k_inner, the inner list)."""
    R = B * Hkv
    dev = scores.device
    trim = mass < 1
    if k_inner is not None and trim:
        raise ValueError("select: a nested selection (k_inner) takes no mass < 1 (its proposal keeps the full budget)")
    out = torch.empty(B, Hkv, sink + local + k, dtype=torch.int32, device=dev)
    out_in = None if k_inner is None else torch.empty(B, Hkv, sink + local + k_inner, dtype=torch.int32, device=dev)
    if R == 0:
        return out if k_inner is None else (out, out_in)
    pos = pos[-1:]
    progs = plan_programs(R, N, dev, block, waves, level_bits, cap)
    keys = torch.empty(R, N, dtype=torch.int16, device=dev)
    cum = _counts(16 // level_bits, R, progs, level_bits, k_inner is not None, dev)
    ma = MaskView(mask, Hkv, scores)
    if logits is None:  # no group statistics: their arguments unused
        pm, pl, splits, G, G_PAD = scores, scores, 1, 1, 1
    else:
        pm, pl, splits, G, G_PAD = logits.pm, logits.pl, logits.splits, logits.G, logits.G_PAD
    tot = torch.empty(R, progs, dtype=torch.float32, device=dev) if trim else pm
    key_pass = KeyPass(scores, strides, kind, pm, pl, tot, splits, G, G_PAD)
    if not trim:
        run_select(keys, cum, pos, k, sink, local, ma, positions, start, out, progs, 16, level_bits, block, warps,
                   None if k_inner is None else (k_inner, out_in), row=row, key_pass=key_pass)
        return out if k_inner is None else (out, out_in)
    chosen = torch.empty_like(out)
    ckeys = torch.empty(R, k, dtype=torch.int16, device=dev)
    run_select(keys, cum, pos, k, sink, local, ma, positions, start, chosen, progs, 16, level_bits, block, warps, ckeys=ckeys,
               key_pass=key_pass)
    torch.library.wrap_triton(_trim_kernel)[(R,)](
        chosen, ckeys, tot, out, mass, Hkv, sink + local, k, progs, *out.stride(),
        K_PAD=pow2(k), W_PAD=pow2(max(sink + local, 1)), P_PAD=pow2(progs),
        num_warps=min(32, max(4, pow2(k) // 512)),  # 16 list slots a thread: the list, its keys and masses fit
        **pdl(out.device),
    )
    return out


def hash_select_supported(q_logits, k_sig, pos, k, sink, local, mask=None, start=None) -> bool:
    if not on_kernel_device(q_logits, k_sig, pos, mask, start):
        return False
    if q_logits.dim() != 3 or k_sig.dim() != 4 or k_sig.dtype != torch.int32 or q_logits.dtype not in FLOAT_DTYPES:
        return False
    B, Hq, bits = q_logits.shape
    W = k_sig.shape[3]
    return (
        bits == WORD_BITS * W and 1 <= W <= 8
        and k_sig.shape[0] == B and Hq % k_sig.shape[1] == 0
        and (Hq // k_sig.shape[1]) * WORD_BITS * W < 65535
        and (mask is None or mask.shape[-1] >= k_sig.shape[2])  # a mask for every slot
        and k_sig.shape[2] * k_sig.stride(2) + W * k_sig.stride(3) < 2**31  # int32 offsets within a row
        and k_sig.shape[2] <= MAX_PROGS * PACKED_RUN * HASH_BLOCK  # packed 16-bin counts at the default block
        and _selection_supported(pos, k, sink, local, mask, start, B, k_sig.shape[2])
    )


def hash_levels(R: int, N: int, key_bits: int, block: int, waves: int, device: torch.device) -> tuple[int, int | None]:
    """(bits a radix level of hash_select's keys, programs a row at most): one 8-bit level for 8-bit
    keys where chunks of at most HASH_ONE_LEVEL_BLOCKS blocks take at most HASH_WIDE_CAP programs a
    row, or up to HASH_STRETCH_CAP where the GPU has room for them: a cache allocated a little past
    its prompt (generate() sizes it prompt + max_new_tokens: 128K + 256 is 129 blocks) would
    otherwise fall to two levels. Else HASH_LEVEL_BITS, with plan_programs' cap."""
    if key_bits == 8:
        blocks = triton.cdiv(max(N, 1), block)
        need = triton.cdiv(blocks, HASH_ONE_LEVEL_BLOCKS)
        cap = HASH_WIDE_CAP if need <= HASH_WIDE_CAP else min(octave(need, up=True), HASH_STRETCH_CAP)
        if triton.cdiv(blocks, plan_programs(R, N, device, block, waves, 8, cap)) <= HASH_ONE_LEVEL_BLOCKS:
            return 8, cap
    return HASH_LEVEL_BITS, None


def hash_select(q_logits, k_sig, pos, k, sink, local, mask=None, start=None, *, block=None, warps=4,
                waves=None, level_bits=None, cap=None, k_inner=None, row=None):
    """reference.hash_select: Hamming keys fused with the first selection pass, then select (with
    k_inner, also the best k_inner as reference.hash_select_nested; `row` as in select_topk).
    Unset, the launch knobs are the HASH_ constants (read at the call)."""
    from .signatures import _hash_keys_kernel

    block, waves = block or HASH_BLOCK, waves or HASH_WAVES
    B, Hq, _ = q_logits.shape
    Hkv, N, W = k_sig.shape[1], k_sig.shape[2], k_sig.shape[3]
    G = Hq // Hkv
    R = B * Hkv
    dev = k_sig.device
    out = torch.empty(B, Hkv, sink + local + k, dtype=torch.int32, device=dev)
    out_in = None if k_inner is None else torch.empty(B, Hkv, sink + local + k_inner, dtype=torch.int32, device=dev)
    if R == 0:
        return out if k_inner is None else (out, out_in)
    key_bits = 16 if G * WORD_BITS * W + 1 > 255 else 8  # similarity + 1
    if level_bits is None:
        level_bits, auto_cap = hash_levels(R, N, key_bits, block, waves, dev)
    else:
        auto_cap = HASH_WIDE_CAP if level_bits == 8 else None
    cap = cap or auto_cap
    pos = pos[-1:]
    progs = plan_programs(R, N, dev, block, waves, level_bits, cap)
    keys = torch.empty(R, N, dtype=torch.int16 if key_bits == 16 else torch.uint8, device=dev)
    cum = _counts(key_bits // level_bits, R, progs, level_bits, k_inner is not None, dev)
    ma = MaskView(mask, Hkv, k_sig)
    torch.library.wrap_triton(_hash_keys_kernel)[(progs, R)](
        q_logits, k_sig, pos, start if start is not None else pos, ma.tensor, keys, cum,
        Hkv, N, sink, local, k if k_inner is None else min(k, k_inner), ma.min_half, progs,
        *q_logits.stride(), *k_sig.stride(), ma.sb, ma.sh, ma.sl,
        G=G, G_PAD=pow2(G), W=W, W_PAD=pow2(W), KEY_BITS=key_bits, LB=level_bits, BLOCK=block,
        HAS_START=start is not None, HAS_MASK=ma.present, MASK_BOOL=ma.is_bool, MASK_HEADS=ma.heads,
        HW_POPC=not interpreting(), USE_FOR=not interpreting(),
        num_warps=warps,
        **pdl(k_sig.device),
    )
    run_select(keys, cum, pos, k, sink, local, ma, None, start, out, progs, key_bits, level_bits, block, warps,
               None if k_inner is None else (k_inner, out_in), row=row)
    return out if k_inner is None else (out, out_in)
