"""The method registry: each method's layer roles and side cache, and a new method in one file
(this one) that compiles, runs and appears in explain() without touching the package."""

from dataclasses import dataclass

import pytest
import torch
from transformers import StaticCache

import sparse_fx
from support import tiny_model
from sparse_fx import Plan, methods
from sparse_fx.methods import Method, Options, Selection
from sparse_fx.api import sparse_state
from sparse_fx.runtime.caches import KVShape


def roles(plan: str, n: int, dense=(), **options) -> list[str]:
    p = Plan.parse(plan, **options)
    return methods.get(p.method).roles(p, n, set(dense))


def test_layer_roles_of_each_method():
    assert roles("dense", 3) == ["dense"] * 3
    assert roles("oracle", 3, dense=[1]) == ["sparse", "dense", "sparse"]
    assert roles("hash", 3, dense=(0, 2)) == ["dense", "sparse", "dense"]
    assert roles("prism-g1", 3) == ["proposal"] * 3  # per-layer INT2 selection, no sharing
    assert roles("prism-g4", 6) == ["proposal", "refined", "refined", "refined", "proposal", "refined"]
    assert roles("static-g3", 5, dense=[0]) == ["dense", "proposal", "refined", "refined", "proposal"]  # groups of sparse layers
    calibrated = ("proposal", "refined", "dense", "proposal")
    # a dense proposal layer orphans its refined layers: the first of them proposes instead
    assert roles("prism-g2", 4, dense=[0], roles=calibrated) == ["dense", "proposal", "dense", "proposal"]
    assert roles("prism-g2", 4, dense=[3], roles=("proposal", "refined", "refined", "refined")) == [
        "proposal", "refined", "refined", "dense"]
    assert roles("prism-g2", 4, roles=calibrated) == list(calibrated)
    with pytest.raises(ValueError, match="roles for 4 layers but the model has 30"):
        roles("prism-g2", 30, roles=calibrated)
    assert methods.get("prism").for_search().roles(Plan.parse("prism-g2"), 3, {1}) == ["search", "dense", "search"]
    with pytest.raises(ValueError, match="no proposal layers to calibrate"):
        methods.get("hash").for_search()


def test_side_caches_by_role():
    kv = KVShape(1, 2, 64, 64, torch.device("cpu"))
    p = Plan.parse("prism-g4", int2_group=16)
    spec = methods.get("prism").side_cache("proposal", kv, p)
    assert {k: (s.tail, s.dtype) for k, s in spec.items()} == {
        "codes": ((4,), torch.int32), "params": ((8,), torch.float16)}
    assert methods.get("prism").side_cache("refined", kv, p) == {}
    # refined layers ranking the pool by INT2 keep INT2 copies; a search layer may do both
    int2refine = Plan.parse("prism-g4-hash-int2refine", int2_group=16)
    assert set(methods.get("prism").side_cache("refined", kv, int2refine)) == {"codes", "params"}
    assert set(methods.get("prism").side_cache("proposal", kv, int2refine)) == {"signatures"}
    assert set(methods.get("prism").side_cache("search", kv, int2refine)) == {"signatures", "codes", "params"}
    assert methods.get("static").side_cache("refined", kv, Plan.parse("static-g4")) == {}
    assert set(methods.get("hash").side_cache("sparse", kv, Plan.parse("hash-b64"))["signatures"].tail) == {2}
    assert methods.get("oracle").side_cache("sparse", kv, Plan.parse("oracle")) == {}


@dataclass(frozen=True)
class RecentOptions(Options):
    oldest: bool = False  # the oldest positions instead of the most recent


class Recent(Method):
    """A toy method: attend to the `budget` most recent (or oldest) positions beside sink and local;
    its option is its own, declared here."""

    name = "recent"
    description = "the most recent tokens (a test method)"
    options = RecentOptions

    def validate(self, plan):
        if not isinstance(plan.options.oldest, bool):
            raise ValueError(f"sparse_fx: oldest must be True or False, got {plan.options.oldest!r}")

    def select(self, emit, ctx, site):
        scores = emit.call(_positions_as_scores, site.k, ctx.plan.options.oldest)
        return Selection(self.topk(emit, ctx, site, scores, ctx.plan.budget), note=", most recent")


def _positions_as_scores(k: torch.Tensor, oldest: bool) -> torch.Tensor:
    scores = torch.arange(k.shape[2], device=k.device, dtype=torch.float32).expand(k.shape[0], k.shape[1], k.shape[2])
    return -scores if oldest else scores


@pytest.fixture
def recent():
    methods.register(Recent())
    yield
    methods._REGISTRY.pop("recent")


def _decode(model, ids, prefill=30):
    cache = StaticCache(config=model.config, max_cache_len=48)
    with torch.no_grad():
        model(ids[:, :prefill], past_key_values=cache)
        return [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(prefill, ids.shape[1])]


def test_a_new_method_is_one_file(recent):
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    model = sparse_fx.compile(tiny_model("llama", layers=2), "recent", backend="eager", budget=6, sink=2, local=3)
    report = sparse_fx.explain(model)
    assert report.sparse_layers == [0, 1] and "most recent" in str(report) and report.plan.name == "recent"
    small = _decode(model, ids)
    # the same 2 + 9 positions chosen another way: 1 recent beside a local window of 8
    same = _decode(sparse_fx.compile(tiny_model("llama", layers=2), "recent", backend="eager", budget=1, sink=2, local=8), ids)
    covering = _decode(sparse_fx.compile(tiny_model("llama", layers=2), "recent", backend="eager", budget=64, sink=2, local=3), ids)
    dense = _decode(tiny_model("llama", layers=2), ids)
    for a, b, c, d in zip(small, same, covering, dense):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(c, d)
    assert max((a - d).abs().max() for a, d in zip(small, dense)) > 1e-3, "11 of ~35 tokens must differ from dense"
    oldest = sparse_fx.compile(tiny_model("llama", layers=2), "recent", backend="eager", budget=6, sink=2, local=3,
                               oldest=True)
    assert sparse_state(oldest).plan.options == RecentOptions(oldest=True)
    assert max((a - b).abs().max() for a, b in zip(_decode(oldest, ids), small)) > 1e-3
    with pytest.raises(ValueError, match="oldest must be True or False, got 'yes'"):
        Plan.parse("recent", oldest="yes")
    with pytest.raises(ValueError, match=r"\['rho'\] for 'recent' \(rho: an option of prism, static\).*recent's own: oldest"):
        Plan.parse("recent", rho=2.0)
    assert "recent" in methods.plan_forms()
    with pytest.raises(ValueError, match="lowercase name"):
        methods.register(type("Bad", (Method,), {"name": "Bad Name"})())
