"""select_topk and hash_select: the kernels equal the reference exactly, and both equal the op's
contract written out independently here, candidate by candidate.

The contract: the window (sink from each row's first real position, then the local window) and
then the k best eligible candidates by key, listed in candidate order, -1 after. Where the k-th
key t has T eligible candidates and m of them fit, the tied candidate j (j = 0..T-1 in candidate
order) is taken when floor((j+1) m / T) > floor(j m / T): evenly spread over the ties. Keys: integers as they are, floats rounded toward zero to bfloat16 (the
top 16 bits of their order-preserving image).
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from support import DEV, FAST, MORE, SENTINEL, gen, make_mask, poisoned, select_contract

from sparse_fx.lowering import kernels as K
from sparse_fx.lowering import reference as ref


def _scores(kind, B, Hkv, N, g):
    if kind == "float":
        return torch.randn(B, Hkv, N, generator=g)
    if kind == "ties":  # a few distinct values: the tie rule decides most of the selection
        return (torch.randn(B, Hkv, N, generator=g) * 2).round() / 2
    if kind == "near-ties":  # a few ULPs apart: equal after rounding to bfloat16
        return 1.0 + torch.randint(0, 200, (B, Hkv, N), generator=g).float() * 2**-23
    if kind == "hamming":  # uint8 similarities
        return torch.randint(40, 90, (B, Hkv, N), generator=g, dtype=torch.int32).to(torch.uint8)
    if kind == "int16":  # Hamming sums of wide groups (ties) and the rest of the range but -32768 (see select.py)
        narrow = torch.randint(200, 320, (B, Hkv, N), generator=g, dtype=torch.int32)
        wide = torch.randint(-32767, 32768, (B, Hkv, N), generator=g, dtype=torch.int32)
        return torch.where(torch.rand(B, Hkv, N, generator=g) < 0.7, narrow, wide).to(torch.int16)
    if kind == "int8":
        return torch.randint(-128, 128, (B, Hkv, N), generator=g, dtype=torch.int32).to(torch.int8)
    if kind == "mass":  # nonnegative, exact zeros, -inf and NaN
        s = torch.rand(B, Hkv, N, generator=g) ** 4
        s[s < 0.01] = 0.0
        s[torch.rand(B, Hkv, N, generator=g) < 0.05] = float("-inf")
        s[torch.rand(B, Hkv, N, generator=g) < 0.02] = float("nan")
        return s
    raise ValueError(kind)


KINDS = ["float", "ties", "near-ties", "hamming", "int16", "int8", "mass"]


def check(scores, pos, k, sink, local, mask=None, positions=None, start=None, **knobs):
    with poisoned():
        out = K.select_topk(scores, pos, k, sink, local, mask, positions, start, **knobs).cpu()
    assert (out != SENTINEL).all(), "an output slot was never written"
    want = ref.select_topk(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in (scores, pos, k, sink, local, mask, positions, start)))
    assert torch.equal(out, want), f"kernel != reference at {(out != want).nonzero()[:5].tolist()}"
    assert torch.equal(want, select_contract(scores, pos, k, sink, local, mask, positions, start)), "reference != contract"
    return out


@given(levels=st.integers(1, 6), n=st.integers(1, 400), k=st.integers(1, 450), k_in=st.integers(1, 450),
       seed=st.integers(0, 2**16))
def test_ties_at_the_cut_spread_evenly_and_nest(levels, n, k, k_in, seed):
    """reference.choose, by its properties rather than its formula: it takes min(k, eligible), all
    keys above the cut and none below; the taken ties lie at tie-index gaps of floor or ceil of
    T / m, so neither end of the cache is preferred; and choosing within a choice is a subset."""
    g = gen(seed)
    keys = torch.randint(0, levels, (2, n), generator=g)
    eligible = torch.rand(2, n, generator=g) < 0.85
    taken = ref.choose(keys, eligible, k)
    for row, ok, got in zip(keys, eligible, taken):
        need = min(k, int(ok.sum()))
        assert int(got.sum()) == need and not (got & ~ok).any()
        if need == 0:
            continue
        t = int(row[ok].sort(descending=True).values[need - 1])
        assert got[ok & (row > t)].all() and not got[row < t].any()
        ties = (ok & (row == t)).nonzero().flatten()
        picked = got[ties].nonzero().flatten()
        T, m = len(ties), len(picked)
        if 1 < m < T:
            gaps = set(picked.diff().tolist())
            assert gaps <= {T // m, -(-T // m)}, (T, m, gaps)
    inner = ref.choose(keys, taken, min(k_in, k))
    assert not (inner & ~taken).any() and torch.equal(inner.sum(-1), taken.sum(-1).clamp(max=min(k_in, k)))
    shared = eligible[:1]  # one mask for both rows, broadcast (as calibration passes it)
    assert torch.equal(ref.choose(keys, shared, k), ref.choose(keys, shared.expand_as(keys), k))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask_kind", ["bool", "min", "bool-head"])
def test_select_topk_equals_the_contract(kind, mask_kind):
    g = gen(len(kind) * 7 + len(mask_kind))
    B, Hkv, N = 2, 2, 300
    scores = _scores(kind, B, Hkv, N, g).to(DEV)
    mask = make_mask(mask_kind, B, Hkv * 2, N, g, now=270)
    check(scores, torch.tensor([268, 269, 270], device=DEV), 50, 4, 16, mask)


@MORE
@given(kind=st.sampled_from(KINDS), mask_kind=st.sampled_from(["none", "bool", "min", "inf-head"]), pooled=st.booleans(),
       k=st.integers(1, 320), sink=st.integers(0, 20), local=st.integers(1, 40), now=st.integers(0, 299),
       padded=st.booleans(), seed=st.integers(0, 2**16))
def test_select_topk_property(kind, mask_kind, pooled, k, sink, local, now, padded, seed):
    g = gen(seed)
    B, Hkv, L = 2, 2, 300
    N = 120 if pooled else L
    scores = _scores(kind, B, Hkv, N, g).to(DEV)
    mask = make_mask(mask_kind, B, Hkv * 2, L, g, now=now)
    start = None
    if padded:  # left padding: row 1 starts later, its first slots unreadable
        start = torch.tensor([0, min(now, 17)], dtype=torch.int32, device=DEV)
        if mask is not None:
            mask[1, ..., : int(start[1])] = False if mask.dtype == torch.bool else float("-inf")
    positions = None
    if pooled:  # a pool: distinct positions, -1 for no candidate
        positions = torch.stack([torch.stack([torch.randperm(L, generator=g)[:N] for _ in range(Hkv)]) for _ in range(B)])
        positions[..., ::5] = -1
        positions = positions.to(DEV)
    check(scores, torch.tensor([now], device=DEV), k, sink, local, mask, positions, start)


def check_nested(scores, pos, k, k_inner, sink, local, mask=None, start=None, **knobs):
    """The nested kernel equals the reference, whose inner list is the best k_inner of the pool."""
    with poisoned():
        out, inner = (t.cpu() for t in K.select_topk(scores, pos, k, sink, local, mask, None, start, k_inner=k_inner, **knobs))
    assert (out != SENTINEL).all() and (inner != SENTINEL).all(), "an output slot was never written"
    cpu = [t.cpu() if isinstance(t, torch.Tensor) else t for t in (scores, pos, k, k_inner, sink, local, mask, start)]
    want, want_in = ref.select_nested(*cpu)
    assert torch.equal(out, want), f"outer: kernel != reference at {(out != want).nonzero()[:5].tolist()}"
    assert torch.equal(inner, want_in), f"inner: kernel != reference at {(inner != want_in).nonzero()[:5].tolist()}"
    assert torch.equal(want, select_contract(scores, pos, k, sink, local, mask, None, start)), "outer reference != contract"
    pool = want[..., sink + local:]
    at_pool = cpu[0].gather(2, pool.clamp(min=0).long())
    assert torch.equal(want_in, select_contract(at_pool, pos, k_inner, sink, local, mask, pool, start)), "inner reference != contract"


@FAST  # 7 s an example under the interpreter; the outer selection's own property runs MORE
@given(kind=st.sampled_from(KINDS), mask_kind=st.sampled_from(["none", "bool", "min", "inf-head"]), k=st.integers(1, 320),
       inner=st.integers(1, 320), sink=st.integers(0, 20), local=st.integers(1, 40), now=st.integers(0, 299),
       padded=st.booleans(), level_bits=st.sampled_from([4, 8]), row=st.booleans(), seed=st.integers(0, 2**16))
def test_select_nested_property(kind, mask_kind, k, inner, sink, local, now, padded, level_bits, row, seed):
    """A Prism proposal's pool and budget in one selection: the pool is select_topk's k, the budget
    the best k_inner within the pool (the same keys above the pool's cut; at it, the pool's ties),
    by one program a row over the pool's keys or by the passes counting both lists."""
    g = gen(seed)
    B, Hkv, L = 2, 2, 300
    scores = _scores(kind, B, Hkv, L, g).to(DEV)
    mask = make_mask(mask_kind, B, Hkv * 2, L, g, now=now)
    start = None
    if padded:
        start = torch.tensor([0, min(now, 17)], dtype=torch.int32, device=DEV)
        if mask is not None:
            mask[1, ..., : int(start[1])] = False if mask.dtype == torch.bool else float("-inf")
    # Blocks of 64 over the 300 slots and waves=3: 3 programs a row over 4 rows (P_PAD 4, one padded
    # count row), chunks of 2, 2 and 1 blocks at full length (a program carries its running counts
    # across blocks; the last block ragged), empty chunks when `now` leaves fewer blocks. (waves=64
    # gave 5 programs of one block each: 20 interpreted programs a launch instead of 12.)
    check_nested(scores, torch.tensor([now], device=DEV), k, min(inner, k), sink, local, mask, start,
                 level_bits=level_bits, block=64, waves=3, row=row)


# The hash selections' cache rows: two blocks of the default HASH_BLOCK (1024), the second ragged, so
# two programs a row of the default launch; the query at L - 100. (2500 slots, three programs a
# row, took half as long again; programs summing several earlier programs' counts are drawn in
# test_select_nested_property and run in test_launch_knobs_do_not_change_the_selection.)
HASH_L = 1300


@pytest.mark.parametrize("G,W", [(4, 1), (8, 1)])  # 8-bit and 16-bit Hamming keys
@pytest.mark.parametrize("row", [True, False])
def test_hash_select_nested_equals_its_reference(G, W, row):
    g = gen(40 + G)
    B, Hkv, L = 2, 2, HASH_L
    q_logits = torch.randn(B, Hkv * G, 32 * W, generator=g).to(DEV)
    k_sig = torch.randint(-(2**31), 2**31 - 1, (B, Hkv, L, W), generator=g, dtype=torch.int64).to(torch.int32).to(DEV)
    mask = make_mask("bool", B, Hkv * G, L, g, now=L - 100)
    start = torch.tensor([0, 9], dtype=torch.int32, device=DEV)
    pos = torch.tensor([L - 100], device=DEV)
    # ~900 readable candidates a row: the pool of 400 cuts through 70-150 tied keys; 3000 takes them all
    for k, k_inner in ((400, 100), (3000, 100)):  # a pool with ties at its edge; a pool of every candidate
        with poisoned():
            out, inner = (t.cpu() for t in K.hash_select(q_logits, k_sig, pos, k, 8, 8, mask, start, k_inner=k_inner, row=row))
        assert (out != SENTINEL).all() and (inner != SENTINEL).all(), "an output slot was never written"
        want, want_in = ref.hash_select_nested(q_logits.cpu(), k_sig.cpu(), pos.cpu(), k, k_inner, 8, 8, mask.cpu(), start.cpu())
        assert torch.equal(out, want) and torch.equal(inner, want_in)
        for chosen_in, chosen in zip(want_in[..., 16:].flatten(0, 1), want[..., 16:].flatten(0, 1)):  # nested
            assert (set(chosen_in.tolist()) - {-1} <= set(chosen.tolist())
                    and int((chosen_in >= 0).sum()) == min(k_inner, int((chosen >= 0).sum())))


def test_nested_selection_of_a_pool_and_with_a_mass():
    """A nested selection whose candidates are a pool (positions given) takes its inner list from
    the pool's own indices, on either path (found in review: one program a row read keys by cache
    position); a nested selection refuses mass < 1 instead of dropping its inner list."""
    g = gen(1)
    scores = torch.randn(1, 1, 32, generator=g).to(DEV)
    positions = (torch.arange(32) * 2).reshape(1, 1, 32).to(torch.int32).to(DEV)  # the pool: even positions
    pos = torch.tensor([63], device=DEV)
    rows = [K.select_topk(scores, pos, 16, 0, 1, None, positions, k_inner=4, row=r) for r in (True, False)]
    outer = ref.select_topk(scores.cpu(), pos.cpu(), 16, 0, 1, None, positions.cpu())
    at = {int(p): float(s) for p, s in zip(positions.flatten(), scores.flatten())}
    pool = outer[..., 1:]
    want_in = ref.select_topk(torch.tensor([[[at.get(int(p), 0.0) for p in pool.flatten()]]]), pos.cpu(), 4, 0, 1, None, pool)
    for out, inner in rows:
        assert torch.equal(out.cpu(), outer) and torch.equal(inner.cpu(), want_in)
    with pytest.raises(ValueError, match="mass"):
        K.select_topk(torch.rand(1, 1, 64, device=DEV), pos, 16, 0, 1, k_inner=4, mass=0.5)


def test_nested_selection_rejects_an_inner_budget_above_the_pool():
    from sparse_fx.lowering import ops

    with pytest.raises(ValueError, match="k_inner <= k"):
        ops.select_nested(torch.randn(1, 1, 50), torch.tensor([40]), 8, 16, 2, 2)


@pytest.mark.parametrize("knobs", [dict(level_bits=4), dict(block=1024, waves=64), dict(block=4096, waves=1, warps=8)])
def test_launch_knobs_do_not_change_the_selection(knobs):
    """Levels of the radix select and the chunking of a row over programs are invisible."""
    g = gen(30)
    scores = _scores("ties", 2, 3, 9000, g).to(DEV)
    mask = make_mask("bool", 2, 3, 9000, g, now=8800)
    check(scores, torch.tensor([8800], device=DEV), 700, 8, 8, mask, **knobs)


def test_wide_cache_row_launch_selects_what_the_reference_selects(monkeypatch):
    """The tuned layout of a float selection over few cache rows (one wide block a program, the
    row cap raised) is chosen by default where its thresholds say, and selects exactly the
    reference's pool and budget; scaled down here so that the interpreter reaches it."""
    from sparse_fx.lowering.kernels import select

    monkeypatch.setattr(select, "WIDE_BLOCK", 1024)
    monkeypatch.setattr(select, "WIDE_MIN_PROGRAMS", 12)
    monkeypatch.setattr(select, "WIDE_CAP_ROWS", 2)
    assert select.cache_row_launch(2, 6000, None, None) == (1024, select.WIDE_CAP)  # 2 rows x 6 blocks
    assert select.cache_row_launch(2, 5000, None, None) == (select.BLOCK, None)  # 2 x 5: too few
    assert select.cache_row_launch(4, 6000, None, None) == (1024, None)  # more rows: the default cap
    assert select.cache_row_launch(2, 6000, 512, 8) == (512, 8)  # knobs win
    from sparse_fx.lowering.kernels.compile_check import recording

    g = gen(32)
    scores = _scores("near-ties", 1, 2, 6000, g).to(DEV)
    mask = make_mask("bool", 1, 2, 6000, g, now=5900)
    with recording() as launches:  # the default path takes the wide layout: 6 programs of one block a row
        K.select_topk(scores, torch.tensor([5900], device=DEV), 900, 8, 16, mask, k_inner=300)
    keys = [(grid, kw["BLOCK"]) for kernel, grid, _, kw in launches if kernel.fn.__name__ == "_score_keys_kernel"]
    assert keys == [((6, 2), 1024)], keys
    check_nested(scores, torch.tensor([5900], device=DEV), 900, 300, 8, 16, mask)
    check(scores, torch.tensor([5900], device=DEV), 900, 8, 16, mask)


def test_selection_does_not_depend_on_the_cache_length():
    """Slots after the query are never read: a longer cache (more generated tokens to come) with
    anything in those slots selects the same positions, ties included."""
    g = gen(31)
    short = _scores("ties", 1, 2, 500, g)
    long = torch.cat([short, torch.randn(1, 2, 1500, generator=g) * 100], -1)
    pos = torch.tensor([490])
    a = K.select_topk(short.to(DEV), pos.to(DEV), 64, 4, 4)
    b = K.select_topk(long.to(DEV), pos.to(DEV), 64, 4, 4)
    assert torch.equal(a.cpu(), b.cpu())


def test_left_padding_moves_the_sink_to_the_first_real_token():
    g = gen(32)
    L, pad = 200, 37
    scores = torch.randn(2, 1, L, generator=g).to(DEV)
    mask = torch.ones(2, 1, 1, L, dtype=torch.bool)
    mask[1, ..., :pad] = False
    start = ref.first_readable(mask, 2, L)
    assert start.tolist() == [0, pad]
    out = check(scores, torch.tensor([150], device=DEV), 20, 5, 5, mask.to(DEV), None, start.to(DEV))
    assert out[1, 0, :5].tolist() == list(range(pad, pad + 5))
    assert (out[1, 0][out[1, 0] >= 0] >= pad).all(), "padding selected"


def test_k_beyond_the_candidates_and_empty_rows():
    g = gen(11)
    scores = torch.randn(1, 2, 40, generator=g).to(DEV)
    out = check(scores, torch.tensor([3], device=DEV), 64, 8, 8)  # sink and local cover everything
    assert (out[..., 16:] == -1).all()
    check(scores, torch.tensor([39], device=DEV), 64, 2, 2)


# ------------------------------------------------------------------------------ hash_select
@pytest.mark.parametrize("G,W", [(1, 1), (3, 2), (4, 1), (8, 1)])  # G * 32 * W > 254: 16-bit keys
@pytest.mark.parametrize("mask_kind", ["none", "bool", "inf-head"])
def test_hash_select_equals_scoring_then_select(G, W, mask_kind):
    g = gen(G * 10 + W + len(mask_kind))
    B, Hkv, L = 2, 2, HASH_L
    q_logits = torch.randn(B, Hkv * G, 32 * W, generator=g).to(DEV)
    k_sig = torch.randint(-(2**31), 2**31 - 1, (B, Hkv, L, W), generator=g, dtype=torch.int64).to(torch.int32).to(DEV)
    mask = make_mask(mask_kind, B, Hkv * G, L, g, now=L - 100)
    start = torch.tensor([0, 9], dtype=torch.int32, device=DEV)
    pos = torch.tensor([L - 100], device=DEV)
    with poisoned():
        out = K.hash_select(q_logits, k_sig, pos, 100, 8, 8, mask, start).cpu()
    want = ref.hash_select(q_logits.cpu(), k_sig.cpu(), pos.cpu(), 100, 8, 8, None if mask is None else mask.cpu(), start.cpu())
    assert torch.equal(out, want)
    scores = ref.hamming_scores(ref.pack_signs(q_logits.cpu()), k_sig.cpu())
    assert torch.equal(want, select_contract(scores, pos, 100, 8, 8, mask, None, start))


def test_hash_select_takes_everything_when_the_budget_covers_the_row():
    g = gen(33)
    q_logits = torch.randn(1, 4, 32, generator=g).to(DEV)
    k_sig = torch.randint(-(2**31), 2**31 - 1, (1, 2, 400, 1), generator=g, dtype=torch.int64).to(torch.int32).to(DEV)
    out = K.hash_select(q_logits, k_sig, torch.tensor([300], device=DEV), 512, 4, 4).cpu()
    assert torch.equal(out[..., 8 : 8 + 293], torch.arange(4, 297, dtype=torch.int32).expand(1, 2, 293))
    assert (out[..., 8 + 293 :] == -1).all()


@pytest.mark.parametrize("L,waves,levels", [(200, 8, (8, 32)), (2112, 8, (4, None)), (1056, 16, (8, 33)), (1056, 8, (4, None))])
def test_hash_select_in_one_level_where_chunks_are_short(L, waves, levels):
    """Unset, hash_select counts 8-bit keys in one 256-bin level where a program's chunk is at most
    HASH_ONE_LEVEL_BLOCKS blocks (no level pass), else in two 16-bin levels: the same list either way.
    Blocks of 8 keys on the interpreter's 4 SMs: 25 over 25 programs; 264 over 32 (HASH_WIDE_CAP), 9
    a chunk; 132, a few past 32 x 4, over 33 programs where `waves` leaves room for them (a cache
    allocated a little past 128K), else over 32 in chunks of 5."""
    from sparse_fx.lowering.kernels.select import HASH_ONE_LEVEL_BLOCKS, HASH_STRETCH_CAP, hash_levels

    g = gen(35 + L + waves)
    pos = torch.tensor([L - 20], device=DEV)
    q_logits = torch.randn(1, 4, 32, generator=g).to(DEV)
    k_sig = torch.randint(-(2**31), 2**31 - 1, (1, 1, L, 1), generator=g, dtype=torch.int64).to(torch.int32).to(DEV)
    assert HASH_ONE_LEVEL_BLOCKS == 4 and HASH_STRETCH_CAP >= 33 and hash_levels(1, L, 8, 8, waves, k_sig.device) == levels
    assert hash_levels(1, L, 16, 8, waves, k_sig.device) == (4, None)  # 16-bit keys: never one level
    out = K.hash_select(q_logits, k_sig, pos, 60, 8, 8, block=8, waves=waves).cpu()
    assert torch.equal(out, ref.hash_select(q_logits.cpu(), k_sig.cpu(), pos.cpu(), 60, 8, 8))


def _octaves_as_if_symbolic(monkeypatch):
    """Launch sizes as a symbolic cache length gets them (common.octave, programs_per_row), on concrete lengths."""
    import sparse_fx.lowering.kernels.common as common

    monkeypatch.setattr(common, "symbolic", lambda n: True)


@pytest.mark.parametrize("L,waves", [(200, 8), (1056, 16)])
def test_hash_select_at_launch_sizes_of_a_symbolic_length(L, waves, monkeypatch):
    """A graph serving every cache length sizes launches by octaves of the length: fewer programs than
    blocks (25 blocks over 16 programs), and the stretch cap rounded up (a need of 33 programs, 40
    launched): the same selection as the reference."""
    _octaves_as_if_symbolic(monkeypatch)
    g = gen(47 + L)
    pos = torch.tensor([L - 20], device=DEV)
    q_logits = torch.randn(1, 4, 32, generator=g).to(DEV)
    k_sig = torch.randint(-(2**31), 2**31 - 1, (1, 1, L, 1), generator=g, dtype=torch.int64).to(torch.int32).to(DEV)
    with poisoned():
        out = K.hash_select(q_logits, k_sig, pos, 60, 8, 8, block=8, waves=waves).cpu()
    assert torch.equal(out, ref.hash_select(q_logits.cpu(), k_sig.cpu(), pos.cpu(), 60, 8, 8))


def test_nested_select_at_launch_sizes_of_a_symbolic_length(monkeypatch):
    _octaves_as_if_symbolic(monkeypatch)
    g = gen(48)
    scores = _scores("ties", 2, 2, 700, g).to(DEV)
    check_nested(scores, torch.tensor([690, 695], device=DEV), 120, 40, 4, 16, make_mask("bool", 2, 4, 700, g, now=695))


def test_rows_longer_than_a_packed_count():
    """16-bin radix levels count in 8-bit fields, one key per block and slot, so a program may own
    at most 255 blocks: a row of 264 blocks of 8 (261 holding candidates) held to one program per row
    (cap=1, waves=1) must be split. Identical signatures put every key in one bin."""
    g = gen(34)
    # One row: cap=1 asks for a single program, as 4 rows at waves=1 did (the interpreter's 4 nominal
    # SMs over 4 rows); the split to cdiv(264, 255) = 2 programs comes from the same floor in
    # plan_programs either way, at a quarter of the interpreted work.
    B, Hkv, L, now = 1, 1, 2112, 2100
    pos = torch.tensor([now], device=DEV)
    q_logits = torch.randn(B, Hkv * 4, 32, generator=g).to(DEV)
    k_sig = torch.full((B, Hkv, L, 1), 12345, dtype=torch.int32, device=DEV)
    out = K.hash_select(q_logits, k_sig, pos, 300, 8, 8, block=8, waves=1, level_bits=4, cap=1).cpu()
    assert torch.equal(out, ref.hash_select(q_logits.cpu(), k_sig.cpu(), pos.cpu(), 300, 8, 8))
    T = now - 8 - 8 + 1  # candidates 8 .. now - 8, all tied: 300 spread evenly over them
    spread = [8 + j for j in range(T) if (j + 1) * 300 // T > j * 300 // T]
    assert torch.equal(out[0, 0, 16:], torch.tensor(spread, dtype=torch.int32)) and spread[0] < 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind,L,k", [("hamming", 131072, 4096), ("float", 131072, 16384), ("ties", 16384, 4096)])
def test_select_real_shapes(kind, L, k):
    g = gen(16)
    scores = _scores(kind, 2, 8, L, g).to(DEV)
    pos = torch.tensor([L - 5], device=DEV)
    mask = torch.ones(2, 1, 1, L, dtype=torch.bool, device=DEV)
    out = K.select_topk(scores, pos, k, 128, 128, mask)
    assert torch.equal(out.cpu(), ref.select_topk(scores.cpu(), pos.cpu(), k, 128, 128, mask.cpu()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["float", "ties"])
@pytest.mark.parametrize("row", [True, False])
@pytest.mark.parametrize("B", [1, 2])  # 8 rows: the raised program cap; 16: the default one
def test_select_nested_real_shapes(kind, row, B):
    """A Prism proposal at 128K: the pool of 16384 and its budget of 4096 in one selection."""
    g = gen(17)
    L = 131072
    scores = _scores(kind, B, 8, L, g).to(DEV)
    pos = torch.tensor([L - 5], device=DEV)
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device=DEV)
    out, inner = K.select_topk(scores, pos, 16384, 128, 128, mask, k_inner=4096, row=row)
    want, want_in = ref.select_nested(scores.cpu(), pos.cpu(), 16384, 4096, 128, 128, mask.cpu())
    assert torch.equal(out.cpu(), want) and torch.equal(inner.cpu(), want_in)
