"""The Triton kernels of sparse_fx.lowering.kernels against lowering/reference.py.

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (small shapes: the interpreter
is slow); with CUDA the same tests run on the GPU, plus the `gpu`-marked ones at real shapes.
Outputs and kernel scratch are poisoned (NaN / a sentinel) before the kernels write, so an element
a kernel forgets to write, or scratch it reads before writing, shows up. Attention is checked
against an independent fp64 dense attention masked to the selected positions.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_fx.lowering import kernels as K
from sparse_fx.lowering import reference as ref
from sparse_fx.lowering.kernels import select as ksel

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
SENTINEL = -777_777_777
FAST = settings(deadline=None, max_examples=8, suppress_health_check=list(HealthCheck))
MORE = settings(deadline=None, max_examples=25 if CUDA else 12, suppress_health_check=list(HealthCheck))  # the interpreter is slow


@contextlib.contextmanager
def poisoned():
    """torch.empty / empty_like hand out NaN- or sentinel-filled memory while the kernels allocate."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype in (torch.int32, torch.int64):
            t.fill_(SENTINEL)
        return t

    torch.empty = lambda *a, **kw: fill(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: fill(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def make_mask(kind: str, B: int, Hq: int, L: int, g, dtype=torch.float32, now: int | None = None):
    """SDPA masks of every form the ops accept: None, bool [B,1,1,L], bool per head, additive with
    -inf, additive with finfo.min (HF), per-head additive."""
    if kind == "none":
        return None
    heads = Hq if kind.endswith("head") else 1
    keep = torch.rand(B, heads, 1, L, generator=g) > 0.25
    if now is not None:
        keep[..., now + 1 :] = False
    if kind.startswith("bool"):
        return keep.to(DEV)
    fill = float("-inf") if kind.startswith("inf") else torch.finfo(dtype).min
    m = torch.zeros(B, heads, 1, L).masked_fill(~keep, fill)
    m = m + 0.1 * torch.randn(B, heads, 1, L, generator=g) * keep  # small finite biases too
    return m.to(dtype).to(DEV)


MASK_KINDS = ["none", "bool", "bool-head", "inf", "min", "inf-head"]


# ----------------------------------------------------------------------------- signatures
@FAST
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=3), words=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_pack_signs_matches_reference(lead, words, dtype, seed):
    g = gen(seed)
    x = torch.randn(*lead, 32 * words, generator=g)
    x[torch.rand(x.shape, generator=g) < 0.1] = 0.0  # exact zeros are not > 0
    x[torch.rand(x.shape, generator=g) < 0.05] = -0.0
    x = x.to(dtype).to(DEV)
    with poisoned():
        got = K.pack_signs(x)
    assert got.dtype == torch.int32 and got.shape == (*lead, words)
    assert torch.equal(got.cpu(), ref.pack_signs(x.cpu()))
    # round trip: bit j of word w is x[32w + j] > 0
    w = got.cpu().to(torch.int64) & 0xFFFFFFFF
    unpacked = ((w[..., None] >> torch.arange(32)) & 1).reshape(*lead, 32 * words).bool()
    assert torch.equal(unpacked, x.cpu() > 0)


@pytest.mark.parametrize("reset,start", [(False, 5), (True, 0), (True, 3)])
def test_signature_write_scatter_and_reset(reset, start):
    g = gen(1)
    B, H, L, W, T = 2, 3, 40, 2, 6
    cache = torch.randint(-(2**31), 2**31 - 1, (B, H, L, W), generator=g, dtype=torch.int32).to(DEV)
    logits = randn(B, H, T, 32 * W, g=g)
    pos = torch.arange(start, start + T, device=DEV)
    expect = cache.cpu().clone()
    ref.signature_write(expect, logits.cpu(), pos.cpu(), reset)
    with poisoned():
        K.signature_write(cache, logits, pos, reset)
    assert torch.equal(cache.cpu(), expect)


def test_signature_write_non_contiguous_positions():
    g = gen(2)
    cache = torch.zeros(1, 2, 50, 1, dtype=torch.int32, device=DEV)
    logits = randn(1, 2, 4, 32, g=g)
    pos = torch.tensor([7, 3, 41, 20], device=DEV)
    K.signature_write(cache, logits, pos)
    expect = torch.zeros(1, 2, 50, 1, dtype=torch.int32)
    ref.signature_write(expect, logits.cpu(), pos.cpu())
    assert torch.equal(cache.cpu(), expect)


def _hamming_bitwise(q_sig, k_sig):
    """Bit-by-bit oracle: count equal bits, summed over each KV head's query heads."""
    B, Hq, W = q_sig.shape
    Hkv = k_sig.shape[1]
    qb = ((q_sig.long()[..., None] >> torch.arange(32)) & 1).reshape(B, Hkv, Hq // Hkv, 1, W * 32)
    kb = ((k_sig.long()[..., None] >> torch.arange(32)) & 1).reshape(B, Hkv, 1, -1, W * 32)
    return (qb == kb).sum(-1).sum(2).to(ref.hamming_dtype(Hq // Hkv, W))


@FAST
@given(B=st.integers(1, 2), Hkv=st.integers(1, 3), G=st.sampled_from([1, 2, 4]), W=st.integers(1, 2),
       L=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_hamming_scores_matches_reference_and_bitwise(B, Hkv, G, W, L, seed):
    g = gen(seed)
    q = torch.randint(-(2**31), 2**31 - 1, (B, Hkv * G, W), generator=g, dtype=torch.int32)
    k = torch.randint(-(2**31), 2**31 - 1, (B, Hkv, L, W), generator=g, dtype=torch.int32)
    k[..., :3, :] = q[:, ::G][:, :, None, :]  # exact matches (score 32W per head)
    k[..., 3:5, :] = ~q[:, ::G][:, :, None, :]  # all bits differ
    with poisoned():
        got = K.hamming_scores(q.to(DEV), k.to(DEV)).cpu()
    assert torch.equal(got, ref.hamming_scores(q, k))
    assert torch.equal(got, _hamming_bitwise(q, k))


def test_hamming_scores_many_heads_no_byte_overflow():
    """G * W > 31 terms: the byte-wise partial popcounts must be flushed before they overflow."""
    g = gen(3)
    q = torch.randint(-(2**31), 2**31 - 1, (1, 40, 1), generator=g, dtype=torch.int32)
    k = torch.cat([~q[:, :1, None, :].expand(1, 1, 8, 1), torch.randint(-(2**31), 2**31 - 1, (1, 1, 8, 1), generator=g, dtype=torch.int32)], 2)
    q[:] = q[:, :1]  # all 40 heads equal: the first keys differ in every bit from every head
    got = K.hamming_scores(q.to(DEV), k.to(DEV)).cpu()
    assert torch.equal(got, ref.hamming_scores(q, k))


# ----------------------------------------------------------------------------------- INT2
def _int2_inputs(B, H, T, D, group, dtype, g):
    k = torch.randn(B, H, T, D, generator=g) * 3
    M = D // group
    kg = k.view(B, H, T, M, group)
    kg[:, :, 0] = 1.25  # constant group: scale 0, codes 0
    if T > 1 and group >= 4:  # exact half steps: round half to even
        kg[:, :, 1, :, :4] = torch.tensor([0.0, 1.5, 2.5, 3.0])
        kg[:, :, 1, :, 4:] = 1.0
    return k.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,group", [(16, 16), (64, 32), (64, 16), (64, 64), (64, 4)])
@pytest.mark.parametrize("reset", [False, True])
def test_int2_write_bit_exact(dtype, D, group, reset):
    g = gen(D + group)
    B, H, T, L = 2, 2, 5, 24
    k = _int2_inputs(B, H, T, D, group, dtype, g)
    pos = torch.arange(0 if reset else 7, (0 if reset else 7) + T, device=DEV)
    codes = torch.randint(-(2**31), 2**31 - 1, (B, H, L, D // 16), generator=g, dtype=torch.int32).to(DEV)
    scale = torch.randn(B, H, L, D // group, generator=g).half().to(DEV)
    zero = torch.randn(B, H, L, D // group, generator=g).half().to(DEV)
    want = [t.cpu().clone() for t in (codes, scale, zero)]
    ref.int2_write(*want, k.cpu(), pos.cpu(), reset)
    with poisoned():
        K.int2_write(codes, scale, zero, k, pos, reset)
    assert torch.equal(scale.cpu(), want[1])
    assert torch.equal(zero.cpu(), want[2])
    assert torch.equal(codes.cpu(), want[0]), (codes.cpu() != want[0]).sum()


@FAST
@given(T=st.integers(1, 40), scale_exp=st.integers(-12, 8), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_int2_write_bit_exact_any_magnitude(T, scale_exp, seed, dtype):
    """Tiny and large key magnitudes (fp16 scale underflow / subnormals) stay bit-exact."""
    g = gen(seed)
    D, group, L = 64, 32, 48
    k = (torch.randn(1, 2, T, D, generator=g) * 2.0**scale_exp).to(dtype).to(DEV)
    pos = torch.randperm(L, generator=g)[:T].to(DEV)
    bufs = [torch.zeros(1, 2, L, D // 16, dtype=torch.int32, device=DEV),
            torch.zeros(1, 2, L, D // group, dtype=torch.float16, device=DEV),
            torch.zeros(1, 2, L, D // group, dtype=torch.float16, device=DEV)]
    want = [t.cpu().clone() for t in bufs]
    ref.int2_write(*want, k.cpu(), pos.cpu())
    K.int2_write(*bufs, k, pos)
    for got, w in zip(bufs, want):
        assert torch.equal(got.cpu(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G,D,group", [(1, 16, 16), (2, 64, 32), (4, 64, 16), (4, 64, 64)])
def test_int2_scores_matches_reference(dtype, G, D, group):
    g = gen(G * D + group)
    B, Hkv, L = 2, 2, 150
    k = randn(B, Hkv, L, D, g=g) * 2
    codes = torch.empty(B, Hkv, L, D // 16, dtype=torch.int32, device=DEV)
    scale = torch.empty(B, Hkv, L, D // group, dtype=torch.float16, device=DEV)
    zero = torch.empty_like(scale)
    ref_c, ref_s, ref_z = ref.int2_quantize(k.cpu(), group)
    codes.copy_(ref_c), scale.copy_(ref_s), zero.copy_(ref_z)
    q = randn(B, Hkv * G, 1, D, g=g, dtype=dtype)
    with poisoned():
        got = K.int2_scores(q, codes, scale, zero).cpu()
    want = ref.int2_scores(q.cpu(), *(t.cpu() for t in (codes, scale, zero)))
    assert got.dtype == torch.float32 and got.shape == (B, Hkv, L)
    tol = 2e-5 * want.abs().max().item() * math.sqrt(D)
    torch.testing.assert_close(got, want, atol=tol, rtol=1e-5)


# ----------------------------------------------------------------------------- mass scores
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("pooled", [False, True])
def test_mass_scores_matches_reference(dtype, mask_kind, pooled):
    g = gen(len(mask_kind) + pooled)
    B, Hkv, G, L, D = 2, 2, 2, 130, 16
    q = randn(B, Hkv * G, 1, D, g=g, dtype=dtype) * 2
    k = randn(B, Hkv, L, D, g=g, dtype=dtype)
    mask = make_mask(mask_kind, B, Hkv * G, L, g, torch.float32 if dtype == torch.float32 else dtype)
    positions = None
    if pooled:
        positions = torch.stack([torch.stack([torch.randperm(L, generator=g)[:90] for _ in range(Hkv)]) for _ in range(B)])
        positions[:, :, ::6] = -1
        positions = positions.to(DEV)
    with poisoned():
        got = K.mass_scores(q, k, 0.3, mask, positions).cpu()
    want = ref.mass_scores(q.cpu(), k.cpu(), 0.3, None if mask is None else mask.cpu(),
                           None if positions is None else positions.cpu())
    torch.testing.assert_close(got, want, atol=2e-5 if dtype == torch.float32 else 1e-4, rtol=1e-4)


def test_mass_scores_each_head_sums_to_one():
    g = gen(9)
    B, Hkv, G, L, D = 1, 2, 4, 200, 64
    q, k = randn(B, Hkv * G, 1, D, g=g), randn(B, Hkv, L, D, g=g)
    got = K.mass_scores(q, k).cpu()
    torch.testing.assert_close(got.sum(-1), torch.full((B, Hkv), float(G)), atol=1e-4, rtol=0)


def test_mass_scores_nothing_readable_is_zero():
    g = gen(10)
    q, k = randn(1, 4, 1, 16, g=g), randn(1, 2, 64, 16, g=g)
    mask = torch.zeros(1, 1, 1, 64, dtype=torch.bool, device=DEV)
    assert torch.equal(K.mass_scores(q, k, None, mask).cpu(), torch.zeros(1, 2, 64))


# ------------------------------------------------------------------------------- selection
def _eligibility(scores, pos, sink, local, mask, positions):
    """[B,Hkv,N] bool and the candidate positions, from the op's contract (not the reference code)."""
    B, Hkv, N = scores.shape
    now = int(pos[-1])
    cand = torch.arange(N).expand(B, Hkv, N) if positions is None else positions.long()
    ok = (cand >= sink) & (cand <= now - local) & (cand >= 0) & (scores.float() > float("-inf"))
    if mask is not None:
        L = mask.shape[-1]
        readable = ref.valid_positions(mask, B, Hkv, L)
        ok &= torch.gather(readable, 2, cand.clamp(0, L - 1))
    return ok, cand


def check_selection(out, scores, pos, k, sink, local, mask=None, positions=None):
    """The contract of select_topk, row by row (order inside the top-k part is free)."""
    scores, pos = scores.cpu(), pos.cpu()
    mask = None if mask is None else mask.cpu()
    positions = None if positions is None else positions.cpu()
    out = out.cpu()
    W = sink + local
    want = ref.select_topk(scores, pos, k, sink, local, mask, positions)
    assert out.shape == want.shape and out.dtype == torch.int32
    assert (out != SENTINEL).all(), "an output slot was never written"
    assert torch.equal(out[..., :W], want[..., :W]), "window part differs"
    elig, cand = _eligibility(scores, pos, sink, local, mask, positions)
    B, Hkv, N = scores.shape
    for b in range(B):
        for h in range(Hkv):
            top = out[b, h, W:]
            chosen = top[top >= 0].tolist()
            assert (top[len(chosen):] == -1).all() and (top[: len(chosen)] >= 0).all(), "-1 padding must trail"
            assert len(set(chosen)) == len(chosen), "duplicate positions"
            score_of = {int(c): float(scores[b, h, i]) for i, c in enumerate(cand[b, h].tolist()) if elig[b, h, i]}
            assert set(chosen) <= set(score_of), "chose an ineligible position"
            assert len(chosen) == min(k, len(score_of)), "wrong count"
            rest = set(score_of) - set(chosen)
            if chosen and rest:
                assert min(score_of[c] for c in chosen) >= max(score_of[c] for c in rest), "not the top k"
            ref_top = want[b, h, W:]
            assert sorted(score_of[c] for c in chosen) == sorted(score_of[int(c)] for c in ref_top if c >= 0)


def _scores(kind, B, Hkv, N, g):
    if kind == "float":
        return torch.randn(B, Hkv, N, generator=g)
    if kind == "hamming":  # uint8 Hamming similarities: few distinct values, heavy ties
        return torch.randint(40, 90, (B, Hkv, N), generator=g, dtype=torch.int32).to(torch.uint8)
    if kind == "wide-int":  # int32 scores over a wide range: the two-level histogram
        return torch.randint(-50000, 50000, (B, Hkv, N), generator=g, dtype=torch.int32)
    if kind == "mass":  # nonnegative, some exact zeros, some -inf
        s = torch.rand(B, Hkv, N, generator=g) ** 4
        s[s < 0.01] = 0.0
        s[torch.rand(B, Hkv, N, generator=g) < 0.05] = float("-inf")
        return s
    if kind == "near-ties":  # many scores a few ULPs apart around the threshold: the exact resolve
        return 1.0 + torch.randint(0, 200, (B, Hkv, N), generator=g).float() * 2**-23
    raise ValueError(kind)


SCORE_KINDS = ["float", "hamming", "wide-int", "mass", "near-ties"]


@pytest.mark.parametrize("kind", SCORE_KINDS)
@pytest.mark.parametrize("mask_kind", ["bool", "min"])
def test_select_topk_matches_contract(kind, mask_kind):
    g = gen(len(kind) * 7 + len(mask_kind))
    B, Hkv, N = 2, 2, 300
    scores = _scores(kind, B, Hkv, N, g).to(DEV)
    pos = torch.tensor([270], device=DEV)
    mask = make_mask(mask_kind, B, Hkv * 2, N, g, now=270)
    with poisoned():
        out = K.select_topk(scores, pos, 50, 4, 16, mask)
    check_selection(out, scores, pos, 50, 4, 16, mask)


def test_select_topk_crowded_final_bin_still_takes_the_top():
    """More than BUF candidates share the final bin (exact ties): any of them may be taken."""
    g = gen(21)
    N = 3000
    scores = torch.zeros(1, 2, N)
    scores[..., :100] = 5.0 + torch.rand(1, 2, 100, generator=g)  # clearly above
    out = K.select_topk(scores.to(DEV), torch.tensor([N - 1], device=DEV), 600, 0, 1)
    check_selection(out, scores.to(DEV), torch.tensor([N - 1], device=DEV), 600, 0, 1)


@MORE
@given(
    kind=st.sampled_from(SCORE_KINDS),
    mask_kind=st.sampled_from(MASK_KINDS),
    pooled=st.booleans(),
    k=st.integers(1, 320),
    sink=st.integers(0, 20),
    local=st.integers(0, 40),
    now=st.integers(0, 299),
    G=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_select_topk_property(kind, mask_kind, pooled, k, sink, local, now, G, seed):
    g = gen(seed)
    B, Hkv, L = 1, 2, 300
    N = 120 if pooled else L
    scores = _scores(kind, B, Hkv, N, g).to(DEV)
    pos = torch.tensor([max(now - 2, 0), now], device=DEV)
    mask = make_mask(mask_kind, B, Hkv * G, L, g, now=now)
    positions = None
    if pooled:
        positions = torch.stack([torch.randperm(L, generator=g)[:N] for _ in range(Hkv)])[None]
        positions[..., ::5] = -1
        positions = positions.to(DEV)
    with poisoned():
        out = K.select_topk(scores, pos, k, sink, local, mask, positions)
    check_selection(out, scores, pos, k, sink, local, mask, positions)


def test_select_topk_k_beyond_row_and_empty_rows():
    g = gen(11)
    scores = torch.randn(1, 2, 40, generator=g).to(DEV)
    pos = torch.tensor([3], device=DEV)  # early in the sequence: sink/local cover everything
    out = K.select_topk(scores, pos, 64, 8, 8)
    check_selection(out, scores, pos, 64, 8, 8)
    assert (out[..., 16:] == -1).all()
    pos = torch.tensor([39], device=DEV)
    out = K.select_topk(scores, pos, 64, 2, 2)
    check_selection(out, scores, pos, 64, 2, 2)


def test_select_then_attention_matches_reference_pipeline():
    """Float scores without ties: the kernel selection is the reference selection, so the whole
    score -> select -> attend step matches the reference step."""
    g = gen(12)
    B, Hkv, G, L, D = 2, 2, 2, 256, 64
    q, k, v = randn(B, Hkv * G, 1, D, g=g), randn(B, Hkv, L, D, g=g), randn(B, Hkv, L, D, g=g)
    mask = make_mask("min", B, 1, L, g, now=230)
    pos = torch.tensor([230], device=DEV)
    scores = K.mass_scores(q, k, None, mask)
    idx = K.select_topk(scores, pos, 32, 4, 8, mask)
    out = K.sparse_decode_attention(q, k, v, idx, None, mask)
    r_scores = ref.mass_scores(q.cpu(), k.cpu(), None, mask.cpu())
    r_idx = ref.select_topk(r_scores, pos.cpu(), 32, 4, 8, mask.cpu())
    r_out = ref.sparse_decode_attention(q.cpu(), k.cpu(), v.cpu(), r_idx, None, mask.cpu())
    assert torch.equal(idx.cpu().sort(-1).values, r_idx.sort(-1).values)
    torch.testing.assert_close(out.cpu(), r_out, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------ gather-attention
def dense_oracle(q, k, v, indices, scale, mask):
    """fp64 dense attention over all L positions, with everything outside `indices` masked."""
    q, k, v = q.cpu().double(), k.cpu().double(), v.cpu().double()
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    chosen = torch.zeros(B, Hkv, L + 1, dtype=torch.bool)
    chosen.scatter_(2, torch.where(indices.cpu() >= 0, indices.cpu().long(), L), True)
    bias = torch.zeros(B, Hq, L, dtype=torch.float64).masked_fill(~chosen[..., :L].repeat_interleave(G, 1), float("-inf"))
    if mask is not None:
        m = mask.cpu()
        m = torch.zeros(m.shape, dtype=torch.float64).masked_fill(~m, float("-inf")) if m.dtype == torch.bool else m.double()
        bias = bias + m[:, :, 0, :].expand(B, Hq, L)
    kr, vr = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    logits = (q @ kr.transpose(-1, -2))[:, :, 0] * scale + bias
    w = torch.softmax(logits, -1)
    w = torch.nan_to_num(w, nan=0.0)  # a head with nothing readable: zeros, as the op
    return (w[:, :, None] @ vr).reshape(B, Hq, 1, -1)


TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=1e-3)}


def _indices(B, Hkv, L, n, g, pad_every=0):
    idx = torch.stack([torch.stack([torch.randperm(L, generator=g)[:n] for _ in range(Hkv)]) for _ in range(B)])
    if pad_every:
        idx[:, :, ::pad_every] = -1
    return idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [16, 64])
@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("nidx", [40, 200])  # one split / several splits + the combine kernel
def test_sparse_attention_matches_fp64_dense(dtype, D, G, nidx):
    g = gen(D * G + nidx)
    B, Hkv, L = 2, 2, 256
    q, k, v = (randn(B, Hkv * G, 1, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype),
               randn(B, Hkv, L, D, g=g, dtype=dtype))
    idx = _indices(B, Hkv, L, nidx, g, pad_every=7).to(DEV)
    with poisoned():
        out = K.sparse_decode_attention(q, k, v, idx)
    assert out.dtype == dtype and out.shape == (B, Hkv * G, 1, D)
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, k, v, idx, None, None), **TOL[dtype])


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_masks(mask_kind, dtype):
    g = gen(len(mask_kind) * 3)
    B, Hkv, G, L, D = 2, 2, 2, 200, 64
    q, k, v = (randn(B, Hkv * G, 1, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype),
               randn(B, Hkv, L, D, g=g, dtype=dtype))
    idx = _indices(B, Hkv, L, 150, g, pad_every=5).to(DEV)
    mask = make_mask(mask_kind, B, Hkv * G, L, g, torch.float32 if dtype == torch.float32 else dtype)
    with poisoned():
        out = K.sparse_decode_attention(q, k, v, idx, 0.2, mask)
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, k, v, idx, 0.2, mask), **TOL[dtype])


@FAST
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), G=st.sampled_from([1, 2, 4]), L=st.integers(1, 160),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), mask_kind=st.sampled_from(MASK_KINDS),
       seed=st.integers(0, 2**16))
def test_sparse_attention_full_budget_is_dense(B, Hkv, G, L, dtype, mask_kind, seed):
    """budget >= length: attending to every position is dense SDPA."""
    g = gen(seed)
    D = 16
    q, k, v = (randn(B, Hkv * G, 1, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype),
               randn(B, Hkv, L, D, g=g, dtype=dtype))
    mask = make_mask(mask_kind, B, Hkv * G, L, g, torch.float32 if dtype == torch.float32 else dtype)
    idx = torch.arange(L, device=DEV).expand(B, Hkv, L).contiguous()
    out = K.sparse_decode_attention(q, k, v, idx, None, mask)
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, k, v, idx, None, mask), **TOL[dtype])
    if mask is None:
        dense = torch.nn.functional.scaled_dot_product_attention(
            q.cpu().double(), k.cpu().double().repeat_interleave(G, 1), v.cpu().double().repeat_interleave(G, 1))
        torch.testing.assert_close(out.cpu().double(), dense, **TOL[dtype])


def test_sparse_attention_empty_selection_is_zero():
    g = gen(13)
    q, k, v = randn(1, 4, 1, 64, g=g), randn(1, 2, 32, 64, g=g), randn(1, 2, 32, 64, g=g)
    idx = torch.full((1, 2, 100), -1, dtype=torch.int32, device=DEV)
    idx[0, 1, 3] = 5  # KV head 1 reads one position; head 0 nothing
    with poisoned():
        out = K.sparse_decode_attention(q, k, v, idx).cpu()
    assert torch.equal(out[0, :2], torch.zeros(2, 1, 64))
    torch.testing.assert_close(out[0, 2:], v.cpu()[0, 1, 5].expand(2, 1, 64))
    fully_masked = torch.zeros(1, 1, 1, 32, dtype=torch.bool, device=DEV)
    assert torch.equal(K.sparse_decode_attention(q, k, v, idx, None, fully_masked).cpu(), torch.zeros(1, 4, 1, 64))
    assert torch.equal(K.sparse_decode_attention(q, k, v, idx[..., :0]).cpu(), torch.zeros(1, 4, 1, 64))


def test_sparse_attention_strided_inputs():
    """Non-contiguous q/k/v/indices (views of bigger buffers) read through their strides."""
    g = gen(14)
    q = randn(1, 8, 1, 128, g=g)[:, ::2, :, :64]
    kv = randn(1, 2, 2, 96, 64, g=g)
    k, v = kv[:, 0], kv[:, 1]
    idx = _indices(1, 2, 96, 80, g, pad_every=9).to(DEV).transpose(0, 1).contiguous().transpose(0, 1)
    out = K.sparse_decode_attention(q, k, v, idx)
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, k, v, idx, None, None), **TOL[torch.float32])


# ------------------------------------------------------------------------------ predicates
def test_supported_predicates_reject_what_kernels_cannot_do():
    q = torch.zeros(1, 4, 1, 48, device=DEV)  # head dim 48: not a power of two
    k = torch.zeros(1, 2, 8, 48, device=DEV)
    idx = torch.zeros(1, 2, 4, dtype=torch.int32, device=DEV)
    assert not K.sparse_decode_attention_supported(q, k, k, idx)
    assert not K.mass_scores_supported(q, k)
    q64 = torch.zeros(1, 4, 1, 64, device=DEV)
    k64 = torch.zeros(1, 2, 8, 64, device=DEV)
    assert K.sparse_decode_attention_supported(q64, k64, k64, idx)
    assert not K.sparse_decode_attention_supported(q64.double(), k64.double(), k64.double(), idx)
    assert not K.sparse_decode_attention_supported(q64, k64, k64, idx.float())
    # cross-device inputs never go to a kernel
    assert not K.sparse_decode_attention_supported(q64, k64, k64, idx, None, torch.zeros(1, 1, 1, 8, device="meta"))


# ------------------------------------------------------------------ GPU code, compiled on CPU
@pytest.mark.skipif(not (pathlib.Path(__import__("triton").__file__).parent / "backends/nvidia/bin/ptxas").exists(),
                    reason="triton without the NVIDIA backend tools")
def test_gpu_code_paths_compile_for_sm90():
    """Every launch configuration the ops use compiles for sm_90 without spilling: the GPU-only
    paths (pipelined loops, bf16 tensor-core dots) that the interpreter never runs. A subprocess,
    since the kernels must be JITFunctions (no TRITON_INTERPRET)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "sparse_fx.lowering.kernels.compile_check"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = re.findall(r"^(.+?)\s+regs\s+(\d+) local\s+(\d+) smem\s+(\d+)$", run.stdout, re.M)
    assert len(rows) >= 20, run.stdout
    spills = [r for r in rows if int(r[2]) > 0]
    assert not spills, f"register spills: {spills}"


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.parametrize("op", ["sparse_decode_attention", "select_topk", "hamming_scores", "pack_signs",
                                "signature_write", "int2_write", "int2_scores", "mass_scores"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_ops_dispatch_to_kernels_on_cuda(op, monkeypatch):
    from sparse_fx.lowering import ops  # noqa: F401 (registers torch.ops.sparse_fx)

    calls = []
    real = getattr(K, op)
    monkeypatch.setattr(K, op, lambda *a, **kw: calls.append(op) or real(*a, **kw))
    g = gen(15)
    B, Hkv, G, L, D = 1, 2, 2, 64, 64
    q, k, v = randn(B, Hkv * G, 1, D, g=g), randn(B, Hkv, L, D, g=g), randn(B, Hkv, L, D, g=g)
    pos = torch.tensor([40], device=DEV)
    o = torch.ops.sparse_fx
    if op == "sparse_decode_attention":
        o.sparse_decode_attention(q, k, v, torch.arange(10, device=DEV).expand(B, Hkv, 10).contiguous())
    elif op == "select_topk":
        o.select_topk(torch.randn(B, Hkv, L, device=DEV), pos, 8, 2, 2)
    elif op == "hamming_scores":
        o.hamming_scores(torch.zeros(B, Hkv * G, 1, dtype=torch.int32, device=DEV), torch.zeros(B, Hkv, L, 1, dtype=torch.int32, device=DEV))
    elif op == "pack_signs":
        o.pack_signs(torch.randn(3, 64, device=DEV))
    elif op == "signature_write":
        o.signature_write(torch.zeros(B, Hkv, L, 1, dtype=torch.int32, device=DEV), torch.randn(B, Hkv, 1, 32, device=DEV), pos)
    elif op == "int2_write":
        o.int2_write(torch.zeros(B, Hkv, L, D // 16, dtype=torch.int32, device=DEV), torch.zeros(B, Hkv, L, 2, dtype=torch.float16, device=DEV),
                     torch.zeros(B, Hkv, L, 2, dtype=torch.float16, device=DEV), k[:, :, :1], pos)
    elif op == "int2_scores":
        o.int2_scores(q, torch.zeros(B, Hkv, L, D // 16, dtype=torch.int32, device=DEV), torch.ones(B, Hkv, L, 2, dtype=torch.float16, device=DEV),
                      torch.zeros(B, Hkv, L, 2, dtype=torch.float16, device=DEV))
    elif op == "mass_scores":
        o.mass_scores(q, k)
    assert calls == [op]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind,L,k", [("hamming", 131072, 4096), ("float", 131072, 16384), ("float", 16384, 4096),
                                      ("hamming", 524288, 16384), ("mass", 32768, 1024)])
def test_select_topk_real_shapes(kind, L, k):
    g = gen(16)
    B, Hkv = 2, 8
    scores = (_scores(kind, B, Hkv, L, g) if kind != "hamming" else torch.randint(0, 129, (B, Hkv, L), generator=g, dtype=torch.uint8)).to(DEV)
    pos = torch.tensor([L - 5], device=DEV)
    mask = torch.zeros(B, 1, 1, L, dtype=torch.bfloat16, device=DEV)
    mask[..., L - 4:] = torch.finfo(torch.bfloat16).min
    out = K.select_topk(scores, pos, k, 128, 128, mask)
    check_selection(out[:1, :2], scores[:1, :2], pos, k, 128, 128, mask[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 128])
def test_sparse_attention_real_shapes(dtype, D):
    g = gen(17)
    B, Hkv, G, L, n = 2, 8, 4, 32768, 4352
    q, k, v = (randn(B, Hkv * G, 1, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype),
               randn(B, Hkv, L, D, g=g, dtype=dtype))
    idx = _indices(B, Hkv, L, n, g, pad_every=11).to(DEV)
    mask = make_mask("min", B, 1, L, g, dtype)
    out = K.sparse_decode_attention(q, k, v, idx, None, mask)
    want = ref.sparse_decode_attention(q.double(), k.double(), v.double(), idx, None, mask.double())
    torch.testing.assert_close(out.double(), want, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_decode_step_captures_in_cuda_graph():
    """score -> select -> attend replays under a CUDA graph and tracks new inputs in place."""
    g = gen(18)
    B, Hkv, G, L, D = 2, 8, 4, 8192, 128
    q, k, v = (randn(B, Hkv * G, 1, D, g=g, dtype=torch.bfloat16), randn(B, Hkv, L, D, g=g, dtype=torch.bfloat16),
               randn(B, Hkv, L, D, g=g, dtype=torch.bfloat16))
    pos = torch.tensor([L - 1], device=DEV)

    def step():
        scores = K.mass_scores(q, k)
        idx = K.select_topk(scores, pos, 256, 16, 16)
        return K.sparse_decode_attention(q, k, v, idx)

    eager = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.testing.assert_close(out, eager)
    q.copy_(randn(B, Hkv * G, 1, D, g=g, dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(out, step())


def test_select_kernels_get_private_copies_of_graph_inputs_and_views():
    """Inductor's analysis of what a user kernel writes over-reports for the selection kernels (a
    pointer passed to a helper counts as written), so the cache position and a Prism pool (a slice
    view) must reach them as private copies: else the compiled graph functionalises them as
    mutated, and on the GPU the refined layers read garbage pool positions."""
    from sparse_fx.lowering.kernels.compile_check import recording

    scores = torch.randn(2, 2, 64)
    pos = torch.tensor([90, 91])
    ranked = (torch.arange(2 * 2 * 80, dtype=torch.int32) % 80).reshape(2, 2, 80)
    mask = torch.zeros(2, 1, 1, 92)
    with recording() as launches:
        ksel.select_topk(scores, pos, 8, 4, 4, mask, ranked[:, :, 16:])
    assert launches
    inputs = {t.untyped_storage().data_ptr() for t in (pos, ranked, mask)}
    for _, _, args, kwargs in launches:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor):
                assert a.untyped_storage().data_ptr() not in inputs
