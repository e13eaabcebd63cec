"""Tensor parallelism (Hugging Face `tp_plan="auto"`): each rank holds a contiguous part of every
layer's heads, and serves exactly the encoders, side caches and selections of those heads."""

import pytest
import torch

from sparse_fx.runtime.caches import Shard
from sparse_fx.runtime.encoders import Encoders, HeadMLP, LayerEncoders, SignatureEncoders


def test_a_shard_is_a_contiguous_part_of_the_heads():
    assert [Shard(r, 4).part(8) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert Shard().part(8) == slice(0, 8) and Shard().describe(8) is None
    assert Shard(1, 2).describe(8) == "rank 1 of 2, KV heads 4-7"


@pytest.mark.parametrize("size", [2, 4])
def test_ranks_get_the_unsharded_models_random_projections_of_their_heads(size):
    q_heads, kv_heads, dim = 16, 8, 32
    whole = Encoders(bits=64, seed=3).layer(5, q_heads, kv_heads, dim, torch.device("cpu"))
    parts = [Encoders(bits=64, seed=3).layer(5, q_heads // size, kv_heads // size, dim, torch.device("cpu"), Shard(r, size))
             for r in range(size)]
    for side in ("query", "key"):
        joined = torch.cat([getattr(p, side).weights[0] for p in parts])
        assert torch.equal(joined, getattr(whole, side).weights[0]), side


def test_ranks_get_their_heads_of_trained_encoders():
    g = torch.Generator().manual_seed(0)

    def mlp(heads):
        return HeadMLP([torch.randn(heads, 16, 8, generator=g), torch.randn(heads, 8, 32, generator=g)],
                       [torch.randn(heads, 8, generator=g), None])

    trained = SignatureEncoders([LayerEncoders(query=mlp(8), key=mlp(4))], bits=32, fingerprint={}, metadata={})
    rank1 = Encoders(bits=32, seed=0, trained=trained).layer(0, 4, 2, 16, torch.device("cpu"), Shard(1, 2))
    assert torch.equal(rank1.query.weights[1], trained.layers[0].query.weights[1][4:8])
    assert torch.equal(rank1.query.biases[0], trained.layers[0].query.biases[0][4:8]) and rank1.query.biases[1] is None
    assert torch.equal(rank1.key.weights[0], trained.layers[0].key.weights[0][2:4])
    x = torch.randn(1, 2, 3, 16, generator=g)
    whole = trained.layers[0].key(torch.cat([torch.zeros_like(x), x], dim=1))
    torch.testing.assert_close(rank1.key(x), whole[:, 2:], rtol=0, atol=0)


def test_a_layer_run_whole_on_every_rank_gets_all_its_heads_encoders():
    """Tensor-parallel plans that gather a layer's attention output (`colwise_gather_output`) run
    all its heads on every rank: its encoders are the whole layer's, not a rank's share."""
    from sparse_fx import methods
    from sparse_fx.compiled import CompiledState
    from sparse_fx.model_info import ModelInfo
    from sparse_fx.plan import Plan
    from sparse_fx.runtime.caches import KVShape

    info = ModelInfo("llama", 1, q_heads=8, kv_heads=4, head_dim=16, shard=Shard(1, 2))
    state = CompiledState(plan=Plan.parse("hash"), info=info, method=methods.get("hash"), encoders=Encoders(32, 0))
    whole = Encoders(32, 0).layer(0, 8, 4, 16, torch.device("cpu"))
    cpu = torch.device("cpu")
    assert torch.equal(state.layer_encoders(0, KVShape(1, 4, 8, 16, cpu)).key.weights[0], whole.key.weights[0])
    assert torch.equal(state.layer_encoders(0, KVShape(1, 2, 8, 16, cpu)).key.weights[0], whole.key.weights[0][2:])
    with pytest.raises(ValueError, match="runs 3 of the model's 4 KV heads"):
        state.layer_encoders(0, KVShape(1, 3, 8, 16, cpu))


def test_sharded_decode_over_two_ranks(tmp_path):
    """Two CPU processes (gloo) run tests/generate/tp_worker.py: every plan decodes under tp_plan="auto", a
    covering budget gives the sharded dense tokens, a small one the unsharded model's sparse tokens,
    and each rank's side caches and report hold its own heads."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("tp_worker.py")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(worker), str(tmp_path / "ckpt"), str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, facts in enumerate(ranks):
        assert set(facts["plans"]) == {"oracle", "hash", "prism-g2", "prism-g2-hash", "static-g2", "hash (trained)",
                                       "prism-g2-hash (trained)"}
        for name, p in facts["plans"].items():
            assert p["sparse_layers"] == [0, 1] and p["decode_graphs"] == 1, (r, name, p)
            want = [] if name == "oracle" else [2]
            assert p["side_cache_heads"] == want, f"{name}: side caches of {p['side_cache_heads']} heads, this rank runs 2"
            assert any(f"rank {r} of 2, KV heads {2 * r}-{2 * r + 1}" in line for line in p["explain"]), p["explain"]
    for name in ranks[0]["plans"]:  # the ranks agree (the all-reduce gives every rank the whole logits)
        assert ranks[0]["plans"][name]["tokens"] == ranks[1]["plans"][name]["tokens"], name
    assert any(p["tokens"] != p["dense_tokens"] for p in ranks[0]["plans"].values()), "the small budget changed nothing"
