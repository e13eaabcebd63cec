"""The quality harness (`sparse_fx.offline.harness`) on SmolLM2, reduced: fails on a clear quality regression.

Two runs at context 512 (sink 32 + local 32, 2 held-out windows x 32 teacher-forced steps, one
passkey trial at depth 50%): every plan at sparsity 4, and oracle with a budget covering the
context, which must be dense to the token. A third, without passkeys, at sparsity 8 checks the
one-pass teacher forcing (sparse_fx.offline.agreement) where Prism pools are real subsets
(`make test-slow`, with the one-pass pass key). About 3 minutes on one CPU core.
"""

import copy
import functools
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

import sparse_fx
from support import ROOT
from sparse_fx.offline import agreement, harness
from sparse_fx.lowering.reference import first_readable
from sparse_fx.methods import Site
from sparse_fx.model_info import ModelInfo
from sparse_fx.runtime.caches import KVShape
from sparse_fx.runtime.encoders import HeadMLP, LayerEncoders, SignatureEncoders

pytestmark = pytest.mark.model

PLANS = ["dense", "oracle", "hash", "prism-g4", "static-g4"]
N = 512
# Floors on next-token agreement with dense at sparsity 4 (128 + 32 + 32 of 512 tokens), set well
# below what the run measured on 2026-11-29 (64 teacher-forced tokens): oracle 98.4%, hash 92.2%,
# prism-g4 98.4%, static-g4 95.3%; recall@32 0.995 / 0.802 / 0.985 / 0.844.
AGREEMENT_FLOOR = {"oracle": 0.90, "hash": 0.75, "prism-g4": 0.85, "static-g4": 0.80}
RECALL_FLOOR = {"oracle": 0.95, "hash": 0.65, "prism-g4": 0.90, "static-g4": 0.70}
BENCH = ROOT / "bench"


def bench_script(name: str):
    """A bench script as a module, imported as it imports its neighbours: with bench/ on sys.path."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    return importlib.import_module(name)


def settings(**overrides):
    base = dict(plans=PLANS, contexts=[N], sparsities=[4], sink=32, local=32, decode_tokens=32, windows=2,
                depths=[50], passkey_trials=1, passkey_offset=4, answer_tokens=7, probe_passkey=True)
    return harness.Settings(**{**base, **overrides})


@pytest.fixture(scope="module")
def reduced(smollm2, tmp_path_factory):
    model, tok = smollm2
    s = settings()
    results = harness.run(copy.deepcopy(model), tok, s, progress=False)
    cli = bench_script("quality_sweep")
    out = tmp_path_factory.mktemp("quality")
    argv = ["--tag", "ci", "--out", str(out)]
    doc = cli.document(model, cli.parse_args(argv), s, results, argv=[cli.__file__, *argv])
    paths = cli.write_outputs(doc, out, "ci")
    return {(r["plan"], r["sparsity"]): r for r in results["rows"]}, results, paths


def test_budget_covering_the_context_is_dense(smollm2):
    """oracle at sparsity 1 (budget = n, the whole cache): nothing to select, so every layer keeps
    dense attention, and the tokens and the loss are the dense model's."""
    model, tok = smollm2
    s = settings(plans=["oracle"], sparsities=[1], windows=1, depths=[50], passkey_trials=1)
    results = harness.run(copy.deepcopy(model), tok, s, progress=False)
    (row,) = results["rows"]
    assert row["teacher"]["agreement"] == 1.0
    assert abs(row["teacher"]["ce_delta"]) < 1e-4
    assert row["explain"]["sparse_layers"] == 0


def test_every_layer_sparse_and_no_recompiles(reduced):
    rows, results, _ = reduced
    for (plan, _), r in rows.items():
        assert r["explain"]["sparse_layers"] == (0 if plan == "dense" else 30), r["explain"]
    assert results["dynamo_graphs"] in (0, results["compiled_models"]), "a decode graph recompiled"


def test_dense_plan_reproduces_the_dense_reference(reduced):
    """The harness's reference (a chunked dense forward) equals dense stepping; dense is 100% itself."""
    rows, _, _ = reduced
    dense = rows[("dense", None)]
    assert dense["teacher"]["max_abs_logit_diff_vs_chunked_dense"] < 1e-3
    assert dense["teacher"]["agreement"] == 1.0 and abs(dense["teacher"]["ce_delta"]) < 1e-4
    assert dense["passkey"]["accuracy"] == 1.0  # SmolLM2 finds a key at 512 tokens


@pytest.mark.parametrize("plan", PLANS[1:])
def test_sparse_plans_stay_above_their_floors(reduced, plan):
    rows, _, _ = reduced
    r = rows[(plan, 4)]
    assert r["teacher"]["agreement"] >= AGREEMENT_FLOOR[plan], r["teacher"]
    assert r["probes"]["recall"]["mean"] >= RECALL_FLOOR[plan], r["probes"]["recall"]
    assert r["teacher"]["ce_delta"] < 0.25, r["teacher"]
    assert r["probes"]["recall"]["mean"] <= rows[("oracle", 4)]["probes"]["recall"]["mean"] + 1e-9, "beats the oracle"


def test_outputs_are_written(reduced):
    _, _, paths = reduced
    names = sorted(Path(p).name for p in paths)
    assert "quality-ci.json" in names and "quality-ci.md" in names
    assert {"quality-ci-recall.png", "quality-ci-agreement.png", "quality-ci-passkey.png", "quality-ci-kept.png",
            "quality-ci-tradeoff.png"} <= set(names)
    data = json.loads(Path(paths[0]).read_text())
    assert data["meta"]["versions"]["torch"] and data["meta"]["command"].startswith("python bench/quality_sweep.py --tag ci")
    assert len(data["rows"]) == 5
    assert len(data["rows"][1]["probes"]["recall"]["per_layer"]) == 30
    md = Path(paths[1]).read_text()
    assert "| oracle | 1/4 | 128+32+32 | 128 ± 0 |" in md  # tokens kept: the whole budget at every layer
    assert len(data["rows"][1]["probes"]["kept"]["per_layer_std"]) == 30
    for p in paths[2:]:
        assert Path(p).read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def pooled(smollm2):
    """The harness at sparsity 8 for the plans whose Prism pool (4 x 64) must be a true subset of the 448
    candidates to test anything: signature proposals and an adaptive budget (no passkeys)."""
    model, tok = smollm2
    results = harness.run(copy.deepcopy(model), tok, settings(plans=POOLED, sparsities=[8], depths=[]), progress=False)
    return {(r["plan"], r["sparsity"]): r for r in results["rows"]}


POOLED = ["prism-g4-hash", "prism-g4-mass0.9"]
ONE_PASS = [(plan, 4) for plan in PLANS[1:]] + [(plan, 8) for plan in POOLED]


@pytest.fixture(scope="module")
def one_pass(smollm2):
    """sparsity -> sparse_fx.offline.agreement's one-pass rows of the ONE_PASS plans at it: one evaluate
    per sparsity, its plans sharing each window's dense forward (a plan's row is the same alone or
    with others: each has its own Selector, reset before its forward)."""
    model, tok = smollm2
    s = settings()
    rows = {}

    def at(sparsity: int) -> dict:
        if sparsity not in rows:
            plans = {plan: sparse_fx.Plan.parse(plan, sink=s.sink, local=s.local) for plan, sp in ONE_PASS if sp == sparsity}
            rows[sparsity] = agreement.evaluate(model, tok, plans, N, sparsity, windows=s.windows, span=s.decode_tokens,
                                                seed=s.seed)["plans"]
        return rows[sparsity]

    return at


# the sparsity-8 cells (Prism pools that are real subsets) take minutes more: `make test-slow`
@pytest.mark.parametrize("plan, sparsity", [pytest.param(p, sp, marks=[pytest.mark.slow] if sp == 8 else []) for p, sp in ONE_PASS])
def test_one_pass_teacher_forcing_equals_the_harness(one_pass, request, plan, sparsity):
    """sparse_fx.offline.agreement scores many tokens in one masked forward pass instead of decoding them:
    on the harness's windows and tokens it must give the harness's agreement, CE delta and tokens kept.

    Not to the last bit: the one pass computes q and k for every position at once and scores many rows
    per call, so floats round differently (~1e-6 relative), and a score within an ulp of a bfloat16
    boundary of `selection_keys` (INT2 scores often are) can swap one key at a pool's or budget's edge.
    Measured (2026-11-30, 7 plans x sparsity 4 and 8): |CE diff| <= 1.5e-6 with no swap; the one plan
    with swaps (the calibrated plan file at 1/8: 2 swaps in 960 layer x position selections, cascading
    to 11) gave 2.4e-5, kept and agreement still equal; the rounding is the CPU's (GEMM blocking), and
    on another Xeon (2026-12-01) prism-g4-hash at 1/8, whose LSH signs can flip on a projection near
    zero, gave 1.2e-4 with agreement equal. Plan errors move CE far more with agreement unchanged: one
    sink or local token fewer, a pool 3 larger (prism-g4, 1/8), mass 0.905 for 0.9: 8e-4 to 5e-3 (the
    earlier 2e-3 let two of those pass), so 4e-4 keeps a factor 2 to the smallest of them."""
    rows = request.getfixturevalue("reduced")[0] if sparsity == 4 else request.getfixturevalue("pooled")
    s = settings()
    ours = one_pass(sparsity)[plan]
    theirs = rows[(plan, sparsity)]
    assert sum(ours["per_window"]["agreement"]) / s.windows == pytest.approx(theirs["teacher"]["agreement"], abs=1e-9)
    assert ours["ce_delta"]["mean"] == pytest.approx(theirs["teacher"]["ce_delta"], abs=4e-4)
    assert ours["kept"]["mean"] == pytest.approx(theirs["probes"]["kept"]["mean"], abs=1e-3)  # 1 token in 5760 selections: 1.7e-4


@pytest.fixture(scope="module")
def mlp_encoders(smollm2, tmp_path_factory):
    """Signature encoders of the trained kind (query and key MLPs of their own) for SmolLM2, random weights."""
    model, _ = smollm2
    info = ModelInfo.of(model)
    g = torch.Generator().manual_seed(0)

    def mlp(heads):
        return HeadMLP([torch.randn(heads, info.head_dim, 64, generator=g), torch.randn(heads, 64, 32, generator=g)],
                       [torch.randn(heads, 64, generator=g), None])

    layers = [LayerEncoders(query=mlp(info.q_heads), key=mlp(info.kv_heads)) for _ in range(info.num_layers)]
    path = tmp_path_factory.mktemp("encoders")
    SignatureEncoders(layers, bits=32, fingerprint=info.fingerprint(model), metadata={}).save(path)
    return str(path)


@pytest.mark.parametrize("plan", PLANS[1:] + POOLED + ["static-g4-hash", "oracle-mass0.9", "prism-g4-int2refine", "hash learned",
                                  "prism-g4-hash learned"])
def test_one_pass_selection_is_the_decode_steps(smollm2, mlp_encoders, monkeypatch, plan):
    """The one-pass selector's rows (left-padded, several per chunk) choose what the plan's decode step
    chooses at each position on an unpadded cache, key for key, ties and Prism pools included."""
    model, _ = smollm2
    T, E, Hq, Hkv, D = 300, 40, 9, 3, 64
    monkeypatch.setattr(agreement, "ROW_KEYS", 16 * T)  # rows in chunks of 16: chunks carry pools of their own
    torch.manual_seed(0)
    name, learned = plan.removesuffix(" learned"), plan.endswith(" learned")
    plan = sparse_fx.Plan.parse(name, sink=8, local=8, encoders=mlp_encoders if learned else None)
    ours, ref = agreement.Selector(plan, model, 16), agreement.Selector(plan, model, 16)
    assert ours.state.encoders.learned == learned
    ours.begin()
    carries = [{} for _ in range(E)]
    for layer in range(5):  # a proposal layer, its three refined layers, the next proposal layer
        q, k = 4 * torch.randn(1, Hq, E, D), torch.randn(1, Hkv, T, D)
        k[:, :, 50:60] = k[:, :, 40:41]  # ties
        got = ours.mask(layer, q, k, D**-0.5)[0]
        side = ref._side_cache(layer, k)
        for e, carry in enumerate(carries):
            p = T - E + e
            mask = (torch.arange(T) <= p)[None, None, None]
            site = Site(layer=layer, role=ref.state.role(layer), q=q[:, :, e : e + 1], k=k, v=None, mask=mask, scale=D**-0.5,
                        pos=torch.tensor([p]), start=first_readable(mask, 1, T), kv=KVShape.of(k), q_heads=Hq, side=side,
                        carry=carry)
            idx = ref.state.method.select(ref.emit, ref.state.context, site).indices.long()[0]
            want = torch.zeros(Hkv, T + 1, dtype=torch.bool).scatter_(1, torch.where(idx >= 0, idx, T), True)[:, :T]
            assert torch.equal(got[:, e], want), (layer, e)


@pytest.mark.parametrize("s", [3, 8])
def test_a_shared_selection_is_the_last_refresh_steps_choice_plus_the_own_window(smollm2, s):
    """refresh=s: row e reads row e - e % s's choice (refresh=1), plus its own sink and its own local
    window (every token since that step), nothing else; the refresh rows themselves are unchanged."""
    model, _ = smollm2
    T, E, Hq, Hkv, D, sink, local = 300, 40, 9, 3, 64, 8, 8
    plan = sparse_fx.Plan.parse("hash", sink=sink, local=local)
    fresh, shared = agreement.Selector(plan, model, 16), agreement.Selector(plan, model, 16, refresh=s)
    torch.manual_seed(s)
    q, k = 4 * torch.randn(1, Hq, E, D), torch.randn(1, Hkv, T, D)
    every, got = fresh.mask(0, q, k, D**-0.5)[0], shared.mask(0, q, k, D**-0.5)[0]
    for e in range(E):
        now = T - E + e
        window = (torch.arange(T) < sink) | ((torch.arange(T) > now - local) & (torch.arange(T) <= now))
        assert torch.equal(got[:, e], every[:, e - e % s] | window), e
        assert not got[:, e, now + 1 :].any()
    assert torch.equal(got[:, ::s], every[:, ::s])
    assert not torch.equal(got, every)  # the test would pass vacuously if sharing changed nothing
    with pytest.raises(ValueError, match="refresh must be in 1..local"):
        agreement.Selector(plan, model, 16, refresh=local + 1)


def test_a_shared_pool_is_re_scored_at_every_step_by_every_layer(smollm2, monkeypatch):
    """pool-refresh=s: at a refresh step (row e, e % s == 0) a proposal layer chooses as at s = 1; at
    any other step every layer, the proposal layer too, re-scores with its own query the pool that
    row e - e % s's proposal chose (the same tokens, moved into row e's slots), as a refined layer's
    decode step does with that pool carried."""
    model, _ = smollm2
    T, E, Hq, Hkv, D, s = 300, 40, 9, 3, 64, 3
    monkeypatch.setattr(agreement, "ROW_KEYS", 16 * T)  # chunks of 15 rows: pools shared within a chunk, never across
    plan = sparse_fx.Plan.parse("prism-g4", sink=8, local=8)
    shared, ref = agreement.Selector(plan, model, 16, refresh=s, share="pool"), agreement.Selector(plan, model, 16)
    P, R = 1, 2  # SmolLM2's shipped roles: layer 1 proposes, layer 2 refines
    assert [shared.state.role(i) for i in (P, R)] == ["proposal", "refined"]
    torch.manual_seed(s)
    (q0, q1), (k0, k1) = (4 * torch.randn(2, 1, Hq, E, D)), torch.randn(2, 1, Hkv, T, D)
    shared.begin(), ref.begin()
    got = [shared.mask(P, q0, k0, D**-0.5)[0], shared.mask(R, q1, k1, D**-0.5)[0]]
    fresh = [ref.mask(P, q0, k0, D**-0.5)[0], ref.mask(R, q1, k1, D**-0.5)[0]]
    assert torch.equal(got[0][:, ::s], fresh[0][:, ::s])
    assert not torch.equal(got[0], fresh[0]) and not torch.equal(got[1], fresh[1])  # sharing changes what layers read

    def site(layer, role, q, k, p, carry):
        mask = (torch.arange(T) <= p)[None, None, None]
        return Site(layer=layer, role=role, q=q, k=k, v=None, mask=mask, scale=D**-0.5, pos=torch.tensor([p]),
                    start=first_readable(mask, 1, T), kv=KVShape.of(k), q_heads=Hq, side=ref._side_cache(layer, k),
                    carry=carry)

    def chosen(selection):
        idx = selection.indices.long()[0]
        return torch.zeros(Hkv, T + 1, dtype=torch.bool).scatter_(1, torch.where(idx >= 0, idx, T), True)[:, :T]

    select = functools.partial(ref.state.method.select, ref.emit, ref.state.context)
    for e in range(E):
        carry, e0 = {}, e - e % s
        select(site(P, "proposal", q0[:, :, e0 : e0 + 1], k0, T - E + e0, carry))
        if e % s:
            assert torch.equal(got[0][:, e], chosen(select(site(P, "refined", q0[:, :, e : e + 1], k0, T - E + e, carry)))), e
        assert torch.equal(got[1][:, e], chosen(select(site(R, "refined", q1[:, :, e : e + 1], k1, T - E + e, carry)))), e
    for other in ("hash", "static-g4"):
        with pytest.raises(ValueError, match="re-score a proposal layer's pool"):
            agreement.Selector(sparse_fx.Plan.parse(other, sink=8, local=8), model, 16, refresh=2, share="pool")
    plans = {name: sparse_fx.Plan.parse(name, sink=8, local=8) for name in ("hash", "static-g4", "prism-g4")}
    assert sorted(agreement.selectors(model, plans, 256, 16, pool_refresh=(2,))) == [
        "hash", "prism-g4", "prism-g4 pool-refresh=2", "static-g4"]


@pytest.mark.slow
def test_one_pass_passkey_equals_the_harness(smollm2, reduced, monkeypatch):
    """sparse_fx.offline.agreement's teacher-forced pass key: a plan finds the key exactly when the
    harness's greedy answer, decoded through the compiled model, begins with it (every plan and trial
    of the reduced run, whose prompts end `passkey_offset` = 4 tokens before the answer); and a prompt
    holding another key is not found."""
    rows = reduced[0]
    model, tok = smollm2
    s = settings()
    plans = {p: sparse_fx.Plan.parse(p, sink=s.sink, local=s.local) for p in PLANS}
    ta = agreement
    ours = ta.passkey(model, tok, plans, N, 4, s.depths, s.passkey_trials, s.passkey_offset, s.seed)
    prompt = ta.passkey_prompt
    monkeypatch.setattr(ta, "passkey_prompt", lambda tok, n, depth, key: prompt(tok, n, depth, key + 1))
    miss = ta.passkey(model, tok, {}, N, 4, s.depths[:1], s.passkey_trials, s.passkey_offset, s.seed)
    assert not any(miss["dense"]["found"][str(s.depths[0])])
    for plan in PLANS:
        theirs = rows[(plan, None if plan == "dense" else 4)]["passkey"]["answers"]
        for d in s.depths:
            expected = [t["answer"].startswith(f" {t['key']}") for t in theirs[str(d)]]
            assert ours[plan]["found"][str(d)] == expected, (plan, d, theirs[str(d)])
