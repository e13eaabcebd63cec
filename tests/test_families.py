"""Every decoder family: each SDPA is rewritten for decode, or explain says why not."""

import pytest
import torch
from transformers import StaticCache

import sparse_fx
from families import FAMILIES, tiny_model

LOCAL_FAMILIES = {"mistral-sliding", "gemma2", "gemma3"}


def decode_logits(model, ids, prefill):
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 8)
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
    for row in report:
        if row.action != "sparse":
            assert family in LOCAL_FAMILIES and row.reason == "sliding-window layer (already local attention)", str(report)
    if family not in LOCAL_FAMILIES:
        assert report.sparse_layers == [0, 1]
