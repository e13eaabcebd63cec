"""Helpers shared by the kernel modules: launch sizing, mask arguments, small jit functions.

Nothing here looks at tensor *values*: every decision is made from shapes, dtypes and devices, so
the launchers trace under torch.compile (FakeTensors) and capture under CUDA graphs.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Streaming scans (Hamming, INT2 scores, the selection filter): grid-stride programs, about
# STREAM_WAVES per SM so enough loads are in flight, each loop software-pipelined STREAM_STAGES deep.
STREAM_WAVES = 8
STREAM_STAGES = 3
MAX_SPLITS = 64  # programs one row's candidates may be split over (attention, mass scores)
# Programmatic dependent launch (sm_90+): a kernel launched with it is dispatched while the kernel
# before it finishes, and waits (griddepcontrol.wait) at entry until that kernel's writes are
# visible: a decode step's chain of small launches loses part of the gap between them. 0: off;
# 1: wait at entry (the next kernel is released as this one's programs exit); 2: also release the
# next one as soon as every program of this one has started. 1 gains most where launches are short
# (small batches); 2 loses from batch 4, the next kernel's waiting programs holding SM slots this
# one's later programs need. Under torch.compile the constexpr is compiled in and sparse_fx's
# backend sets the launch attribute of the kernels that carry it (sparse_fx/launch.py).
PDL = 1  # kernel_step's best of 0 / 1 / 2 (bench/results/kernels-2026-12-03-1637-pdl1.json)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pdl(device: torch.device) -> dict:
    """A launch's PDL arguments: the kernels' constexpr (0 off the GPU, before sm_90, or PDL = 0),
    and eagerly the launch attribute (a compiled graph's launcher gets it from sparse_fx.launch)."""
    if not PDL or device.type != "cuda" or interpreting() or _capability(device)[0] < 9:
        return {"PDL": 0}
    if _traced():  # the kernel is recorded into a graph, not launched: no launch options
        return {"PDL": PDL}
    return {"PDL": PDL, "launch_pdl": True}


def _traced() -> bool:
    """Whether wrap_triton records its launches (torch.compile tracing a triton_op) instead of running them."""
    try:
        from torch._library.triton import is_wrap_triton_enabled
    except ImportError:
        return torch.compiler.is_compiling()
    return is_wrap_triton_enabled()


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel before it (its writes visible)
    and (PDL 2) release the next one's launch."""
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()
    if PDL >= 2:
        tl.extra.cuda.gdc_launch_dependents()


def on_kernel_device(*tensors: torch.Tensor | None) -> bool:
    """Whether the kernels may run on these tensors: CUDA, or any device under the interpreter."""
    ts = [t for t in tensors if t is not None]
    if interpreting():
        return all(t.device.type == "cpu" for t in ts)
    return all(t.device.type == "cuda" for t in ts)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (a device constant, not data); 4 on the CPU interpreter."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def symbolic(n) -> bool:
    """Whether a size is a symbol of the graph being traced (a SymInt that follows the cache length), not a number."""
    return not isinstance(n, int)


def octave(n, up: bool = False) -> int:
    """n itself, or, where n is symbolic (a count that follows the cache length of a graph serving every
    length), the power of two at or below it (at or above it with `up`): launch sizes then guard the
    length's octave, not its value, so a new length reuses the graph instead of compiling another."""
    if not symbolic(n):
        return n
    p = 1
    while p * 2 <= n:  # each comparison a guard on a range of n
        p *= 2
    return p * 2 if up and p < n else p


def programs_per_row(rows: int, blocks: int, device: torch.device, waves: int = 4) -> int:
    """How many programs share one row so that rows * programs ~ `waves` x SMs (at least 1, at most
    one program per block): several programs per (batch, KV head) row keep 132 SMs busy at B*Hkv=8."""
    full = triton.cdiv(waves * num_sms(device), max(rows, 1))
    if symbolic(blocks):
        full = 1 << (full.bit_length() - 1)  # a power of two: the octave at or below `full` is one range, not two
    return full if blocks >= full else max(1, octave(blocks))


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@triton.jit
def chunk_of(p, lo_c, hi_c, PROGS, BLOCK: tl.constexpr):
    """Block range [first, last) of program p's chunk of the candidate range [lo_c, hi_c)."""
    b0 = lo_c // BLOCK
    b1 = tl.where(hi_c > lo_c, (hi_c + BLOCK - 1) // BLOCK, b0)
    per = (b1 - b0 + PROGS - 1) // PROGS
    first = tl.minimum(b0 + p * per, b1)
    return first, tl.minimum(first + per, b1)


# ------------------------------------------------------------------------------------ masks
class MaskView:
    """Kernel arguments for an SDPA mask [B|1, 1|Hq, T, L] read per KV head: the tensor itself
    (a bool mask as it is, no copy), broadcast strides 0, and how many mask heads one KV head owns
    (G when the mask has Hq heads, else 1). Kernels only load from it, never store through an
    address derived from it, so Inductor sees a read-only input (no copy-back of the model's mask).
    """

    def __init__(self, mask: torch.Tensor | None, kv_heads: int, dummy: torch.Tensor):
        self.present = mask is not None
        if mask is None:
            self.tensor, self.is_bool, self.heads = dummy, True, 1
            self.sb = self.sh = self.st = self.sl = 0
            self.min_half = 0.0
            return
        self.is_bool = mask.dtype == torch.bool
        self.tensor = mask  # bool masks go in as they are (Triton reads *i1); a dtype view would not lower
        self.heads = 1 if mask.shape[1] == 1 else mask.shape[1] // kv_heads
        self.sb = 0 if mask.shape[0] == 1 else mask.stride(0)
        self.sh = 0 if mask.shape[1] == 1 else mask.stride(1)
        self.st = 0 if mask.shape[2] == 1 else mask.stride(2)  # one mask row per query (few_query_attention)
        self.sl = mask.stride(3)
        # a float mask value at or below half the dtype's minimum means "masked" (reference.valid_positions)
        self.min_half = 0.0 if self.is_bool else float(torch.finfo(mask.dtype).min) / 2


@triton.jit
def mask_readable(mask_ptr, b, h, cols, active, smb, smh, sml, min_half,
                  MASK_HEADS: tl.constexpr, MASK_BOOL: tl.constexpr):
    """reference.valid_positions at cache positions `cols` of KV head h: any of its mask heads reads."""
    ok = cols < 0  # all False, shaped like cols
    for g in tl.static_range(MASK_HEADS):
        ptrs = mask_ptr + b * smb + (h * MASK_HEADS + g) * smh + cols * sml
        if MASK_BOOL:
            m = tl.load(ptrs, mask=active, other=0)
            ok = ok | (m != 0)
        else:
            m = tl.load(ptrs, mask=active, other=0.0).to(tl.float32)
            ok = ok | (m > min_half)
    return ok & active


@triton.jit
def row_chunk(now, first, p, N, sink, local, PROGS, BLOCK: tl.constexpr, HAS_POS: tl.constexpr):
    """A selection row's candidate range [lo, hi) (cache slots between the sink and the local
    window, or all N entries of a pool) and the block range [blk, end) of program p's chunk of it.
    int32 throughout: a row holds fewer than 2**31 candidates (the row pointers carry the int64 part)."""
    if HAS_POS:
        lo, hi = tl.zeros([], tl.int32), tl.zeros([], tl.int32) + N
    else:
        lo, hi = first + sink, tl.minimum(now - local + 1, N)
    blk, end = chunk_of(p, lo, hi, PROGS, BLOCK)
    return lo, hi, blk, end


@triton.jit
def row_of(r, Hkv):
    """(batch, KV head) of row r, as int64 offsets (caches exceed 2**31 elements)."""
    return (r // Hkv).to(tl.int64), (r % Hkv).to(tl.int64)


@triton.jit
def softmax_start(sm_scale, G_PAD: tl.constexpr):
    """The scale pinned to fp32 (Inductor may hand a Python float in as fp64, and the loop-carried
    state must stay fp32), and an online softmax's running max and sum per query head."""
    return tl.full([], sm_scale, tl.float32), tl.full([G_PAD], float("-inf"), tl.float32), tl.zeros([G_PAD], tl.float32)


@triton.jit
def group_queries(q_ptr, b, h, sqb, sqh, sqd, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr):
    """The G query rows that share KV head h, as a [G_PAD, D] tile (padding rows zero): one
    program serves them all, so each K/V row it fetches is read once for the group."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    return tl.load(q_ptr + b * sqb + (h * G + g)[:, None] * sqh + d[None, :] * sqd, mask=(g < G)[:, None], other=0.0)


@triton.jit
def eligible(cand, live, first, now, sink, local, mask_b, h, L, min_half, smh, sml,
             HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr):
    """Which candidate positions a selection may choose (reference.select_topk): after the
    row's sink, before its local window, and readable by some query head of KV head h.
    (Its result must not feed a store address: Inductor would take the mask as written.)"""
    ok = live & (cand >= first + sink) & (cand <= now - local)
    if HAS_MASK:
        ok = mask_readable(mask_b, 0, h, tl.minimum(tl.maximum(cand, 0), L - 1), ok, 0, smh, sml, min_half,
                           MASK_HEADS, MASK_BOOL)
    return ok


@triton.jit
def slots_eligible(offs, lo_c, hi_c, row, mask_b, h, min_half, smh, sml,
                   HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_HEADS: tl.constexpr):
    """`eligible` for cache slots `offs` (int32) of a row_chunk range [lo_c, hi_c), which already lies
    between the sink and the local window: the range (one unsigned compare) and the mask only, read
    under `row` (offs < N, the loads' own bound: the launchers require a mask for every slot)."""
    ok = (offs - lo_c).to(tl.uint32) < tl.maximum(hi_c - lo_c, 0).to(tl.uint32)
    if HAS_MASK:
        ok = ok & mask_readable(mask_b, 0, h, offs, row, 0, smh, sml, min_half, MASK_HEADS, MASK_BOOL)
    return ok


# ------------------------------------------------------------------------ split-K attention
@triton.jit
def _combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, out_ptr,
    Hq, NSPLIT,
    sob, soh, sot, sod,
    G: tl.constexpr, T: tl.constexpr, ROWS_PAD: tl.constexpr, DV: tl.constexpr,
    S_PAD: tl.constexpr,  # splits padded to a power of two: every split's (max, sumexp) of a row in registers
    S_STEP: tl.constexpr,  # splits whose accumulators are merged per step ([S_STEP, DV] in registers)
    PDL: tl.constexpr,  # programmatic dependent launch (pdl_enter)
):
    pdl_enter(PDL)
    pid = tl.program_id(0)  # one (batch, query head, query)
    t = pid % T
    bh = pid // T
    b = bh // Hq
    hq = bh % Hq
    r = b * (Hq // G) + hq // G
    row = (hq % G) * T + t
    s = tl.arange(0, S_PAD)
    live = s < NSPLIT
    base = (r * NSPLIT + s) * ROWS_PAD + row
    ms = tl.load(pm_ptr + base, mask=live, other=float("-inf"))
    ls = tl.load(pl_ptr + base, mask=live, other=0.0)
    top = tl.max(ms, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.exp(ms - top) * ls, axis=0)
    dv = tl.arange(0, DV)
    acc = tl.zeros([DV], tl.float32)
    for s0 in tl.static_range(0, S_PAD, S_STEP):
        sj = s0 + tl.arange(0, S_STEP)
        lj = sj < NSPLIT
        bj = (r * NSPLIT + sj) * ROWS_PAD + row
        w = tl.exp(tl.load(pm_ptr + bj, mask=lj, other=float("-inf")) - top)
        parts = tl.load(pacc_ptr + bj[:, None] * DV + dv[None, :], mask=lj[:, None], other=0.0)
        acc += tl.sum(w[:, None] * parts, axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * sob + hq * soh + t * sot + dv * sod, out.to(out_ptr.dtype.element_ty))


@triton.jit
def online_softmax(s, vt, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One tile of a flash attention: logits s [ROWS, BLOCK_N] (-inf where unreadable) and values
    vt [BLOCK_N, DV] folded into the running max m_i, sum l_i and accumulator acc of each row."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing readable yet: exp(-inf - 0) = 0
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, DOT_PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def store_partials(pm_ptr, pl_ptr, pacc_ptr, base, rows, live, m_i, l_i, acc, DV: tl.constexpr):
    """A split's partial (max, sumexp, acc) of its live rows at base + row, for combine_splits."""
    dv = tl.arange(0, DV)
    tl.store(pm_ptr + base + rows, m_i, mask=live)
    tl.store(pl_ptr + base + rows, l_i, mask=live)
    tl.store(pacc_ptr + (base + rows)[:, None] * DV + dv[None, :], acc, mask=live[:, None])


def split_keys(length: int, block: int, rows: int, waves: int, max_splits: int, device: torch.device) -> tuple[int, int]:
    """(splits, split length) of a split-K attention over `length` entries in blocks of `block`:
    about `waves` programs an SM over `rows` (batch, KV head) rows, at most `max_splits` a row."""
    blocks = triton.cdiv(length, block)
    cap = max(1, min(max_splits, triton.cdiv(waves * num_sms(device), rows)))
    splits = cap if blocks >= cap else max(1, octave(blocks))
    split_len = triton.cdiv(blocks, splits) * block
    if symbolic(length):  # a symbolic length: launch the fixed count (a trailing split may be empty), no guard on it
        return splits, split_len
    return triton.cdiv(length, split_len), split_len


def split_partials(rows: int, splits: int, rows_pad: int, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Scratch for the splits' partial (max, sumexp, acc) that combine_splits merges; with one split
    the program writes `out` itself and `out` stands in for them (never read)."""
    if splits == 1:
        return out, out, out
    pm = torch.empty(rows * splits * rows_pad, dtype=torch.float32, device=out.device)
    return pm, torch.empty_like(pm), torch.empty(rows * splits * rows_pad * out.shape[-1], dtype=torch.float32, device=out.device)


def combine_splits(pm, pl, pacc, out, G: int, rows_pad: int, splits: int) -> None:
    """Merge the splits' partial (max, sumexp, acc) of a split-K attention into out [B, Hq, T, DV].
    Partials are laid out [B*Hkv, splits, rows_pad(, DV)], row g*T + t for query head h*G + g and
    query t (the G*T query rows of a KV head; rows past G*T are padding, never read)."""
    B, Hq, T, DV = out.shape
    torch.library.wrap_triton(_combine_kernel)[(B * Hq * T,)](
        pm, pl, pacc, out,
        Hq, splits,
        *out.stride(),
        G=G, T=T, ROWS_PAD=rows_pad, DV=DV, S_PAD=pow2(splits), S_STEP=min(pow2(splits), 32),
        num_warps=4,
        **pdl(out.device),
    )


# ------------------------------------------------------------------------------ radix counts
# A radix level's bin counts. tl.histogram costs a ballot per digit bit and a shared-memory merge
# per block; for 16 bins it is cheaper to count per slot (each thread's element of the block) in
# four words of four 8-bit fields, merged once at the end of the chunk: a field counts one key per
# block, so a chunk may hold at most PACKED_RUN blocks (launchers size programs so that it does).
PACKED_RUN = 255


@triton.jit
def counts_zero(BLOCK: tl.constexpr, NB: tl.constexpr):
    if NB == 16:
        z = tl.zeros([BLOCK], tl.int32)
    else:
        z = tl.zeros([NB], tl.int32)
    return z, z, z, z


@triton.jit
def count(c0, c1, c2, c3, digit, ok, NB: tl.constexpr):
    """Add the digits (0 <= digit < NB) where ok: packed per slot for 16 bins, else a histogram in c0."""
    if NB == 16:
        one = tl.where(ok, 1 << ((digit & 3) * 8), 0)
        w = digit >> 2
        c0 += tl.where(w == 0, one, 0)
        c1 += tl.where(w == 1, one, 0)
        c2 += tl.where(w == 2, one, 0)
        c3 += tl.where(w == 3, one, 0)
    else:
        c0 += tl.histogram(digit, NB, mask=ok)
    return c0, c1, c2, c3


@triton.jit
def counts_total(c0, c1, c2, c3, NB: tl.constexpr):
    """[NB] bin counts of what `count` gathered."""
    if NB == 16:
        bins = tl.arange(0, 16)
        acc = tl.zeros([16], tl.int32)
        for f in tl.static_range(4):
            acc += tl.where(bins == f, tl.sum((c0 >> (8 * f)) & 255, 0), 0)
            acc += tl.where(bins == 4 + f, tl.sum((c1 >> (8 * f)) & 255, 0), 0)
            acc += tl.where(bins == 8 + f, tl.sum((c2 >> (8 * f)) & 255, 0), 0)
            acc += tl.where(bins == 12 + f, tl.sum((c3 >> (8 * f)) & 255, 0), 0)
    else:
        acc = c0
    return acc


def upcast_dot(dtype: torch.dtype) -> bool:
    """The interpreter multiplies bf16 operands as raw 16-bit integers (np.matmul on the bit
    patterns): upcast them to fp32 there. On the GPU bf16 goes to the tensor cores as is."""
    return interpreting() and dtype == torch.bfloat16


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)
