"""The adaptive budget (a plan's mass < 1): the mass rule against its contract, written out here
in exact arithmetic, on random attention; the select kernels over its cut; and decode with it.

The contract, per (batch, KV head) row: the candidates are select_topk's (readable, after the
sink, before the local window, scored); of their masses (non-positive, NaN: none) take the fewest,
largest first, whose sum reaches p x the row's total, at most k of them; the smallest mass taken is
the threshold t and every candidate of mass >= t stays (ties at t included). No mass: all stay.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import StaticCache

import sparse_fx
from families import tiny_model
from opcheck import DEV, MORE, gen, make_mask
from sparse_fx.lowering import reference as ref
from sparse_fx.methods import mass_cut
from test_decode import step_through
from test_op_select import check


def contract(mass, scores, p, k, pos, sink, local, mask=None, positions=None, start=None) -> torch.Tensor:
    """[B,Hkv,N] bool: the candidates the mass rule keeps, row by row in exact arithmetic."""
    B, Hkv, N = scores.shape
    now = int(pos[-1])
    readable = ref.valid_positions(mask, B, Hkv, mask.shape[-1] if mask is not None else N)
    out = torch.zeros(B, Hkv, N, dtype=torch.bool)
    for b in range(B):
        first = 0 if start is None else int(start[b])
        for h in range(Hkv):
            cands = []
            for i in range(N):
                at = i if positions is None else int(positions[b, h, i])
                s = float(scores[b, h, i])
                if at < first + sink or at > now - local or at < 0 or (mask is not None and not readable[b, h, at]):
                    continue
                if s != s or s == float("-inf"):
                    continue
                m = float(mass[b, h, i])
                cands.append((i, Fraction(m) if m > 0 else Fraction(0)))
            total = sum(m for _, m in cands)
            if total == 0:
                kept = [i for i, _ in cands]
            else:
                ranked = sorted((m for _, m in cands), reverse=True)
                c, run = min(k, len(ranked)), Fraction(0)
                for n, m in enumerate(ranked[: min(k, len(ranked))], 1):
                    run += m
                    if run >= Fraction(str(p)) * total:  # p as written (0.9 is 9/10)
                        c = n
                        break
                kept = [i for i, m in cands if m >= ranked[c - 1]]
            out[b, h, kept] = True
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


def run_rule(kind, p, k, sink, local, now, mask_kind, pooled, padded, seed, kernels: bool):
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
    pos = torch.tensor([now])
    cut = mass_cut(mass, mass, p, k, pos, sink, local, mask, positions, start)
    _, eligible = ref.candidates(mass, pos, sink, local, mask, positions, start)
    want = contract(mass, mass, p, k, pos, sink, local, mask, positions, start)
    kept = eligible & (cut > float("-inf"))
    assert torch.equal(kept, want), f"rule != contract at {(kept != want).nonzero()[:5].tolist()}"
    assert torch.equal(cut[kept], mass[kept]), "kept candidates keep their scores"
    if kernels:  # kernels == reference == select contract over the cut scores
        chosen = check(cut.to(DEV), pos.to(DEV), k, sink, local, None if mask is None else mask.to(DEV),
                       None if positions is None else positions.to(DEV), None if start is None else start.to(DEV))
    else:
        chosen = ref.select_topk(cut, pos, k, sink, local, mask, positions, start)
    window = sink + local
    picked = chosen[..., window:]
    n_kept = kept.sum(-1)
    assert torch.equal((picked >= 0).sum(-1), n_kept.clamp(max=k)), "the select takes min(k, kept)"
    at = torch.arange(N).expand(B, Hkv, N) if positions is None else positions
    for b in range(B):
        for h in range(Hkv):
            assert set(picked[b, h][picked[b, h] >= 0].tolist()) <= set(at[b, h][kept[b, h]].tolist())
    return n_kept, eligible.sum(-1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", [0.5, 0.75, 0.9])
def test_mass_rule_equals_the_contract_and_the_kernels_select_its_cut(kind, p):
    n_kept, n_cand = run_rule(kind, p, 40, 3, 8, 150, "bool", kind in ("mild", "ties"), kind == "sharp", KINDS.index(kind),
                              kernels=True)
    assert (n_kept <= n_cand).all() and (n_kept[n_cand > 0] >= 1).all()
    if kind == "flat":
        assert (n_kept == n_cand).all(), "flat rows: every candidate, ties at the threshold included"


@MORE
@given(kind=st.sampled_from(KINDS), p=st.sampled_from([0.25, 0.5, 0.75, 0.875, 0.95, 0.3, 1.0]), k=st.integers(1, 200),
       sink=st.integers(0, 12), local=st.integers(1, 20), now=st.integers(0, 159),
       mask_kind=st.sampled_from(["none", "bool", "min", "inf-head"]), pooled=st.booleans(), padded=st.booleans(),
       seed=st.integers(0, 2**16))
def test_mass_rule_property(kind, p, k, sink, local, now, mask_kind, pooled, padded, seed):
    run_rule(kind, p, k, sink, local, now, mask_kind, pooled, padded, seed, kernels=False)


def test_one_candidate_the_cap_and_a_row_without_candidates():
    """p reached by one candidate: it alone; only past k candidates: the k largest; no candidate:
    nothing, and no error."""
    pos = torch.tensor([4])
    peak = torch.tensor([[[0.01, 0.9, 0.02, 0.01, 0.5]]])  # 0.9 of 0.94 >= 0.95 x 0.94 (position 4: local)
    assert (mass_cut(peak, peak, 0.95, 3, pos, 0, 1) > float("-inf")).tolist() == [[[False, True, False, False, False]]]
    mass = torch.tensor([[[0.3, 0.25, 0.2, 0.15, 0.1]]])
    cut = mass_cut(mass, mass, 0.99, 2, pos, 0, 1)  # local window: position 4
    assert (cut > float("-inf")).tolist() == [[[True, True, False, False, False]]]
    cut = mass_cut(mass, mass, 0.5, 3, pos, 0, 1)  # 0.3 + 0.25 = 0.55 of 0.9 total: 0.61 >= 0.5
    assert (cut > float("-inf")).tolist() == [[[True, True, False, False, False]]]
    cut = mass_cut(mass, mass, 0.5, 3, torch.tensor([0]), 0, 1)
    assert ref.select_topk(cut, torch.tensor([0]), 3, 0, 1)[..., 1:].eq(-1).all()


# ------------------------------------------------------------------------------------ decode
OPTIONS = dict(budget=6, sink=2, local=3, rho=2.0, int2_group=8)


@pytest.mark.parametrize("plan", ["oracle", "prism-g2", "static-g2"])
def test_mass_one_is_todays_plan_and_with_a_covering_budget_equals_dense(plan):
    assert sparse_fx.Plan.parse(plan, mass=1) == sparse_fx.Plan.parse(plan)  # one plan, one graph: the fixed budget
    model = tiny_model("llama", layers=4)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        dense = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
        sparse_fx.compile(model, plan, backend="eager", **dict(OPTIONS, budget=64), mass=1.0)
        sparse = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert torch.equal(sparse, dense)


@pytest.mark.parametrize("plan", ["oracle-mass0.5", "prism-g2-mass0.8", "prism-g2-hash-mass0.8"])
def test_decode_with_mass_is_finite_within_budget_and_never_recompiles(plan):
    """A random tiny model attends almost uniformly: p of the mass needs about p of the candidates."""
    budget = 24
    model = sparse_fx.compile(tiny_model("llama", layers=4), plan, backend="eager", measure=True,
                              **dict(OPTIONS, budget=budget))
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
