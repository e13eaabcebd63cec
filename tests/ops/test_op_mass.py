"""mass_scores: attention mass per candidate (the oracle over all slots, Prism refined layers over a pool)."""

from __future__ import annotations

import pytest
import torch
from support import DEV, MASK_KINDS, SENTINEL, gen, make_mask, poisoned, randn

from sparse_fx.lowering import kernels as K
from sparse_fx.lowering import ops  # noqa: F401  (registers torch.ops.sparse_fx)
from sparse_fx.lowering import reference as ref


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


@pytest.mark.parametrize("mask_kind", ["bool", "bool-head"])
def test_mass_scores_equal_a_float64_softmax(mask_kind):
    """Independently of the reference: per query head softmax over the keys that head may read,
    summed per KV head (a per-head bool mask hides a slot from some heads of a group only)."""
    g = gen(11)
    B, Hkv, G, L, D = 1, 2, 3, 90, 16
    q, k = randn(B, Hkv * G, 1, D, g=g), randn(B, Hkv, L, D, g=g)
    mask = make_mask(mask_kind, B, Hkv * G, L, g)
    got = K.mass_scores(q, k, None, mask).cpu().double()
    logits = (q.cpu().double() @ k.cpu().double().repeat_interleave(G, 1).transpose(-1, -2))[:, :, 0] * D**-0.5
    logits = logits.masked_fill(~mask.cpu()[:, :, 0], float("-inf"))
    want = torch.softmax(logits, -1).reshape(B, Hkv, G, L).sum(2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mass_scores_sum_per_head_softmax_over_readable_candidates():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    mask = torch.ones(1, 1, 1, 30, dtype=torch.bool)
    mask[..., 25:] = False
    full = torch.ops.sparse_fx.mass_scores(q, k, 0.25, mask, None)
    p = torch.softmax(((q @ k.repeat_interleave(2, 1).transpose(-1, -2))[:, :, 0] * 0.25).masked_fill(~mask[0, 0], -1e30), -1)
    torch.testing.assert_close(full, p.reshape(1, 2, 2, 30).sum(2))
    assert full[..., 25:].abs().max() == 0
    pool = torch.tensor([[[3, 7, -1, 26, 0], [1, 2, 3, 4, 5]]])
    sub = torch.ops.sparse_fx.mass_scores(q, k, 0.25, mask, pool)
    assert sub[0, 0, 2] == 0 and sub[0, 0, 3] == 0  # empty slot, masked position
    torch.testing.assert_close(sub.sum(-1), torch.tensor([[2.0, 2.0]]))


# ------------------------------------------------------------------------------ mass_select
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("budget", [20, 200])  # ties at the edge of a budget; a budget over the whole pool
def test_mass_select_ranks_the_mass_it_never_writes(mask_kind, budget):
    """A refined layer's fused selection equals select_topk over mass_scores' output, kernels and
    reference alike: its key pass computes each candidate's mass exactly as mass_scores would."""
    g = gen(60 + len(mask_kind) + budget)
    B, Hkv, G, L, D = 2, 2, 4, 300, 32
    q = randn(B, Hkv * G, 1, D, g=g) * 2
    k = randn(B, Hkv, L, D, g=g)
    mask = make_mask(mask_kind, B, Hkv * G, L, g, now=280)
    positions = torch.stack([torch.stack([torch.randperm(280, generator=g)[:150] for _ in range(Hkv)]) for _ in range(B)])
    positions[:, :, ::7] = -1
    positions = positions.to(DEV)
    pos, start = torch.tensor([279, 280], device=DEV), torch.tensor([0, 3], dtype=torch.int32, device=DEV)
    with poisoned():
        got = K.mass_select(q, k, 0.3, mask, positions, pos, budget, 4, 8, start, block=64, waves=64).cpu()
    assert (got != SENTINEL).all(), "an output slot was never written"
    mass = K.mass_scores(q, k, 0.3, mask, positions)
    assert torch.equal(got, K.select_topk(mass, pos, budget, 4, 8, mask, positions, start).cpu())
    cpu = [None if t is None else t.cpu() for t in (q, k, mask, positions, pos, start)]
    want = ref.mass_select(cpu[0], cpu[1], 0.3, cpu[2], cpu[3], cpu[4], budget, 4, 8, cpu[5])
    assert torch.equal(want, ref.select_topk(ref.mass_scores(cpu[0], cpu[1], 0.3, cpu[2], cpu[3]), cpu[4], budget, 4, 8,
                                             cpu[2], cpu[3], cpu[5]))
    # the reference's mass differs from the kernels' by float rounding: the same choice but at knife edges
    assert (got != want).float().mean() < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_mass_select_real_shapes():
    """A refined layer at 128K: a pool of 16384, budget 4096, bf16 (Llama-3.1-8B's heads)."""
    g = gen(61)
    B, Hkv, G, L, D, P = 2, 8, 4, 131072, 128, 16384
    q = randn(B, Hkv * G, 1, D, g=g, dtype=torch.bfloat16)
    k = randn(B, Hkv, L, D, g=g, dtype=torch.bfloat16)
    positions = torch.stack([torch.stack([torch.randperm(L - 200, generator=g)[:P] for _ in range(Hkv)]) for _ in range(B)])
    positions = positions.sort(-1).values.to(torch.int32).to(DEV)
    pos = torch.tensor([L - 5], device=DEV)
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device=DEV)
    got = K.mass_select(q, k, None, mask, positions, pos, 4096, 128, 128)
    want = K.select_topk(K.mass_scores(q, k, None, mask, positions), pos, 4096, 128, 128, mask, positions)
    # the same mass but for the order of a G-term sum: a key on a bf16 rounding edge may differ
    assert (got != want).float().mean().item() < 1e-3


def test_mass_select_of_an_empty_pool_keeps_the_window():
    """No candidates to score: the window and -1s, as select_topk gives for an empty pool."""
    q, k = randn(1, 4, 1, 16, g=gen(62)), randn(1, 2, 50, 16, g=gen(63))
    pos, positions = torch.tensor([40], device=DEV), torch.empty(1, 2, 0, dtype=torch.int64, device=DEV)
    got = K.mass_select(q, k, None, None, positions, pos, 8, 2, 3).cpu()
    assert torch.equal(got, ref.select_topk(torch.empty(1, 2, 0), pos.cpu(), 8, 2, 3, None, positions.cpu()))
    assert torch.equal(got, ref.mass_select(q.cpu(), k.cpu(), None, None, positions.cpu(), pos.cpu(), 8, 2, 3))
    assert got[0, 0, :5].tolist() == [0, 1, 38, 39, 40]
