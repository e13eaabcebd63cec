"""One rank of the tensor-parallel test (tests/generate/test_tensor_parallel.py runs it under
`torch.distributed.run --standalone --nproc-per-node 2` on CPU with gloo).

Every rank loads the same tiny fp32 Llama twice, sharded by Hugging Face (`tp_plan="auto"`) and
whole, and checks per plan: with a budget that covers the context the sharded sparse model decodes
the sharded dense model's tokens; with a small budget it decodes the unsharded sparse model's
tokens (selection is per KV head and rank-local, so only the all-reduce order differs); side caches
hold this rank's heads only; one decode graph serves every step; encoders trained for the whole
model load on the shard. Facts go to OUT/rank<r>.json for the test to read.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.distributed import DistributedConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support module
import sparse_fx  # noqa: E402
from support import options_for  # noqa: E402
from sparse_fx.api import sparse_state  # noqa: E402
from sparse_fx.model_info import ModelInfo  # noqa: E402
from sparse_fx.runtime.caches import Shard  # noqa: E402
from sparse_fx.runtime.encoders import HeadMLP, LayerEncoders, SignatureEncoders  # noqa: E402

PLANS = ("oracle", "hash", "prism-g2", "prism-g2-hash", "static-g2")
SMALL = dict(budget=6, sink=2, local=3, rho=2.0, int2_group=8, backend="eager", min_context=0)
COVERING = dict(budget=128, sink=2, local=3, rho=2.0, int2_group=8, backend="eager", min_context=0)


def load(ckpt, sharded):
    extra = dict(distributed_config=DistributedConfig(tp_plan="auto")) if sharded else {}
    return LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa", **extra).eval()


def generate(model, ids):
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation="static",
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits)


def trained_encoders(model) -> SignatureEncoders:
    """Random 'trained' encoders for the whole (unsharded) model: two layers a side, with biases."""
    info, g = ModelInfo.of(model), torch.Generator().manual_seed(7)

    def mlp(heads):
        return HeadMLP([torch.randn(heads, info.head_dim, 32, generator=g), torch.randn(heads, 32, 32, generator=g)],
                       [torch.randn(heads, 32, generator=g), torch.randn(heads, 32, generator=g)])

    layers = [LayerEncoders(query=mlp(info.q_heads), key=mlp(info.kv_heads)) for _ in range(info.num_layers)]
    return SignatureEncoders(layers, bits=32, fingerprint=info.fingerprint(model),
                             metadata={"train_config": {"key_sharing": "kv"}})


def main(ckpt: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if rank == 0:
        LlamaForCausalLM(LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16, tie_word_embeddings=False, initializer_range=0.2,
            bos_token_id=1, eos_token_id=None, pad_token_id=0)).save_pretrained(ckpt)
    dist.barrier()
    warnings.simplefilter("ignore")
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    whole = load(ckpt, sharded=False)
    dense_tokens, _ = generate(load(ckpt, sharded=True), ids)
    facts = {"rank": rank, "plans": {}}
    encoders = trained_encoders(whole)
    runs = [(p, {}) for p in PLANS] + [(p, {"encoders": encoders}) for p in ("hash", "prism-g2-hash")]
    for plan, extra in runs:
        name = plan + (" (trained)" if extra else "")
        model = sparse_fx.compile(load(ckpt, sharded=True), plan, **options_for(plan, **COVERING), **extra)
        assert model._tp_size == 2 and ModelInfo.of(model).shard == Shard(rank, 2)
        try:
            sparse_fx.explain(model)  # before any decode it would trace one: a collective only this rank runs
            raise AssertionError("explain() before a decode step under tensor parallelism must refuse")
        except ValueError as e:
            assert "after a decode step" in str(e)
        covered, _ = generate(model, ids)
        assert torch.equal(covered, dense_tokens), f"{name}: a covering budget decodes other tokens than dense"

        model = sparse_fx.compile(load(ckpt, sharded=True), plan, **options_for(plan, **SMALL), **extra)
        tokens, logits = generate(model, ids)
        want_tokens, want_logits = generate(sparse_fx.compile(load(ckpt, sharded=False), plan, **options_for(plan, **SMALL), **extra), ids)
        assert torch.equal(tokens, want_tokens), f"{name}: sharded {tokens.tolist()} vs unsharded {want_tokens.tolist()}"
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        state, report = sparse_state(model), sparse_fx.explain(model)
        sides = [t for i in range(2) for t in state.side_caches.of_layer(i)]
        assert report.shard == Shard(rank, 2) and any(f"rank {rank} of 2" in n for n in report.notes), report.notes
        facts["plans"][name] = {
            "tokens": tokens.tolist(), "dense_tokens": dense_tokens.tolist(),
            "side_cache_heads": sorted({t.shape[1] for t in sides}),
            "decode_graphs": sum(r.decode for r in state.reports),
            "sparse_layers": report.sparse_layers, "explain": str(report).splitlines()[:6],
        }
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(facts, f)
    dist.barrier()  # tear down together: gloo aborts a rank whose peer has already left
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
