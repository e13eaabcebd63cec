"""Every decoder family: each SDPA is rewritten for decode, or explain says why not."""

import pytest
import torch
from transformers import StaticCache

import sparse_fx
from support import FAMILIES, tiny_model

SLIDING = "sliding-window layer (already local attention)"
CHUNKED = "chunked local attention (each token attends within its chunk only)"
LATENT = ("the keys are recomputed from the KV cache every step, not stored in it (multi-head latent attention "
          "caches compressed latents): there are no stored keys to select among")
# family -> {layer: why it stays dense} where some layer does
DENSE = {"mistral-sliding": {0: SLIDING, 1: SLIDING}, "gemma2": {0: SLIDING},
         "gemma3": {0: SLIDING, 1: SLIDING},  # five local layers to each global one
         "llama4": {0: CHUNKED}, "deepseek_v3": {0: LATENT, 1: LATENT}}


def decode_logits(model, ids, prefill):
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 64)  # longer than any budget: never covered
    with torch.no_grad():
        model(ids[:, :prefill], past_key_values=cache)
        return [model(ids[:, t : t + 1], past_key_values=cache).logits for t in range(prefill, ids.shape[1])]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_rewrites_every_global_attention_and_matches_dense(family):
    model = tiny_model(family, layers=2)
    ids = torch.randint(1, 128, (2, 28), generator=torch.Generator().manual_seed(0))
    dense = decode_logits(model, ids, 24)
    sparse_fx.compile(model, "hash", backend="eager", budget=64, sink=2, local=4)
    sparse = decode_logits(model, ids, 24)
    for a, b in zip(dense, sparse):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    report = sparse_fx.explain(model)
    assert len(report) == 2, str(report)
    assert {r.layer: r.reason for r in report if r.action != "sparse"} == DENSE.get(family, {}), str(report)


@pytest.mark.parametrize("plan", ["hash", "prism-g4", "oracle"])
def test_latent_attention_stays_dense_with_its_reason_under_every_plan(plan):
    """No error speaking of ranks or of a head dim the model does not have; strict names the reason."""
    model = tiny_model("deepseek_v3", layers=2)
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(1))
    dense = decode_logits(model, ids, 16)
    sparse_fx.compile(model, plan, backend="eager", budget=4, sink=2, local=2, min_context=0)
    for a, b in zip(dense, decode_logits(model, ids, 16)):
        torch.testing.assert_close(a, b)
    assert [r.reason for r in sparse_fx.explain(model)] == [LATENT, LATENT]
    sparse_fx.compile(model, plan, backend="eager", budget=4, sink=2, local=2, min_context=0, strict=True)
    with pytest.raises(Exception, match="multi-head latent attention"):
        decode_logits(model, ids, 16)


def test_prism_groups_start_at_the_first_global_layer_whatever_the_local_ones_around_it():
    model = tiny_model("llama4", layers=4, num_hidden_layers=4)
    ids = torch.randint(1, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    sparse_fx.compile(model, "prism-g4", backend="eager", budget=4, sink=2, local=2, int2_group=8, min_context=0,
                      strict=True)  # local layers are no strict miss
    decode_logits(model, ids, 16)
    report = sparse_fx.explain(model)
    assert [(r.role, r.action, r.reason) for r in report] == [
        ("dense", "dense", CHUNKED), ("proposal", "sparse", ""), ("dense", "dense", CHUNKED), ("refined", "sparse", "")]
