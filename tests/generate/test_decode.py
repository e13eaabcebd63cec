"""Decode on Hugging Face models: prefill runs the model's own attention, decode steps the rewritten
graph; no recompiles between steps; side caches equal recomputation from the keys; Inductor."""

import pytest
import torch
from transformers import StaticCache

import sparse_fx
from support import assert_side_caches_match_the_keys, options_for, step_through, tiny_model
from sparse_fx.api import sparse_state

PLAN_OPTIONS = dict(budget=6, sink=2, local=3, rho=2.0, int2_group=8)






@pytest.mark.parametrize("plan", ["hash", "prism-g2", "prism-g2-hash", "prism-g2-hash-int2refine", "static-g2", "oracle"])
def test_twenty_decode_steps_no_recompile_and_side_caches_match_recomputation(plan):
    model = tiny_model("llama", layers=4)
    sparse_fx.compile(model, plan, backend="eager", **options_for(plan, **PLAN_OPTIONS))
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    cache = StaticCache(config=model.config, max_cache_len=48)
    step_through(model, ids, 20, cache)
    state = sparse_state(model)
    assert [r.decode for r in state.reports] == [True], "one decode graph; prefill is not compiled"
    assert_side_caches_match_the_keys(model, cache, 40)


def test_prism_g1_with_signature_proposals_is_hash():
    """Every layer proposes (g1), so each keeps the best budget of its best pool by the same
    Hamming scores and tie rule: exactly hash's selection, through the whole proposal path."""
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(5))
    out = {}
    for plan in ("hash", "prism-g1-hash"):
        model = sparse_fx.compile(tiny_model("llama", layers=3), plan, backend="eager", **options_for(plan, **PLAN_OPTIONS))
        out[plan] = step_through(model, ids, 30, StaticCache(config=model.config, max_cache_len=48))
    for a, b in zip(out["hash"], out["prism-g1-hash"]):
        assert torch.equal(a, b)


def test_prefill_logits_are_the_dense_models():
    ids = torch.randint(1, 128, (2, 33), generator=torch.Generator().manual_seed(3))
    dense = tiny_model("llama", layers=3)
    with torch.no_grad():
        want = dense(ids, past_key_values=StaticCache(config=dense.config, max_cache_len=40)).logits
    for plan in ("oracle", "hash", "prism-g2", "prism-g2-hash", "static-g2"):
        model = sparse_fx.compile(tiny_model("llama", layers=3), plan, backend="eager", **options_for(plan, **PLAN_OPTIONS))
        with torch.no_grad():
            got = model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=40)).logits
        assert torch.equal(got, want), plan


def test_side_caches_keep_their_addresses_and_a_shorter_sequence_reads_nothing_stale():
    """A second, shorter sequence on the same cache decodes exactly as on a fresh model: slots
    the longer one left behind are never read, so nothing needs clearing."""
    gen = torch.Generator().manual_seed(3)
    long_ids, short_ids = torch.randint(1, 128, (1, 30), generator=gen), torch.randint(1, 128, (1, 12), generator=gen)
    model = sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager", **options_for("hash", **PLAN_OPTIONS))
    cache = StaticCache(config=model.config, max_cache_len=40)
    step_through(model, long_ids, 20, cache)
    ptrs = [t.data_ptr() for t in sparse_state(model).side_caches.of_layer(0)]
    cache.reset()
    reused = step_through(model, short_ids, 6, cache)
    assert [t.data_ptr() for t in sparse_state(model).side_caches.of_layer(0)] == ptrs
    fresh = sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager", **options_for("hash", **PLAN_OPTIONS))
    for a, b in zip(reused, step_through(fresh, short_ids, 6, StaticCache(config=fresh.config, max_cache_len=40))):
        assert torch.equal(a, b)


def test_two_caches_of_one_shape_each_decode_as_alone():
    """Side caches are shared by every cache of a shape: switching caches refills them."""
    gen = torch.Generator().manual_seed(4)
    a_ids, b_ids = torch.randint(1, 128, (1, 24), generator=gen), torch.randint(1, 128, (1, 24), generator=gen)
    model = sparse_fx.compile(tiny_model("llama", layers=2), "prism-g2", backend="eager", **PLAN_OPTIONS)
    ca, cb = (StaticCache(config=model.config, max_cache_len=32) for _ in range(2))
    out = {"a": [], "b": []}
    with torch.no_grad():
        model(a_ids[:, :16], past_key_values=ca)
        model(b_ids[:, :16], past_key_values=cb)
        for t in range(16, 24):  # interleaved decode steps
            out["a"].append(model(a_ids[:, t : t + 1], past_key_values=ca).logits)
            out["b"].append(model(b_ids[:, t : t + 1], past_key_values=cb).logits)
    for name, ids in (("a", a_ids), ("b", b_ids)):
        alone = sparse_fx.compile(tiny_model("llama", layers=2), "prism-g2", backend="eager", **PLAN_OPTIONS)
        want = step_through(alone, ids, 16, StaticCache(config=alone.config, max_cache_len=32))[1:]
        for x, y in zip(out[name], want):
            assert torch.equal(x, y)


def test_a_fresh_static_cache_is_allocated_outside_the_compiled_graph(monkeypatch):
    """Allocated inside the compiled step, the cache's tensors would not be static addresses,
    and CUDA graphs would skip or break on them (seen on an H200). Here the CUDA check is faked."""
    from sparse_fx.forward import initialise_static_cache

    model = tiny_model("llama", layers=2)
    info = sparse_state(sparse_fx.compile(model, "hash", backend="eager")).info
    cache = StaticCache(config=model.config, max_cache_len=32)
    ids = torch.randint(1, 128, (2, 1), generator=torch.Generator().manual_seed(4))
    initialise_static_cache(model, info, ids, cache)
    assert not cache.layers[0].is_initialized, "on CPU the cache stays lazy"
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    initialise_static_cache(model, info, ids, cache)
    monkeypatch.undo()
    for layer in cache.layers:
        for t in (layer.keys, layer.values, layer.cumulative_length):
            assert getattr(t, "_dynamo_static_input_type", None) is not None
        assert layer.keys.shape == (2, 2, 32, 16) and layer.keys.dtype == next(model.parameters()).dtype


@pytest.mark.parametrize("plan", ["oracle", "hash", "prism-g2", "prism-g2-hash", "static-g2"])
def test_generate_with_budget_covering_context_equals_dense(plan):
    model = tiny_model("qwen3", layers=4)
    ids = torch.randint(1, 128, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        dense = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
        sparse_fx.compile(model, plan, backend="eager", **options_for(plan, budget=64, sink=2, local=3, int2_group=8))
        sparse = model.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
    assert torch.equal(dense, sparse)
    assert len(sparse_fx.explain(model).sparse_layers) == 4


def test_hugging_face_does_not_compile_a_second_time():
    from transformers.generation.configuration_utils import CompileConfig

    model = tiny_model("llama", layers=2)
    sparse_fx.compile(model, "hash", backend="eager")
    model.generation_config.compile_config = CompileConfig()
    model.generation_config.compile_config._compile_all_devices = True  # would compile even on CPU
    cache = StaticCache(config=model.config, max_cache_len=16)
    assert not model._valid_auto_compile_criteria({"past_key_values": cache}, model.generation_config)
    with torch.no_grad():
        model.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=3, do_sample=False, past_key_values=cache)
    assert not hasattr(model, "_compiled_call")


def test_explain_before_any_call_traces_a_decode_step():
    model = tiny_model("mistral", layers=2)
    sparse_fx.compile(model, "prism-g2", int2_group=8)  # inductor: explain must not need it
    report = sparse_fx.explain(model)
    assert report.traced and report.sparse_layers == [0, 1] and sparse_state(model).reports == []
    text = str(report)
    assert "proposal" in text and "refined" in text and "prism-g2" in text


def test_soak_a_thousand_decode_steps():
    """1000 steps on one graph: no recompile, and the side caches still equal their recomputation."""
    model = sparse_fx.compile(tiny_model("llama", layers=2, max_position_embeddings=2048), "prism-g2",
                              backend="eager", budget=16, sink=4, local=8, rho=2.0, int2_group=8)
    ids = torch.randint(1, 128, (1, 1040), generator=torch.Generator().manual_seed(6))
    cache = StaticCache(config=model.config, max_cache_len=1056)
    step_through(model, ids, 40, cache)
    assert len(sparse_state(model).reports) == 1
    assert_side_caches_match_the_keys(model, cache, 1040)


def test_inductor_decode_matches_the_eager_graph_and_writes_exact_side_caches():
    """Compiled by Inductor (CPU): the INT2 codes and signatures the graph writes equal the
    reference's quantisation of the stored keys bit for bit, and the logits follow the eager graph."""
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(5))
    outs = {}
    for backend in ("eager", "inductor"):
        for plan in ("prism-g2", "hash"):
            model = sparse_fx.compile(tiny_model("llama", layers=2), plan, backend=backend, **options_for(plan, **PLAN_OPTIONS))
            cache = StaticCache(config=model.config, max_cache_len=32)
            outs[backend, plan] = step_through(model, ids, 16, cache)
            assert_side_caches_match_the_keys(model, cache, 24)
    for plan in ("prism-g2", "hash"):
        for a, b in zip(outs["eager", plan], outs["inductor", plan]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
