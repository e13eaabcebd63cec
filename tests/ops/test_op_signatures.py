"""pack_signs, signature_write and hamming_scores: kernels against the reference, bit for bit."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from support import DEV, FAST, gen, poisoned, randn

from sparse_fx.lowering import kernels as K
from sparse_fx.lowering import reference as ref


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
    w = got.cpu().to(torch.int64) & 0xFFFFFFFF  # round trip: bit j of word w is x[32w + j] > 0
    unpacked = ((w[..., None] >> torch.arange(32)) & 1).reshape(*lead, 32 * words).bool()
    assert torch.equal(unpacked, x.cpu() > 0)


def test_signature_write_scatters_only_the_new_positions():
    g = gen(1)
    B, H, L, W, T = 2, 3, 40, 2, 6
    cache = torch.randint(-(2**31), 2**31 - 1, (B, H, L, W), generator=g, dtype=torch.int32).to(DEV)
    logits = randn(B, H, T, 32 * W, g=g)
    pos = torch.tensor([7, 3, 41 - 2, 20, 0, 12], device=DEV)  # any order, not contiguous
    expect = cache.cpu().clone()
    ref.signature_write(expect, logits.cpu(), pos.cpu())
    with poisoned():
        K.signature_write(cache, logits, pos)
    assert torch.equal(cache.cpu(), expect)
    untouched = torch.ones(L, dtype=torch.bool)
    untouched[pos.cpu()] = False
    assert torch.equal(expect[:, :, untouched], cache.cpu()[:, :, untouched])


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
    q[:] = q[:, :1].clone()  # all 40 heads equal: the first keys differ in every bit from every head
    k = torch.cat([~q[:, :1, None, :].expand(1, 1, 8, 1),
                   torch.randint(-(2**31), 2**31 - 1, (1, 1, 8, 1), generator=g, dtype=torch.int32)], 2)
    got = K.hamming_scores(q.to(DEV), k.to(DEV)).cpu()
    assert torch.equal(got, ref.hamming_scores(q, k))
