"""Short caches keep dense attention (the plan's `min_context`): a decode graph whose static cache
is shorter runs exactly the dense model, keeps no side caches, says why, and the same model still
runs sparse on a longer cache. "auto" takes the measured points on CUDA only."""

import copy
import json
import warnings

import pytest
import torch

import sparse_fx
from support import COVER, ROOT, SMALL, ToyDecoder, generate, options_for, run, tiny_model
from sparse_fx import methods
from sparse_fx.api import sparse_state
from sparse_fx.runtime.caches import KVShape

RESULTS = ROOT / "bench" / "results"
GRID = RESULTS / "kernels-2026-12-04-1836.json"  # the measurements behind Method.break_even
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def logits_of(model, ids, n):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                             return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("plan", ["hash", "prism-g2", "prism-g2-int2refine"])
def test_a_cache_shorter_than_min_context_decodes_as_the_dense_model(plan):
    base = tiny_model("llama", layers=4)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    want_tokens, want_logits = logits_of(base, ids, 10)
    model = sparse_fx.compile(copy.deepcopy(base), plan, backend="eager", strict=True, min_context=1000, **options_for(plan, **SMALL))
    with pytest.warns(UserWarning, match=r"keeps dense attention: static cache of 256 tokens is shorter than 1000"):
        got_tokens, got_logits = logits_of(model, ids, 10)
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    state = sparse_state(model)
    assert state.side_caches.nbytes() == 0  # neither allocated nor written by the prefill's fill
    report = sparse_fx.explain(model)
    assert report.sparse_layers == [], str(report)
    assert all("shorter than 1000 (the plan's min_context)" in r.reason for r in report), str(report)
    assert any("min_context 1000" in note for note in report.notes)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        logits_of(model, ids, 3)
    assert not [w for w in again if "keeps dense attention" in str(w.message)]  # once per model


def test_short_caches_run_dense_and_long_ones_sparse_in_one_model():
    """min_context 512: a 256-slot cache decodes dense, then a 768-slot one sparse, with the same
    tokens as a model that was never dense; side caches exist for the long shape only."""
    base = tiny_model("llama", layers=4)
    g = torch.Generator().manual_seed(6)
    short, long = torch.randint(1, 128, (1, 30), generator=g), torch.randint(1, 128, (1, 600), generator=g)
    model = sparse_fx.compile(copy.deepcopy(base), "prism-g2", backend="eager", min_context=512, **SMALL)
    always = sparse_fx.compile(copy.deepcopy(base), "prism-g2", backend="eager", min_context=0, **SMALL)
    with pytest.warns(UserWarning, match="keeps dense attention"):
        assert torch.equal(generate(model, short, 6), generate(base, short, 6))
    assert torch.equal(generate(model, long, 6), generate(always, long, 6))
    reports = [r for r in sparse_state(model).reports if r.decode]
    by_length = {r.shape.max_len: {row.action for row in r.rows} for r in reports}
    assert by_length == {256: {"dense"}, 768: {"sparse"}}, by_length
    assert {kv.max_len for _, kv in sparse_state(model).side_caches.tensors} == {768}
    assert sparse_fx.explain(model).sparse_layers == [0, 1, 2, 3]


def test_a_compiled_prefill_on_a_short_cache_writes_no_side_cache():
    """A model whose prefill is compiled too (the toy): the short graphs stay dense, write nothing,
    and do not mark layers as unfilled for longer caches."""
    dense = ToyDecoder()
    sparse = sparse_fx.compile(copy.deepcopy(dense), "hash", backend="eager", min_context=65, **COVER)
    for a, b in zip(run(dense), run(sparse)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    state = sparse_state(sparse)
    assert state.side_caches.nbytes() == 0 and not state.unfilled
    assert all(r.short for rep in state.reports for r in rep.rows), [r.reason for rep in state.reports for r in rep.rows]
    covering = sparse_fx.compile(copy.deepcopy(dense), "hash", backend="eager", min_context=64, **COVER)
    run(covering)
    assert sparse_fx.explain(covering).sparse_layers == [0, 1, 2]


def test_explain_before_a_decode_shows_the_layers_a_long_cache_runs_sparse():
    model = sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager", min_context=10**6, **options_for("hash", **SMALL))
    report = sparse_fx.explain(model)
    assert report.traced and report.sparse_layers == [0, 1], str(report)
    assert any("min_context 1000000" in note for note in report.notes)


def kv(batch, kv_heads, length, device=CUDA):
    return KVShape(batch, kv_heads, length, 128, device)


@pytest.mark.parametrize("plan, batch, heads, length, dense", [
    ("hash", 1, 8, 16384, True), ("hash", 1, 8, 32768, False),
    ("hash", 4, 8, 16384, False), ("hash", 2, 8, 16384, True),  # 16 rows take batch 1's point
    ("hash", 1, 4, 32768, False), ("hash", 1, 4, 16384, True),  # fewer rows than measured: the fewest's
    ("hash", 32, 8, 8192, False), ("hash", 16, 8, 4096, True),
    ("prism-g4", 1, 8, 32768, True), ("prism-g4", 1, 8, 65536, False), ("prism-g4", 16, 8, 16384, True),
    ("prism-g4-int2refine", 16, 8, 16384, False), ("prism-g4-int2refine", 1, 8, 32768, True),
    ("prism-g4-hash", 4, 8, 32768, False), ("static-g4", 4, 8, 16384, True),
    ("oracle", 1, 8, 2048, False),  # the quality ceiling has no speed rule
])
def test_auto_on_cuda_follows_the_measured_points_by_kv_rows(plan, batch, heads, length, dense):
    state = sparse_state(sparse_fx.compile(tiny_model("llama", layers=2), plan, backend="eager", **options_for(plan, int2_group=8)))
    reason = state.short(kv(batch, heads, length))
    assert bool(reason) == dense, reason
    if dense:
        assert f"static cache of {length} tokens" in reason and "min_context=0 forces sparse" in reason
    assert state.short(kv(batch, heads, length, CPU)) is None  # measured on an H200: inert elsewhere


def test_an_explicit_min_context_holds_on_any_device():
    state = sparse_state(sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager", min_context=0, **options_for("hash", **SMALL)))
    assert state.short(kv(1, 8, 256)) is None
    state = sparse_state(sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager", min_context=300,
                                           **options_for("hash", **SMALL)))
    assert state.short(kv(1, 8, 299, CPU)) and state.short(kv(1, 8, 300, CPU)) is None


@pytest.mark.parametrize("plan", ["hash", "prism-g4", "prism-g4-int2refine"])
def test_the_auto_points_are_the_committed_measurements(plan):
    """Method.break_even is what the committed grid says (bench/kernel_step.py prints the same)."""
    grid = json.loads(GRID.read_text())
    cfg = grid["config"]
    assert (cfg["kv_heads"], cfg["head_dim"], cfg["budget"], cfg["sink"], cfg["local"]) == (8, 128, 4096, 128, 128)
    full = [r for r in grid["rows"] if r["filled"] == r["context"]]
    speedups = {b * cfg["kv_heads"]: {r["context"]: r[plan]["speedup"] for r in full if r["batch"] == b}
                for b in {r["batch"] for r in full}}
    p = sparse_fx.Plan.parse(plan)
    assert methods.get(p.method).break_even(p) == methods.break_even_points(speedups)
