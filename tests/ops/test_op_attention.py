"""sparse_decode_attention against an independent fp64 dense attention masked to the selection."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import DEV, FAST, MASK_KINDS, gen, make_mask, poisoned, randn

import sparse_fx
from sparse_fx.lowering import kernels as K
from sparse_fx.lowering import reference as ref


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
    w = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)  # a head with nothing readable: zeros, as the op
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


@pytest.mark.parametrize("knobs", [dict(block_n=32, stages=3, waves=4), dict(block_n=64, stages=2, waves=16)])
def test_sparse_attention_launch_knobs_do_not_change_the_result(knobs):
    g = gen(21)
    B, Hkv, G, L, D = 2, 2, 4, 300, 64
    q, k, v = randn(B, Hkv * G, 1, D, g=g), randn(B, Hkv, L, D, g=g), randn(B, Hkv, L, D, g=g)
    idx = _indices(B, Hkv, L, 250, g, pad_every=9).to(DEV)
    mask = make_mask("min", B, 1, L, g)
    out = K.sparse_decode_attention(q, k, v, idx, None, mask, **knobs)
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, k, v, idx, None, mask), **TOL[torch.float32])


def test_sparse_attention_many_splits_merge_in_steps():
    """More splits than the combine merges at once (64 partials a head, 32 a step), padded heads
    (G=3 in a 16-row tile) whose partials are never written nor read."""
    g = gen(22)
    B, Hkv, G, L, D = 1, 2, 3, 1200, 32
    q, k, v = randn(B, Hkv * G, 1, D, g=g), randn(B, Hkv, L, D, g=g), randn(B, Hkv, L, D, g=g)
    idx = _indices(B, Hkv, L, 1100, g, pad_every=7).to(DEV)
    with poisoned():
        out = K.sparse_decode_attention(q, k, v, idx, None, None, block_n=16, waves=64, max_splits=256)
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, k, v, idx, None, None), **TOL[torch.float32])


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


def test_supported_predicates_reject_what_kernels_cannot_do():
    q = torch.zeros(1, 4, 1, 48, device=DEV)  # head dim 48: not a power of two
    k = torch.zeros(1, 2, 8, 48, device=DEV)
    idx = torch.zeros(1, 2, 4, dtype=torch.int32, device=DEV)
    assert not K.sparse_decode_attention_supported(q, k, k, idx)
    assert not K.mass_scores_supported(q, k)
    q64, k64 = torch.zeros(1, 4, 1, 64, device=DEV), torch.zeros(1, 2, 8, 64, device=DEV)
    assert K.sparse_decode_attention_supported(q64, k64, k64, idx)
    assert not K.sparse_decode_attention_supported(q64.double(), k64.double(), k64.double(), idx)
    assert not K.sparse_decode_attention_supported(q64, k64, k64, idx.float())
    assert not K.sparse_decode_attention_supported(q64, k64, k64, idx, None, torch.zeros(1, 1, 1, 8, device="meta"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 128])
def test_sparse_attention_real_shapes(dtype, D):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = gen(17)
    B, Hkv, G, L, n = 2, 8, 4, 32768, 4352
    q, k, v = (randn(B, Hkv * G, 1, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype),
               randn(B, Hkv, L, D, g=g, dtype=dtype))
    idx = _indices(B, Hkv, L, n, g, pad_every=11).to(DEV)
    mask = make_mask("min", B, 1, L, g, dtype)
    out = K.sparse_decode_attention(q, k, v, idx, None, mask)
    want = ref.sparse_decode_attention(q.double(), k.double(), v.double(), idx, None, mask.double())
    torch.testing.assert_close(out.double(), want, **TOL[dtype])


test_sparse_attention_real_shapes = pytest.mark.gpu(test_sparse_attention_real_shapes)


# ------------------------------------------------------------------ through torch.ops (any head dim: the reference)
def dense_masked_fp64(q, k, v, keep, scale, bias=None):
    """Oracle: fp64 dense attention where only `keep` [B,Hq,L] positions count (plus `bias`)."""
    B, Hq, _, D = q.shape
    G = Hq // k.shape[1]
    kk = k.double().repeat_interleave(G, 1)
    vv = v.double().repeat_interleave(G, 1)
    logits = (q.double() @ kk.transpose(-1, -2))[:, :, 0] * scale  # [B,Hq,L]
    if bias is not None:
        logits = logits + bias
    logits = logits.masked_fill(~keep, float("-inf"))
    w = torch.softmax(logits, -1).nan_to_num(0.0)
    return (w[:, :, None, :] @ vv)  # [B,Hq,1,Dv]


@st.composite
def attention_case(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.sampled_from([1, 2, 4]))
    D = draw(st.sampled_from([64, 128, 24]))
    L = draw(st.integers(1, 70))
    K = draw(st.integers(1, 80))
    seed = draw(st.integers(0, 2**31 - 1))
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "float_per_head"]))
    return B, Hkv * G, Hkv, D, L, K, seed, mask_kind


def random_indices(B, Hkv, L, K, g):
    """[B,Hkv,K] distinct positions in a random order, padded with -1 when K > L or by chance."""
    out = torch.full((B, Hkv, K), -1, dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv):
            n = int(torch.randint(0, min(K, L) + 1, (1,), generator=g))
            pos = torch.randperm(L, generator=g)[:n].int()
            slots = torch.randperm(K, generator=g)[:n]
            out[b, h, slots] = pos
    return out


@given(attention_case())
def test_sparse_decode_attention_equals_fp64_masked_dense(case):
    B, Hq, Hkv, D, L, K, seed, mask_kind = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g)
    k = torch.randn(B, Hkv, L, D, generator=g)
    v = torch.randn(B, Hkv, L, D, generator=g)
    idx = random_indices(B, Hkv, L, K, g)
    keep = torch.zeros(B, Hkv, L, dtype=torch.bool)
    for b in range(B):
        for h in range(Hkv):
            sel = idx[b, h][idx[b, h] >= 0].long()
            keep[b, h, sel] = True
    keep = keep.repeat_interleave(Hq // Hkv, 1)
    mask, bias = None, None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, 1, L, generator=g) > 0.3
        keep = keep & mask[:, :, 0]
    elif mask_kind.startswith("float"):
        heads = Hq if mask_kind == "float_per_head" else 1
        mask = torch.randn(B, heads, 1, L, generator=g)
        mask = mask.masked_fill(torch.rand(B, heads, 1, L, generator=g) < 0.2, float("-inf"))
        bias = mask[:, :, 0].double().expand(B, Hq, L)
        keep = keep & torch.isfinite(bias)
    scale = 0.7 / math.sqrt(D)
    out = sparse_fx.ops.sparse_decode_attention(q, k, v, idx, scale, mask)
    expect = dense_masked_fp64(q, k, v, keep, scale, bias.nan_to_num(neginf=0.0) if bias is not None else None)
    assert out.shape == (B, Hq, 1, D) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)


def test_sparse_decode_attention_budget_covering_everything_is_sdpa():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 8, 1, 64, generator=g), torch.randn(2, 2, 50, 64, generator=g), torch.randn(2, 2, 50, 64, generator=g)
    idx = torch.stack([torch.randperm(50, generator=g) for _ in range(4)]).reshape(2, 2, 50).int()
    out = torch.ops.sparse_fx.sparse_decode_attention(q, k, v, idx, None, None)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(q=torch.randn(1, 3, 1, 16)), "multiple of KV heads"),
        (dict(q=torch.randn(1, 4, 2, 16)), "one decode query"),
        (dict(indices=torch.zeros(1, 2, 3)), "integer"),
        (dict(indices=torch.zeros(1, 3, 3, dtype=torch.int32)), r"\[B, Hkv, K\]"),
        (dict(mask=torch.zeros(1, 1, 10)), "mask must be"),
    ],
)
def test_sparse_decode_attention_rejects_bad_input(bad, match):
    args = dict(q=torch.randn(1, 4, 1, 16), k=torch.randn(1, 2, 10, 16), v=torch.randn(1, 2, 10, 16),
                indices=torch.zeros(1, 2, 3, dtype=torch.int32), scale=None, mask=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        sparse_fx.ops.sparse_decode_attention(**args)


# ----------------------------------------------------------------------------- signatures
def bits_of(words: torch.Tensor) -> torch.Tensor:
    """[..., W] int32 -> [..., 32W] bool, bit by bit in Python."""
    flat = words.reshape(-1, words.shape[-1]).tolist()
    out = [[(w >> j) & 1 == 1 for w in row for j in range(32)] for row in flat]
    return torch.tensor(out, dtype=torch.bool).reshape(*words.shape[:-1], words.shape[-1] * 32)


