"""few_query_attention (a verify step's dense attention) against an independent fp64 SDPA."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import DEV, FAST, gen, poisoned, randn

import sparse_fx
from sparse_fx.lowering import kernels as K

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=1e-3)}
MASKS = ["none", "bool", "bool-head", "inf", "min", "inf-head"]


def oracle(q, k, v, scale, mask):
    """fp64 SDPA over the KV heads repeated per query head; a query with nothing readable: zeros."""
    q, k, v = q.cpu().double(), k.cpu().double(), v.cpu().double()
    G = q.shape[1] // k.shape[1]
    keep = None
    if mask is not None:
        m = mask.cpu()
        keep = m if m.dtype == torch.bool else m.double()
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1),
                                                           attn_mask=keep, scale=scale)
    return out.nan_to_num(0.0)


def verify_mask(kind: str, B: int, Hq: int, T: int, L: int, g, dtype=torch.float32):
    """A verify step's masks: query t reads the slots up to now + t, some of them padding or holes
    (hidden), in every form SDPA takes: bool or additive (-inf, finfo.min), shared or per head."""
    if kind == "none":
        return None
    heads = Hq if kind.endswith("head") else 1
    now = L - T - int(torch.randint(0, max(1, L // 4), (1,), generator=g))
    keep = torch.rand(B, heads, 1, L, generator=g) > 0.25
    keep = keep & (torch.arange(L) <= now + torch.arange(T)[:, None])  # [B, heads, T, L]
    keep[..., torch.arange(T), now + torch.arange(T)] = True  # each query reads itself
    if kind.startswith("bool"):
        return keep.to(DEV)
    fill = float("-inf") if kind.startswith("inf") else torch.finfo(dtype).min
    m = torch.zeros(keep.shape).masked_fill(~keep, fill) + 0.1 * torch.randn(keep.shape, generator=g) * keep
    return m.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G, T", [(1, 2), (4, 5), (8, 9), (3, 3)])
@pytest.mark.parametrize("L", [50, 700])  # one split / several splits and the combine kernel
def test_few_query_attention_matches_fp64_sdpa(dtype, G, T, L):
    g = gen(G * 100 + T * 10 + L)
    B, Hkv, D = 2, 2, 64
    q, k, v = randn(B, Hkv * G, T, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype)
    mask = verify_mask("bool", B, Hkv * G, T, L, g)
    with poisoned():
        out = K.few_query_attention(q, k, v, None, mask)
    assert out.dtype == dtype and out.shape == (B, Hkv * G, T, D)
    torch.testing.assert_close(out.cpu().double(), oracle(q, k, v, None, mask), **TOL[dtype])


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_query_attention_masks(mask_kind, dtype):
    g = gen(len(mask_kind) * 7)
    B, Hkv, G, T, L, D = 2, 2, 4, 5, 300, 32
    q, k, v = randn(B, Hkv * G, T, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype)
    mask = verify_mask(mask_kind, B, Hkv * G, T, L, g, torch.float32 if dtype == torch.float32 else dtype)
    with poisoned():
        out = K.few_query_attention(q, k, v, 0.3, mask, waves=8)
    torch.testing.assert_close(out.cpu().double(), oracle(q, k, v, 0.3, mask), **TOL[dtype])


@pytest.mark.parametrize("knobs", [dict(block_n=16, stages=2, waves=64, max_splits=256), dict(block_n=128, waves=1)])
def test_few_query_attention_launch_knobs_do_not_change_the_result(knobs):
    """Many splits (more than the combine merges a step), or one program a KV head."""
    g = gen(31)
    B, Hkv, G, T, L, D = 1, 2, 3, 4, 1300, 32
    q, k, v = randn(B, Hkv * G, T, D, g=g), randn(B, Hkv, L, D, g=g), randn(B, Hkv, L, D, g=g)
    mask = verify_mask("min", B, Hkv * G, T, L, g)
    with poisoned():
        out = K.few_query_attention(q, k, v, None, mask, **knobs)
    torch.testing.assert_close(out.cpu().double(), oracle(q, k, v, None, mask), **TOL[torch.float32])


@pytest.mark.parametrize("L, mask_kind", [(704, "bool"), (704, "inf-head"), (700, "bool")])
def test_few_query_attention_aligned_lengths_and_empty_splits(L, mask_kind, monkeypatch):
    """A cache length and mask strides in multiples of 16 are read in units of 16 (ALIGN: what keeps
    the mask's loads vectorised at a symbolic length), others as they are; and a symbolic length
    launches a fixed split count (common.split_keys), so trailing splits may be empty: here two more."""
    launcher = sys.modules[K.few_query_attention.__module__]
    split_keys = launcher.split_keys
    monkeypatch.setattr(launcher, "split_keys", lambda *a: (split_keys(*a)[0] + 2, split_keys(*a)[1]))
    g = gen(L + len(mask_kind))
    B, Hkv, G, T, D = 2, 2, 4, 5, 32
    q, k, v = randn(B, Hkv * G, T, D, g=g), randn(B, Hkv, L, D, g=g), randn(B, Hkv, L, D, g=g)
    mask = verify_mask(mask_kind, B, Hkv * G, T, L, g)
    with poisoned():
        out = K.few_query_attention(q, k, v, None, mask, waves=8)
    torch.testing.assert_close(out.cpu().double(), oracle(q, k, v, None, mask), **TOL[torch.float32])


def test_few_query_attention_strided_inputs_and_empty_rows():
    """Views of bigger buffers (HF's q is a transpose) read through their strides; a query with
    nothing readable gets zeros."""
    g = gen(32)
    q = randn(1, 3, 8, 64, g=g).transpose(1, 2)[:, :, :2]  # [1, 8, 2, 64] viewed, not copied
    kv = randn(1, 2, 2, 90, 64, g=g)
    k, v = kv[:, 0], kv[:, 1]
    mask = verify_mask("bool", 1, 8, 2, 90, g)
    mask[0, 0, 1] = False
    out = K.few_query_attention(q, k, v, None, mask)
    torch.testing.assert_close(out.cpu().double(), oracle(q, k, v, None, mask), **TOL[torch.float32])
    assert torch.equal(out[0, :, 1].cpu(), torch.zeros(8, 64))


@FAST
@given(B=st.integers(1, 2), Hkv=st.integers(1, 3), G=st.sampled_from([1, 2, 4]), T=st.integers(1, 8),
       L=st.integers(9, 200), D=st.sampled_from([16, 24, 64]), mask_kind=st.sampled_from(MASKS), seed=st.integers(0, 2**16))
def test_few_query_attention_op_is_dense_attention(B, Hkv, G, T, L, D, mask_kind, seed):
    """Through torch.ops (the kernel where it runs, else the reference; any head dim)."""
    g = gen(seed)
    q, k, v = randn(B, Hkv * G, T, D, g=g), randn(B, Hkv, L, D, g=g), randn(B, Hkv, L, D, g=g)
    mask = verify_mask(mask_kind, B, Hkv * G, T, L, g)
    out = torch.ops.sparse_fx.few_query_attention(q, k, v, 0.5, mask)
    torch.testing.assert_close(out.cpu().double(), oracle(q, k, v, 0.5, mask), **TOL[torch.float32])


def test_few_query_attention_supported_only_where_the_kernel_runs():
    q, k = torch.zeros(1, 8, 5, 64, device=DEV), torch.zeros(1, 2, 40, 64, device=DEV)
    assert K.few_query_attention_supported(q, k, k, None, torch.ones(1, 1, 5, 40, dtype=torch.bool, device=DEV))
    assert not K.few_query_attention_supported(q[..., :48], k[..., :48], k[..., :48])  # head dim not a power of two
    assert not K.few_query_attention_supported(q.double(), k.double(), k.double())
    # the query tile: 4 x T rows padded to a power of two, times the head dim, at most 16384 (8192 in fp32)
    assert K.few_query_attention_supported(torch.zeros(1, 8, 64, 64, device=DEV).half(), k.half(), k.half())
    assert not K.few_query_attention_supported(torch.zeros(1, 8, 65, 64, device=DEV).half(), k.half(), k.half())
    assert K.few_query_attention_supported(torch.zeros(1, 8, 32, 64, device=DEV), k, k)
    assert not K.few_query_attention_supported(torch.zeros(1, 8, 33, 64, device=DEV), k, k)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(q=torch.randn(1, 3, 2, 16)), "multiple of KV heads"),
        (dict(q=torch.randn(4, 2, 16)), r"\[B, Hq, T, D\]"),
        (dict(v=torch.randn(1, 2, 9, 16)), "must match k"),
        (dict(mask=torch.ones(1, 1, 1, 10, dtype=torch.bool)), r"mask must be \[B\|1, 1\|Hq, T, L\] = \[1\|1, 1\|4, 2, 10\]"),
    ],
)
def test_few_query_attention_rejects_bad_input(bad, match):
    args = dict(q=torch.randn(1, 4, 2, 16), k=torch.randn(1, 2, 10, 16), v=torch.randn(1, 2, 10, 16), scale=None, mask=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        sparse_fx.ops.few_query_attention(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_few_query_attention_real_shapes(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = gen(33)
    B, Hkv, G, T, L, D = 2, 8, 4, 5, 32768 + 198, 128
    q, k, v = randn(B, Hkv * G, T, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype), randn(B, Hkv, L, D, g=g, dtype=dtype)
    mask = verify_mask("bool", B, 1, T, L, g)
    out = K.few_query_attention(q, k, v, None, mask)
    torch.testing.assert_close(out.double(), oracle(q, k, v, None, mask).to(DEV), **TOL[dtype])
