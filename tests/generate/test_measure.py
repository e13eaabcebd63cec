"""attach_cache (decode sparse from a dense prefill) and the measurement probes."""

import copy

import pytest
import torch
from transformers import StaticCache

import sparse_fx
from support import options_for, tiny_model

OPTIONS = dict(budget=6, sink=2, local=3, int2_group=8, rho=2.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=4)


@pytest.mark.parametrize("plan", ["hash", "prism-g2", "static-g2", "oracle"])
def test_attach_cache_after_dense_prefill_equals_sparse_prefill(model, plan):
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    a = sparse_fx.compile(copy.deepcopy(model), plan, backend="eager", **options_for(plan, **OPTIONS))
    b = sparse_fx.compile(copy.deepcopy(model), plan, backend="eager", **options_for(plan, **OPTIONS))
    ca, cb = StaticCache(config=model.config, max_cache_len=48), StaticCache(config=model.config, max_cache_len=48)
    with torch.no_grad():
        a(ids[:, :30], past_key_values=ca)
        model(ids[:, :30], past_key_values=cb)  # the plain dense model fills cb
        sparse_fx.attach_cache(b, cb)
        for t in range(30, 40):
            torch.testing.assert_close(a(ids[:, t : t + 1], past_key_values=ca).logits,
                                       b(ids[:, t : t + 1], past_key_values=cb).logits)


def test_measurements_are_perfect_when_the_budget_covers_the_context(model):
    m = sparse_fx.compile(copy.deepcopy(model), "prism-g2", measure=True, budget=64, sink=2, local=3, int2_group=8)
    ids = torch.randint(1, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    cache = StaticCache(config=model.config, max_cache_len=80)  # budget + window cover 30 tokens, not the cache
    with torch.no_grad():
        m(ids[:, :20], past_key_values=cache)
        for t in range(20, 30):
            m(ids[:, t : t + 1], past_key_values=cache)
    s = sparse_fx.measurements(m).summary()
    assert s["recall"]["mean"] == 1.0 and s["pool_recall"]["mean"] == 1.0
    assert abs(s["mass"]["mean"] - 1.0) < 1e-6 and s["output_error"]["mean"] < 1e-5
    assert sorted(s["recall"]["per_layer"]) == [0, 1, 2, 3]
    assert s["kept"]["per_layer"] == {layer: 20.5 for layer in range(4)}  # every candidate: positions 2..now-3, now 20..29
    assert abs(s["kept"]["per_layer_std"][0] - torch.arange(16, 26.0).repeat_interleave(4).std()) < 1e-9  # over steps x heads
    assert sparse_fx.measurements(m).per_layer("recall")[0].shape == (10, 4)  # steps x query heads


def test_measurements_see_a_small_budget(model):
    m = sparse_fx.compile(copy.deepcopy(model), "oracle", measure=True, budget=2, sink=1, local=1)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = StaticCache(config=model.config, max_cache_len=48)
    with torch.no_grad():
        m(ids[:, :35], past_key_values=cache)
        m(ids[:, 35:36], past_key_values=cache)
    s = sparse_fx.measurements(m).summary()
    assert 0 < s["mass"]["mean"] < 0.9 and s["output_error"]["mean"] > 1e-3
    assert s["recall"]["mean"] <= 4 / 32 + 1e-9  # 4 slots cannot hold more of a top-32
    assert s["kept"]["mean"] == 2 and s["kept"]["std_over_layers"] == 0  # the window is not counted


def test_measure_needs_the_eager_backend(model):
    with pytest.raises(ValueError, match="backend='eager'"):
        sparse_fx.compile(copy.deepcopy(model), "hash", measure=True, backend="inductor")
    with pytest.raises(ValueError, match="measure=True"):
        sparse_fx.measurements(sparse_fx.compile(copy.deepcopy(model), "hash"))
