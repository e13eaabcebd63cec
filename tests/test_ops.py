"""The sparse_fx ops (lowering/reference.py semantics): properties against independent oracles."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sparse_fx
from sparse_fx.lowering import reference as ref

OPS = torch.ops.sparse_fx


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
    out = OPS.sparse_decode_attention(q, k, v, idx, None, None)
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


@given(st.integers(1, 4), st.sampled_from([32, 64, 128]), st.integers(0, 2**31 - 1))
def test_pack_signs_round_trips_bit_by_bit(rows, bits, seed):
    x = torch.randn(rows, 3, bits, generator=torch.Generator().manual_seed(seed))
    x[0, 0, :5] = 0.0  # sign(0) -> bit 0
    words = OPS.pack_signs(x)
    assert words.dtype == torch.int32 and words.shape == (rows, 3, bits // 32)
    assert torch.equal(bits_of(words), x > 0)


@given(st.integers(1, 2), st.integers(1, 3), st.sampled_from([1, 2, 3]), st.integers(1, 40), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_hamming_scores_equal_bit_by_bit_reference(B, Hkv, G, L, W, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-(2**31), 2**31 - 1, (B, Hkv * G, W), generator=g, dtype=torch.int64).int()
    k = torch.randint(-(2**31), 2**31 - 1, (B, Hkv, L, W), generator=g, dtype=torch.int64).int()
    got = OPS.hamming_scores(q, k)
    assert got.dtype == ref.hamming_dtype(G, W)  # narrowest dtype holding 0..G*32*W
    got = got.to(torch.int32)
    qb, kb = bits_of(q), bits_of(k)
    expect = torch.zeros(B, Hkv, L, dtype=torch.int32)
    for b in range(B):
        for h in range(Hkv * G):
            same = (qb[b, h][None, :] == kb[b, h // G]).sum(-1)
            expect[b, h // G] += same.int()
    assert torch.equal(got, expect)


def test_signature_write_only_touches_new_positions_and_reset_clears_the_rest():
    cache = torch.randint(-100, 100, (1, 2, 12, 1), dtype=torch.int32)
    before = cache.clone()
    logits = torch.randn(1, 2, 3, 32)
    pos = torch.tensor([4, 5, 6])
    OPS.signature_write(cache, logits, pos, False)
    assert torch.equal(cache[:, :, 4:7], OPS.pack_signs(logits))
    assert torch.equal(cache[:, :, :4], before[:, :, :4]) and torch.equal(cache[:, :, 7:], before[:, :, 7:])
    OPS.signature_write(cache, logits, pos, True)  # not a new sequence: pos[0] != 0
    assert torch.equal(cache[:, :, 7:], before[:, :, 7:])
    OPS.signature_write(cache, logits, torch.tensor([0, 1, 2]), True)
    assert torch.equal(cache[:, :, :3], OPS.pack_signs(logits)) and not cache[:, :, 3:].any()


# ------------------------------------------------------------------------------------ INT2
@given(st.sampled_from([(16, 16), (64, 32), (128, 32), (64, 8)]), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 2**31 - 1))
def test_int2_round_trip_error_is_at_most_half_a_step(dims, dtype, seed):
    D, group = dims
    k = (torch.randn(2, 3, 7, D, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    k[0, 0, 0, :group] = 1.5  # a constant group: zero step, exact
    codes, scale, zero = ref.int2_quantize(k, group)
    back = ref.int2_dequantize(codes, scale, zero)
    assert ref.int2_unpack(codes).max() <= 3 and ref.int2_unpack(codes).min() >= 0
    err = (back - k.float()).abs().reshape(2, 3, 7, D // group, group)
    half_step = scale.float()[..., None] / 2
    assert (err <= half_step * (1 + 1e-3) + 1e-6 * k.float().abs().amax()).all()
    assert err[0, 0, 0, 0].max() <= 1e-3


def test_int2_scores_are_max_over_group_of_dequantised_dot():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 6, 1, 32, generator=g), torch.randn(2, 2, 20, 32, generator=g)
    codes, scale, zero = ref.int2_quantize(k, 16)
    kd = ref.int2_dequantize(codes, scale, zero)
    expect = torch.stack([(q[:, h, 0, None, :] * kd[:, h // 3]).sum(-1) for h in range(6)], 1)
    expect = expect.reshape(2, 2, 3, 20).amax(2)
    torch.testing.assert_close(OPS.int2_scores(q, codes, scale, zero), expect)


# -------------------------------------------------------------------------------- selection
@st.composite
def selection_case(draw):
    B, Hkv, L = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 120))
    now = draw(st.integers(0, L - 1))
    k, sink, local = draw(st.integers(1, 40)), draw(st.integers(0, 8)), draw(st.integers(1, 10))
    return B, Hkv, L, now, k, sink, local, draw(st.booleans()), draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@given(selection_case())
def test_selection_holds_window_and_top_scores_never_masked_or_future(case):
    B, Hkv, L, now, k, sink, local, int_scores, use_pool, seed = case
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 5, (B, Hkv, L), generator=g).int() if int_scores else torch.randn(B, Hkv, L, generator=g)
    mask = torch.rand(B, 1, 1, L, generator=g) > 0.25  # padding / masked slots
    positions = None
    cand_scores = scores
    if use_pool:  # a Prism pool: candidates are arbitrary positions, some empty
        positions = torch.stack([torch.randperm(L, generator=g) for _ in range(B * Hkv)]).reshape(B, Hkv, L)[..., : max(1, L // 2)]
        positions = positions.masked_fill(torch.rand(positions.shape, generator=g) < 0.2, -1)
        cand_scores = torch.gather(scores, 2, positions.clamp(min=0))
    idx = OPS.select_topk(cand_scores, torch.tensor([now]), k, sink, local, mask, positions)
    assert idx.shape == (B, Hkv, sink + local + k) and idx.dtype == torch.int32
    for b in range(B):
        for h in range(Hkv):
            ok = mask[b, 0, 0]
            row = idx[b, h].tolist()
            chosen = [p for p in row if p >= 0]
            assert len(chosen) == len(set(chosen)), "a position is selected twice"
            assert all(p <= now and ok[p] for p in chosen), "masked or future position selected"
            window = {p for p in range(sink) if p <= now and ok[p]} | {
                p for p in range(now - local + 1, now + 1) if p >= 0 and ok[p]
            }
            assert window == set(row[: sink + local]) - {-1}
            cands = range(L) if positions is None else [p for p in positions[b, h].tolist() if p >= 0]
            eligible = {p for p in cands if ok[p] and p <= now and p not in window and p >= sink and p <= now - local}
            top = [p for p in row[sink + local :] if p >= 0]
            assert set(top) <= eligible and len(top) == min(k, len(eligible))
            if top and len(top) < len(eligible):
                worst_in = min(float(scores[b, h, p]) for p in top)
                best_out = max(float(scores[b, h, p]) for p in eligible - set(top))
                assert worst_in >= best_out


# ------------------------------------------------------------------------------ mass scores
def test_mass_scores_sum_per_head_softmax_over_readable_candidates():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    mask = torch.ones(1, 1, 1, 30, dtype=torch.bool)
    mask[..., 25:] = False
    full = OPS.mass_scores(q, k, 0.25, mask, None)
    p = torch.softmax(((q @ k.repeat_interleave(2, 1).transpose(-1, -2))[:, :, 0] * 0.25).masked_fill(~mask[0, 0], -1e30), -1)
    torch.testing.assert_close(full, p.reshape(1, 2, 2, 30).sum(2))
    assert full[..., 25:].abs().max() == 0
    pool = torch.tensor([[[3, 7, -1, 26, 0], [1, 2, 3, 4, 5]]])
    sub = OPS.mass_scores(q, k, 0.25, mask, pool)
    assert sub[0, 0, 2] == 0 and sub[0, 0, 3] == 0  # empty slot, masked position
    torch.testing.assert_close(sub.sum(-1), torch.tensor([[2.0, 2.0]]))


# --------------------------------------------------------------------------------- opcheck
def _opcheck_cases():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 32, generator=g), torch.randn(1, 2, 20, 32, generator=g), torch.randn(1, 2, 20, 32, generator=g)
    mask = torch.rand(1, 1, 1, 20, generator=g) > 0.2
    idx = torch.tensor([[[0, 5, -1, 7], [1, 2, 3, 19]]], dtype=torch.int32)
    codes, scale, zero = ref.int2_quantize(k, 16)
    sig = OPS.pack_signs(torch.randn(1, 2, 20, 32, generator=g))
    pos = torch.tensor([19])
    return [
        (OPS.sparse_decode_attention.default, (q, k, v, idx, 0.3, mask)),
        (OPS.pack_signs.default, (torch.randn(3, 64, generator=g),)),
        (OPS.hamming_scores.default, (OPS.pack_signs(torch.randn(1, 4, 32, generator=g)), sig)),
        (OPS.signature_write.default, (sig.clone(), torch.randn(1, 2, 1, 32, generator=g), pos, False)),
        (OPS.int2_write.default, (codes.clone(), scale.clone(), zero.clone(), torch.randn(1, 2, 1, 32, generator=g), pos, False)),
        (OPS.int2_scores.default, (q, codes, scale, zero)),
        (OPS.mass_scores.default, (q, k, 0.3, mask, idx.long())),
        (OPS.select_topk.default, (torch.randn(1, 2, 20, generator=g), pos, 4, 2, 3, mask, None)),
    ]


@pytest.mark.parametrize("op, args", _opcheck_cases(), ids=lambda x: getattr(x, "__name__", "")[:40])
def test_opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
