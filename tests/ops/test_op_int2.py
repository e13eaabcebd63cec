"""int2_write (bit-exact INT2 quantisation) and int2_scores (the Prism proposal scan, and a refined
layer's scan of its pool)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import DEV, FAST, MORE, gen, poisoned, randn

from sparse_fx.lowering import kernels as K
from sparse_fx.lowering import reference as ref


def _keys(B, H, T, D, group, dtype, g):
    k = torch.randn(B, H, T, D, generator=g) * 3
    kg = k.view(B, H, T, D // group, group)
    kg[:, :, 0] = 1.25  # constant group: scale 0, codes 0
    if T > 1 and group >= 4:  # exact half steps: round half to even
        kg[:, :, 1, :, :4] = torch.tensor([0.0, 1.5, 2.5, 3.0])
        kg[:, :, 1, :, 4:] = 1.0
    return k.to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D,group", [(16, 16), (64, 32), (64, 16), (64, 64), (64, 4)])
def test_int2_write_bit_exact(dtype, D, group):
    g = gen(D + group)
    B, H, T, L = 2, 2, 5, 24
    k = _keys(B, H, T, D, group, dtype, g)
    pos = torch.arange(7, 7 + T, device=DEV)
    codes = torch.randint(-(2**31), 2**31 - 1, (B, H, L, D // 16), generator=g, dtype=torch.int32).to(DEV)
    params = torch.randn(B, H, L, 2 * (D // group), generator=g).half().to(DEV)
    want = [t.cpu().clone() for t in (codes, params)]
    ref.int2_write(*want, k.cpu(), pos.cpu())
    with poisoned():
        K.int2_write(codes, params, k, pos)
    for got, w in zip((codes, params), want):
        assert torch.equal(got.cpu(), w)


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
            torch.zeros(1, 2, L, 2 * (D // group), dtype=torch.float16, device=DEV)]
    want = [t.cpu().clone() for t in bufs]
    ref.int2_write(*want, k.cpu(), pos.cpu())
    K.int2_write(*bufs, k, pos)
    for got, w in zip(bufs, want):
        assert torch.equal(got.cpu(), w)


def test_int2_round_trip_error_is_at_most_half_a_step():
    g = gen(4)
    k = torch.randn(2, 3, 50, 64, generator=g, dtype=torch.float64) * 5
    codes, params = ref.int2_quantize(k, 16)
    back = ref.int2_dequantize(codes, params).double()
    step = ref.int2_split(params)[0].double().repeat_interleave(16, -1)
    assert ((back - k).abs() <= 0.5 * step + 1e-3 * step + 1e-6).all()


@pytest.mark.parametrize("variant", [0, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G,D,group", [(1, 16, 16), (3, 64, 32), (4, 128, 32), (4, 64, 64)])
def test_int2_scores_matches_reference(variant, dtype, G, D, group):
    g = gen(G * D + group + variant)
    B, Hkv, L = 2, 2, 150
    k = randn(B, Hkv, L, D, g=g) * 2
    codes, params = (t.to(DEV) for t in ref.int2_quantize(k.cpu(), group))
    q = randn(B, Hkv * G, 1, D, g=g, dtype=dtype)
    pos = torch.tensor([100], device=DEV)
    with poisoned():
        got = K.int2_scores(q, codes, params, pos, variant=variant).cpu()
    want = ref.int2_scores(q.cpu(), codes.cpu(), params.cpu(), pos.cpu())
    assert got.dtype == torch.float32 and got.shape == (B, Hkv, L)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got[..., 101:]).all()
    fin = torch.isfinite(want)
    # the 16-bit variants carry a constant 2^k per code that cancels in fp32: ~2^k * 2^-24 relative
    tol = (3e-4 if variant and dtype == torch.float16 else 5e-5) * want[fin].abs().max().item() * math.sqrt(D / 16)
    torch.testing.assert_close(got[fin], want[fin], atol=tol, rtol=1e-5)


def test_int2_scan_variant_follows_the_cache_size(monkeypatch):
    """Unset, the 16-bit scan builds operands in place (3) from INT2_IN_PLACE_MIN_KEYS cache slots
    (B * Hkv * L) and joins halves (2) below; the two round differently, so the default's output
    equals exactly one of them on each side of the threshold."""
    from sparse_fx.lowering.kernels import int2

    g = gen(31)
    B, Hkv, G, L, D = 1, 2, 4, 96, 64
    codes, params = (t.to(DEV) for t in ref.int2_quantize(randn(B, Hkv, L, D, g=g).cpu() * 3, 32))
    q = randn(B, Hkv * G, 1, D, g=g, dtype=torch.float16)
    v2, v3 = (K.int2_scores(q, codes, params, None, variant=v) for v in (2, 3))
    assert not torch.equal(v2, v3)  # else this test could not tell them apart
    for threshold, want in ((B * Hkv * L, v3), (B * Hkv * L + 1, v2)):
        monkeypatch.setattr(int2, "INT2_IN_PLACE_MIN_KEYS", threshold)
        assert torch.equal(K.int2_scores(q, codes, params, None), want), threshold


@pytest.mark.parametrize("pos", [None, 0, 37])
def test_int2_scores_on_strided_buffers(pos):
    """Codes inside wider rows and params column-major (a cache with room to spare): the kernel's packed
    fast path must not assume contiguous rows; unwritten slots score -inf."""
    g = gen(11)
    B, Hkv, G, L, D, group = 2, 3, 4, 70, 64, 16
    k = randn(B, Hkv, L, D, g=g)
    codes, params = ref.int2_quantize(k.cpu(), group)
    wide = lambda t: torch.cat([t, torch.zeros_like(t[..., :1])], -1).to(DEV)[..., :-1]  # noqa: E731
    codes, params = wide(codes), params.to(DEV).transpose(-1, -2).contiguous().transpose(-1, -2)
    assert codes.stride(-2) != codes.shape[-1] and params.stride(-1) != 1
    q = randn(B, Hkv * G, 1, D, g=g, dtype=torch.bfloat16)
    p = None if pos is None else torch.tensor([pos], device=DEV)
    with poisoned():
        got = K.int2_scores(q, codes, params, p).cpu()
    want = ref.int2_scores(q.cpu(), codes.cpu(), params.cpu(), None if p is None else p.cpu())
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=5e-5 * want[fin].abs().max().item() * 2, rtol=1e-5)


def _pool(B, Hkv, N, L, filled, g, empty=0.2):
    """A pool as a proposal hands it on: distinct written slots, ascending, -1 entries at the end,
    inside a wider [B, Hkv, window + N] selection (a strided view)."""
    rows = []
    for _ in range(B * Hkv):
        n = int(N * (1 - empty * torch.rand(1, generator=g)))
        slots = torch.randperm(filled, generator=g)[:n].sort().values
        rows.append(torch.cat([slots, torch.full((N - len(slots),), -1)]))
    full = torch.cat([torch.zeros(B, Hkv, 3, dtype=torch.int32), torch.stack(rows).view(B, Hkv, N).int()], -1)
    return full.to(DEV)[..., 3:]


@MORE
@given(G=st.sampled_from([1, 3, 4]), D=st.sampled_from([16, 64, 128]), N=st.integers(1, 300),
       variant=st.sampled_from([0, 2, 3]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       ahead=st.booleans(), seed=st.integers(0, 2**16))
def test_int2_pool_scores_match_reference(G, D, N, variant, dtype, ahead, seed):
    """A refined layer's scan of its pool: the score of entry n's slot at n, -inf for empty entries,
    on a strided pool; its codes loaded a tile ahead or not."""
    g = gen(seed)
    B, Hkv, L = 2, 2, 400
    filled = max(N, int(torch.randint(1, L + 1, (1,), generator=g)))
    codes, params = (t.to(DEV) for t in ref.int2_quantize(randn(B, Hkv, L, D, g=g).cpu() * 2, 16))
    q = randn(B, Hkv * G, 1, D, g=g, dtype=dtype)
    pos = torch.tensor([filled - 1], device=DEV)
    pool = _pool(B, Hkv, N, L, filled, g)
    assert not pool.is_contiguous()
    with poisoned():
        got = K.int2_scores(q, codes, params, pos, pool, variant=variant, ahead=ahead).cpu()
    want = ref.int2_scores(q.cpu(), codes.cpu(), params.cpu(), pos.cpu(), pool.cpu())
    assert got.shape == (B, Hkv, N) and torch.equal(torch.isinf(got), pool.cpu() < 0)
    fin = torch.isfinite(want)
    if fin.any():
        tol = (3e-4 if variant and dtype == torch.float16 else 5e-5) * want[fin].abs().max().item() * math.sqrt(D / 16)
        torch.testing.assert_close(got[fin], want[fin], atol=tol, rtol=1e-5)


@pytest.mark.parametrize("variant", [0, 2, 3])
def test_codes_loaded_ahead_score_bit_for_bit_alike(variant):
    """Loading a tile's codes a step ahead changes when bytes move, not the arithmetic: over the
    cache and over a pool, with many tiles a program and a ragged last tile, the scores are equal."""
    g = gen(20 + variant)
    B, Hkv, G, L, D, N = 1, 2, 4, 333, 64, 150
    codes, params = (t.to(DEV) for t in ref.int2_quantize(randn(B, Hkv, L, D, g=g).cpu(), 32))
    q = randn(B, Hkv * G, 1, D, g=g, dtype=torch.bfloat16 if variant else torch.float32)
    pos = torch.tensor([300], device=DEV)
    pool = _pool(B, Hkv, N, L, 301, g)
    for positions in (None, pool):
        a, b = (K.int2_scores(q, codes, params, pos, positions, block_l=16, waves=1, variant=variant, ahead=ahead)
                for ahead in (False, True))
        assert torch.isfinite(a).any() and torch.equal(a, b)


def test_int2_pool_scores_of_unwritten_slots_are_minus_inf():
    """Pool entries past the query's position (never handed on by a proposal, but possible in a
    user's call) score -inf, as the full scan scores those slots, and their codes are not read."""
    g = gen(8)
    B, Hkv, G, L, D = 1, 2, 2, 64, 32
    codes, params = (t.to(DEV) for t in ref.int2_quantize(randn(B, Hkv, L, D, g=g).cpu(), 16))
    codes[:, :, 40:] = 0x55555555  # garbage past the written slots
    q = randn(B, Hkv * G, 1, D, g=g)
    pool = torch.tensor([[[3, 39, 40, 63, -1]] * Hkv], dtype=torch.int32, device=DEV)
    got = K.int2_scores(q, codes, params, torch.tensor([39], device=DEV), pool).cpu()
    assert torch.isfinite(got[..., :2]).all() and torch.isinf(got[..., 2:]).all()


@pytest.mark.parametrize("variant", [2, 3])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int2_scores_real_shapes(variant):
    g = gen(5)
    B, Hkv, G, L, D = 2, 8, 4, 65536, 128
    k = randn(B, Hkv, L, D, g=g, dtype=torch.bfloat16)
    codes, params = ref.int2_quantize(k, 32)
    q = randn(B, Hkv * G, 1, D, g=g, dtype=torch.bfloat16)
    got = K.int2_scores(q, codes, params, None, variant=variant)
    want = ref.int2_scores(q, codes, params)
    assert (got - want).norm() / want.norm() < 1e-4


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int2_pool_scores_real_shapes(ahead):
    """A refined layer at 128K: a pool of 16384 of 131072 slots a row, batch 2."""
    g = gen(6)
    B, Hkv, G, L, D, N = 2, 8, 4, 131072, 128, 16384
    k = randn(B, Hkv, L, D, g=g, dtype=torch.bfloat16)
    codes, params = ref.int2_quantize(k, 32)
    q = randn(B, Hkv * G, 1, D, g=g, dtype=torch.bfloat16)
    pool = torch.rand(B, Hkv, L, device=DEV).topk(N, -1).indices.sort(-1).values.int()
    pool[0, 0, -100:] = -1
    pos = torch.tensor([L - 1], device=DEV)
    got = K.int2_scores(q, codes, params, pos, pool, ahead=ahead)
    want = ref.int2_scores(q, codes, params, pos, pool)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and (got[fin] - want[fin]).norm() / want[fin].norm() < 1e-4
