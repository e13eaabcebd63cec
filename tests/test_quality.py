"""The quality harness (`sparse_fx.harness`) on SmolLM2, reduced: fails on a clear quality regression.

Two runs at context 512 (sink 32 + local 32, 2 held-out windows x 32 teacher-forced steps, 2
passkey trials at 2 depths): every plan at sparsity 4, and oracle with a budget covering the
context, which must be dense to the token. About 3 minutes on 2 CPU cores.
"""

import copy
import importlib
import json
import sys
from pathlib import Path

import pytest

import sparse_fx
from sparse_fx import harness

pytestmark = pytest.mark.model

PLANS = ["dense", "oracle", "hash", "prism-g4", "static-g4"]
N = 512
# Floors on next-token agreement with dense at sparsity 4 (128 + 32 + 32 of 512 tokens), set well
# below what the run measured on 2026-11-29 (64 teacher-forced tokens): oracle 98.4%, hash 92.2%,
# prism-g4 98.4%, static-g4 95.3%; recall@32 0.995 / 0.802 / 0.985 / 0.844.
AGREEMENT_FLOOR = {"oracle": 0.90, "hash": 0.75, "prism-g4": 0.85, "static-g4": 0.80}
RECALL_FLOOR = {"oracle": 0.95, "hash": 0.65, "prism-g4": 0.90, "static-g4": 0.70}
BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_script(name: str):
    """A bench script as a module, imported as it imports its neighbours: with bench/ on sys.path."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    return importlib.import_module(name)


def settings(**overrides):
    base = dict(plans=PLANS, contexts=[N], sparsities=[4], sink=32, local=32, decode_tokens=32, windows=2,
                depths=[20, 80], passkey_trials=2, passkey_offset=4, answer_tokens=7, probe_passkey=True)
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
    """oracle at sparsity 1 (budget = n) must pick every token: dense to the token and the nat."""
    model, tok = smollm2
    s = settings(plans=["oracle"], sparsities=[1], windows=1, depths=[50], passkey_trials=1)
    results = harness.run(copy.deepcopy(model), tok, s, progress=False)
    (row,) = results["rows"]
    assert row["teacher"]["agreement"] == 1.0
    assert abs(row["teacher"]["ce_delta"]) < 1e-4
    assert row["probes"]["recall"]["mean"] == 1.0 and row["probes"]["recall"]["min_layer"] == 1.0
    assert row["probes"]["output_error"]["mean"] < 1e-4
    assert row["explain"]["sparse_layers"] == 30


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


@pytest.mark.parametrize("plan", ["oracle", "hash"])
def test_one_pass_teacher_forcing_equals_the_harness(smollm2, reduced, plan):
    """bench/teacher_agreement.py scores many tokens in one masked forward pass instead of decoding them:
    on the harness's windows and tokens it must give the harness's agreement and CE delta."""
    rows, _, _ = reduced
    agreement = bench_script("teacher_agreement")
    model, tok = smollm2
    s = settings()
    plans = {plan: sparse_fx.Plan.parse(plan, sink=s.sink, local=s.local)}
    ours = agreement.evaluate(model, tok, plans, N, 4, windows=s.windows, span=s.decode_tokens, seed=s.seed)["plans"][plan]
    theirs = rows[(plan, 4)]["teacher"]
    assert sum(ours["per_window"]["agreement"]) / s.windows == pytest.approx(theirs["agreement"], abs=1e-9)
    assert ours["ce_delta"]["mean"] == pytest.approx(theirs["ce_delta"], abs=2e-3)
