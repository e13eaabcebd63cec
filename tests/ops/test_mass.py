"""The adaptive budget (a plan's mass < 1): the rule against its contract, written out here in
exact arithmetic, on random attention; the select kernels that apply it; and decode with it.

The contract, per (batch, KV head) row: the fixed budget's choice (select_topk at mass 1) is
trimmed. Masses count as the selection ranks them (bfloat16-truncated; non-positive, NaN: none);
the total is over all candidates (readable, after the sink, before the local window, scored). Of
the chosen, take the fewest, largest first, whose sum reaches p x the total; the smallest mass
taken is the threshold t and every chosen candidate of mass >= t stays (ties at t included), in
cache order, -1 after. Short of p x total (or no mass): all chosen stay.
"""

from __future__ import annotations

import struct
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import StaticCache

import sparse_fx
from support import (DEV, MORE, SENTINEL, gen, make_mask, options_for, poisoned, select_contract, step_through, tiny_model)
from sparse_fx.lowering import reference as ref
from sparse_fx.lowering import kernels as K


def bf16_value(m: float) -> Fraction:
    """A mass as the selection ranks it: float32 truncated to bfloat16, exactly (nonpositive: 0)."""
    bits = struct.unpack("<i", struct.pack("<f", m))[0] & ~0xFFFF
    v = struct.unpack("<f", struct.pack("<i", bits))[0]
    return Fraction(v) if v > 0 else Fraction(0)


def contract(mass, p, k, pos, sink, local, mask=None, positions=None, start=None) -> torch.Tensor:
    """select_topk with mass p, row by row in exact arithmetic: the fixed budget's list (the select
    contract), its chosen trimmed to the fewest largest masses reaching p x all candidates' mass;
    p = 1 is the fixed budget itself (no trim: candidates of no mass stay)."""
    chosen = select_contract(mass, pos, k, sink, local, mask, positions, start)
    if p >= 1:
        return chosen
    B, Hkv, N = mass.shape
    W, now = sink + local, int(pos[-1])
    readable = ref.valid_positions(mask, B, Hkv, mask.shape[-1] if mask is not None else N)
    out = torch.full_like(chosen, -1)
    out[..., :W] = chosen[..., :W]
    for b in range(B):
        first = 0 if start is None else int(start[b])
        for h in range(Hkv):
            value = {}  # candidate position -> its mass
            for i in range(N):
                at = i if positions is None else int(positions[b, h, i])
                m = float(mass[b, h, i])
                if at < first + sink or at > now - local or at < 0 or (mask is not None and not readable[b, h, at]):
                    continue
                if m == m and m > float("-inf"):
                    value[at] = bf16_value(m)
            taken = [int(x) for x in chosen[b, h, W:] if x >= 0]
            goal = Fraction(str(p)) * sum(value.values())  # p as written (0.9 is 9/10)
            ranked, run, t = sorted((value[x] for x in taken), reverse=True), Fraction(0), None
            for v in ranked:
                run += v
                if goal > 0 and run >= goal:
                    t = v
                    break
            kept = [x for x in taken if t is None or value[x] >= t]
            out[b, h, W:W + len(kept)] = torch.tensor(kept, dtype=torch.int32)
    return out


def attention(kind: str, B: int, Hkv: int, N: int, g) -> torch.Tensor:
    """Masses of each kind: softmax attention (mild, sharp), ties of exact sums (p x total
    reached exactly), one candidate holding most of the mass, flat rows (the cap decides)."""
    if kind in ("mild", "sharp"):
        temp = 1.0 if kind == "mild" else 6.0
        return torch.softmax(torch.randn(B, Hkv, N, generator=g) * temp, -1)
    if kind == "ties":
        return torch.randint(0, 5, (B, Hkv, N), generator=g).float() / 64
    if kind == "peaked":
        m = torch.rand(B, Hkv, N, generator=g) * 1e-4
        m[..., torch.randint(0, N, (1,), generator=g)] = 1.0
        return m
    if kind == "flat":
        return torch.full((B, Hkv, N), 1.0 / N)
    raise ValueError(kind)


KINDS = ["mild", "sharp", "ties", "peaked", "flat"]


def inputs(kind, k, sink, local, now, mask_kind, pooled, padded, seed):
    g = gen(seed)
    B, Hkv, L = 2, 2, 160
    N = 70 if pooled else L
    mass = attention(kind, B, Hkv, N, g)
    mass[torch.rand(B, Hkv, N, generator=g) < 0.05] = float("-inf")  # candidates masked by score
    mask = make_mask(mask_kind, B, Hkv * 2, L, g, now=now)
    mask = None if mask is None else mask.cpu()
    start = torch.tensor([0, min(now, 9)], dtype=torch.int32) if padded else None
    if padded and mask is not None:
        mask[1, ..., : int(start[1])] = False if mask.dtype == torch.bool else float("-inf")
    positions = None
    if pooled:
        positions = torch.stack([torch.stack([torch.randperm(L, generator=g)[:N] for _ in range(Hkv)]) for _ in range(B)])
        positions[..., ::7] = -1
    return mass, torch.tensor([now]), mask, positions, start


def near_goal(mass, chosen, p, pos, sink, local, mask, positions, start, rel=1e-5) -> torch.Tensor:
    """[B,Hkv] bool: rows where a prefix of the chosen masses (largest first) lies within `rel` of
    the total of p x total, so that float32 sums (the kernels') and float64 ones may cut apart."""
    _, eligible = ref.candidates(mass, pos, sink, local, mask, positions, start)
    v = torch.where(eligible, ref.selection_mass(mass), 0.0)
    total = v.sum(-1, keepdim=True)
    at = torch.arange(mass.shape[-1]).expand_as(mass) if positions is None else positions.long()
    picked = chosen[..., sink + local:].long()
    hit = (at[..., None, :] == picked[..., :, None]) & (picked[..., :, None] >= 0)  # [B,Hkv,K,N]
    run = (hit.double() * v[..., None, :]).sum(-1).sort(-1, descending=True).values.cumsum(-1)
    return ((run - p * total).abs() <= rel * total).any(-1)


def run_rule(kind, p, k, sink, local, now, mask_kind, pooled, padded, seed, kernels: bool):
    mass, pos, mask, positions, start = inputs(kind, k, sink, local, now, mask_kind, pooled, padded, seed)
    want = ref.select_topk(mass, pos, k, sink, local, mask, positions, start, p)
    assert torch.equal(want, contract(mass, p, k, pos, sink, local, mask, positions, start)), "reference != contract"
    fixed = ref.select_topk(mass, pos, k, sink, local, mask, positions, start)
    W = sink + local
    assert torch.equal(want[..., :W], fixed[..., :W]), "the window always stays"
    for row, full in zip(want[..., W:].flatten(0, 1), fixed[..., W:].flatten(0, 1)):
        assert set(row[row >= 0].tolist()) <= set(full[full >= 0].tolist()), "a key the fixed budget would not take"
    if kernels:
        dev = [None if t is None else t.to(DEV) for t in (mass, pos, mask, positions, start)]
        with poisoned():
            got = K.select_topk(dev[0], dev[1], k, sink, local, *dev[2:], mass=p, block=64, waves=64).cpu()
        assert (got != SENTINEL).all(), "an output slot was never written"
        ok = (got == want).all(-1) | near_goal(mass, want, p, pos, sink, local, mask, positions, start)
        assert ok.all(), f"kernel != reference in rows {(~ok).nonzero().tolist()}"
    return (want[..., W:] >= 0).sum(-1), (fixed[..., W:] >= 0).sum(-1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", [0.5, 0.75, 0.9])
def test_mass_rule_equals_the_contract_and_the_kernel(kind, p):
    n_kept, n_fixed = run_rule(kind, p, 40, 3, 8, 150, "bool", kind in ("mild", "ties"), kind == "sharp", KINDS.index(kind),
                               kernels=True)
    assert (n_kept <= n_fixed).all() and (n_kept[n_fixed > 0] >= 1).all()
    if kind == "flat":
        assert torch.equal(n_kept, n_fixed), "flat rows: ties at the threshold all stay"
    if kind == "peaked":  # (in a row whose peak is a candidate: not masked, not in the window)
        assert (n_kept == 1).any(), "one candidate holds the mass: it alone stays"


@MORE
@given(kind=st.sampled_from(KINDS), p=st.sampled_from([0.25, 0.5, 0.75, 0.875, 0.95, 0.3, 1.0]), k=st.integers(1, 200),
       sink=st.integers(0, 12), local=st.integers(1, 20), now=st.integers(0, 159),
       mask_kind=st.sampled_from(["none", "bool", "min", "inf-head"]), pooled=st.booleans(), padded=st.booleans(),
       seed=st.integers(0, 2**16))
def test_mass_rule_property(kind, p, k, sink, local, now, mask_kind, pooled, padded, seed):
    run_rule(kind, p, k, sink, local, now, mask_kind, pooled, padded, seed, kernels=False)


@given(kind=st.sampled_from(KINDS), k=st.integers(1, 120), seed=st.integers(0, 2**16))
def test_a_larger_share_keeps_a_superset(kind, k, seed):
    mass, pos, mask, positions, start = inputs(kind, k, 2, 4, 150, "bool", False, False, seed)
    lists = [ref.select_topk(mass, pos, k, 2, 4, mask, positions, start, p)[..., 6:] for p in (0.3, 0.6, 0.9, 1.0)]
    for small, large in zip(lists, lists[1:]):
        for a, b in zip(small.flatten(0, 1), large.flatten(0, 1)):
            assert set(a[a >= 0].tolist()) <= set(b[b >= 0].tolist())


def test_one_candidate_the_cap_and_a_row_without_candidates():
    """p reached by one candidate: it alone; only past k candidates: the k largest; no candidate:
    nothing, and no error. Kept candidates come first, in cache order, -1 after."""
    pos = torch.tensor([4])
    peak = torch.tensor([[[0.01, 0.9, 0.02, 0.01, 0.5]]])  # 0.9 of 0.94 >= 0.95 x 0.94 (position 4: local)
    assert ref.select_topk(peak, pos, 3, 0, 1, mass=0.95).tolist() == [[[4, 1, -1, -1]]]
    mass = torch.tensor([[[0.3, 0.25, 0.2, 0.15, 0.1]]])
    assert ref.select_topk(mass, pos, 2, 0, 1, mass=0.99).tolist() == [[[4, 0, 1]]]  # the cap
    assert ref.select_topk(mass, pos, 3, 0, 1, mass=0.5).tolist() == [[[4, 0, 1, -1]]]  # 0.55 of 0.9: 0.61 >= 0.5
    assert ref.select_topk(mass, torch.tensor([0]), 3, 0, 1, mass=0.5).tolist() == [[[0, -1, -1, -1]]]


def test_mass_select_kernel_trims_the_pool_as_the_reference():
    """The fused path of a refined layer (logits, mass keys, select, trim) against the reference."""
    g = gen(11)
    q, k = torch.randn(2, 8, 1, 64, generator=g) * 2, torch.randn(2, 2, 200, 64, generator=g)
    positions = torch.stack([torch.stack([torch.randperm(180, generator=g)[:90] for _ in range(2)]) for _ in range(2)])
    positions[..., ::9] = -1
    pos, mask = torch.tensor([199]), make_mask("bool", 2, 8, 200, g, now=199).cpu()
    for p in (0.3, 0.8):
        want = ref.mass_select(q, k, None, mask, positions, pos, 40, 2, 4, None, p)
        with poisoned():
            got = K.mass_select(*(t.to(DEV) for t in (q, k)), None, mask.to(DEV), positions.to(DEV), pos.to(DEV), 40, 2, 4,
                                mass=p, block=64, waves=64).cpu()
        assert (got != SENTINEL).all(), "an output slot was never written"
        m = ref.mass_scores(q, k, None, mask, positions)
        ok = (got == want).all(-1) | near_goal(m, want, p, pos, 2, 4, mask, positions, None)
        assert ok.all(), f"p={p}: kernel != reference in rows {(~ok).nonzero().tolist()}"
        assert (want[..., 6:] >= 0).sum(-1).lt(40).any(), "the trim never cut: the test shows nothing"


# ------------------------------------------------------------------------------------ decode
OPTIONS = dict(budget=6, sink=2, local=3, rho=2.0, int2_group=8)


@pytest.mark.parametrize("plan", ["oracle", "prism-g2", "static-g2"])
def test_mass_one_is_todays_plan_and_with_a_covering_budget_equals_dense(plan):
    assert sparse_fx.Plan.parse(plan, mass=1) == sparse_fx.Plan.parse(plan)  # one plan, one graph: the fixed budget
    model = tiny_model("llama", layers=4)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        dense = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
        sparse_fx.compile(model, plan, backend="eager", mass=1.0, **options_for(plan, **dict(OPTIONS, budget=64)))
        sparse = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert torch.equal(sparse, dense)


@pytest.mark.parametrize("plan", ["oracle-mass0.5", "prism-g2-mass0.8", "prism-g2-hash-mass0.8"])
def test_decode_with_mass_is_finite_within_budget_and_never_recompiles(plan):
    """A random tiny model attends almost uniformly: p of the mass needs about p of the candidates."""
    budget = 24
    model = sparse_fx.compile(tiny_model("llama", layers=4), plan, backend="eager", measure=True,
                              **options_for(plan, **dict(OPTIONS, budget=budget)))
    ids = torch.randint(1, 128, (2, 44), generator=torch.Generator().manual_seed(2))
    outs = step_through(model, ids, 20, StaticCache(config=model.config, max_cache_len=48))
    assert all(torch.isfinite(o).all() for o in outs)
    kept = sparse_fx.measurements(model).per_layer("kept")  # [steps x batch, query heads]
    full = torch.tensor([min(now + 1 - 5, budget) for now in range(20, 44)]).repeat_interleave(2)[:, None]
    for layer, n in kept.items():
        assert (n <= full).all() and (n >= 1).all(), f"layer {layer}: {n.unique().tolist()} tokens kept"
    cut = [layer for layer, n in kept.items() if (n < full).any()]
    if plan.startswith("prism"):  # proposal layers (0, 2) keep the full budget: no exact mass there
        assert cut == [1, 3] and torch.equal(kept[0], full.expand(-1, 4).double())
    else:
        assert cut == [0, 1, 2, 3], "mass < 1 never cut the budget"
    assert "mass" in str(sparse_fx.explain(model))


def test_inductor_decode_with_mass_never_recompiles():
    model = sparse_fx.compile(tiny_model("llama", layers=2), "prism-g2-mass0.7", **OPTIONS)
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(3))
    outs = step_through(model, ids, 16, StaticCache(config=model.config, max_cache_len=32))
    eager = sparse_fx.compile(tiny_model("llama", layers=2), "prism-g2-mass0.7", backend="eager", **OPTIONS)
    for a, b in zip(outs, step_through(eager, ids, 16, StaticCache(config=model.config, max_cache_len=32))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    row = sparse_fx.explain(model).rows[0]
    assert row.action == "sparse" and row.budget == "2+3+6, pool 12, full budget (no exact mass)"
    assert sparse_fx.explain(model).rows[1].budget == "2+3+6, from L0, mass 0.7"
