"""One decode graph serves every static-cache length: the length is symbolic in the graph, so a
prompt longer than any before costs no compile. Graphs are counted per length range; the symbolic
graph decodes what a graph compiled for each length decodes."""

import random

import pytest
import torch

import sparse_fx
import sparse_fx.forward
from transformers import StaticCache
from support import SMALL, generate, options_for, tiny_model
from sparse_fx.api import sparse_state


def _decode_graphs(model) -> list:
    return [r for r in sparse_state(model).reports if r.decode]


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("plan", ["hash", pytest.param("prism-g2", marks=pytest.mark.slow)])
def test_fifty_prompt_lengths_compile_one_decode_graph_per_range(plan):
    """Lengths 1..4000 (static caches of 256..4096 slots): one graph for caches the budget covers
    (dense, no side caches) and one for every longer cache; a second pass compiles nothing."""
    model = sparse_fx.compile(tiny_model("llama", layers=2, max_position_embeddings=8192), plan, backend="eager",
                              **options_for(plan, **SMALL))
    lengths = sorted(random.Random(0).sample(range(1, 4001), 50))  # growing: generate() reuses a longer cache
    sizes = {generate(model, _prompt(n, i), 2, return_dict_in_generate=True).past_key_values.layers[0].keys.shape[2]
             for i, n in enumerate(lengths)}
    assert len(sizes) > 10, f"the prompts should need many distinct cache lengths: {sorted(sizes)}"
    graphs = _decode_graphs(model)
    assert len(graphs) == 1, [(g.shape.max_len, [r.reason for r in g.rows]) for g in graphs]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, n in enumerate(lengths[::5]):  # fresh caches of lengths not seen before
            cache = StaticCache(config=model.config, max_cache_len=n + 7)
            with torch.no_grad():
                model.generate(_prompt(n, i), max_new_tokens=2, do_sample=False, past_key_values=cache)


def test_a_cache_the_budget_covers_and_a_longer_one_are_two_ranges():
    model = sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager", budget=300, sink=2, local=3)
    for n in (100, 200, 400, 900):  # caches of 256, 256, 512, 1024 slots: 256 <= 300 + 2 + 3 keeps dense
        generate(model, _prompt(n, n), 2)
    graphs = _decode_graphs(model)
    assert [bool(g.rows[0].short) for g in graphs] == [True, False]
    assert sparse_fx.explain(model).sparse_layers == [0, 1]


@pytest.mark.parametrize("plan", ["hash", pytest.param("prism-g2-int2refine", marks=pytest.mark.slow)])
def test_one_symbolic_inductor_graph_decodes_what_a_graph_per_length_decodes(plan, monkeypatch):
    """Through Inductor (on the CPU the ops' references, traced at a symbolic length; the Triton
    launchers at a symbolic length run on a GPU: test_gpu.py): three cache lengths, one graph,
    the tokens of graphs compiled for each length (the length fixed, as before)."""
    options = options_for(plan, **SMALL)
    one = sparse_fx.compile(tiny_model("llama", layers=2), plan, **options)
    prompts = [_prompt(n, n) for n in (300, 700, 1100)]
    got = [generate(one, ids, 6) for ids in prompts]
    assert len(_decode_graphs(one)) == 1
    monkeypatch.setattr(sparse_fx.forward, "symbolic_length", lambda cache, mask: None)
    for ids, tokens in zip(prompts, got):
        fixed = sparse_fx.compile(tiny_model("llama", layers=2), plan, backend="eager", **options)
        assert torch.equal(tokens, generate(fixed, ids, 6))


def test_a_model_that_builds_its_own_mask_is_not_guarded_on_the_length():
    """Called without a mask, the model sizes its mask by the cache layer (get_mask_sizes): the size
    must come from the keys, not from the layer's int max_cache_len (a guard: a recompile per length)."""
    model = sparse_fx.compile(tiny_model("llama", layers=2), "hash", backend="eager", **options_for("hash", **SMALL))
    for n in (300, 600, 1000):
        cache = StaticCache(config=model.config, max_cache_len=n)
        ids = _prompt(40, n)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            model(ids[:, -1:], past_key_values=cache)
    assert len(_decode_graphs(model)) == 1


def test_lossless_modes_draft_and_verify_graphs_serve_every_cache_length():
    """speculate=: the draft graph (one query) and the verify graph (gamma + 1 queries) are compiled
    once for growing prompt lengths too, and fresh caches of unseen lengths compile nothing."""
    model = sparse_fx.compile(tiny_model("llama", layers=2, max_position_embeddings=8192), "hash", backend="eager",
                              speculate=3, **options_for("hash", **SMALL))
    counts = []
    for i, n in enumerate((600, 1300, 2100, 3300)):  # caches of 768 .. 3584 slots, longer each time
        generate(model, _prompt(n, i), 5)
        counts.append(len(sparse_state(model).reports))
    assert sparse_fx.acceptance(model).rounds > 0 and counts == counts[:1] * 4, counts
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, n in enumerate((900, 2500)):
            cache = StaticCache(config=model.config, max_cache_len=n + 40)
            with torch.no_grad():
                model.generate(_prompt(n, i), max_new_tokens=5, do_sample=False, past_key_values=cache)
