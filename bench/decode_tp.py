"""Tensor-parallel decode speed: dense against each plan on a model Hugging Face shards by heads
(`distributed_config=DistributedConfig(tp_plan="auto")`), one process per GPU under torchrun.

Rank 0 saves a random bf16 checkpoint of the chosen shape (Llama-3.1-8B or -70B, `--layers` of
them), every rank loads it sharded, fills its share of a static cache with random keys and values
(decode speed does not depend on their values) and times single-token steps: dense compiled with
CUDA graphs, then each plan. All ranks run the same sequence; rank 0 writes the results.

    torchrun --standalone --nproc-per-node 2 bench/decode_tp.py --shape 8b --shapes 131072x1,131072x4
    torchrun --standalone --nproc-per-node 2 bench/decode_tp.py --shape 70b --layers 16 --shapes 131072x1
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/decode_tp.py --smoke   # CPU, gloo, tiny
Writes <out>/decode-tp-<date>.json (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import sparse_fx

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]
from benchlib.llama import LLAMA_8B, TINY, random_static_cache

SHAPES = {
    "8b": LLAMA_8B,
    "70b": {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8},
    "tiny": TINY,
}


def save_random_checkpoint(shape: str, layers: int, path: str, device: torch.device) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**SHAPES[shape], "num_hidden_layers": layers})
    with torch.device(device):
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def step_ms(forward, cache, batch: int, n: int, steps: int, device: torch.device) -> tuple[float, float]:
    """(median ms of the timed steps, seconds of the first call) at cache position n."""
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    pos = torch.tensor([n], device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    with torch.no_grad():
        for i in range(steps + 3):
            sync()
            t0 = time.perf_counter()
            forward(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e3, times[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--shapes", default="131072x1,131072x4", help="CONTEXTxBATCH,...")
    p.add_argument("--methods", default="dense,hash,prism-g4")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, the tiny shape, eager backend: checks it runs")
    benchlib.add_out(p)
    args = p.parse_args()
    if args.smoke:
        args.shape, args.layers, args.shapes, args.steps, args.budget = "tiny", 2, "256x2", 2, 16
    cuda = torch.cuda.is_available() and not args.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    meta = benchlib.header(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = [os.path.join(tmp, "ckpt")]
        dist.broadcast_object_list(ckpt)  # rank 0's folder: the ranks share a machine
        if rank == 0:
            save_random_checkpoint(args.shape, args.layers, ckpt[0], device)
        dist.barrier()
        model = LlamaForCausalLM.from_pretrained(ckpt[0], dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 distributed_config=DistributedConfig(tp_plan="auto")).eval()
        dist.barrier()  # every rank has read the checkpoint before rank 0's folder goes
    original = model.forward
    for shape in args.shapes.split(","):
        n, batch = (int(x) for x in shape.split("x"))
        for method in args.methods.split(","):
            model.forward = original
            cache = random_static_cache(model, batch, n, 64, device)
            if method == "dense":
                forward = torch.compile(original, mode="reduce-overhead", fullgraph=True) if cuda else original
            else:
                sparse_fx.compile(model, method, budget=args.budget, sink=128 if cuda else 2, local=128 if cuda else 2,
                                  backend=None if cuda else "eager")
                sparse_fx.attach_cache(model, cache)
                forward = model.forward
            ms, first = step_ms(forward, cache, batch, n, args.steps, device)
            row = {"method": method, "context": n, "batch": batch, "world_size": world, "step_ms": ms,
                   "tokens_per_s": batch / ms * 1e3, "compile_s": first - ms / 1e3}
            if method != "dense":
                report = sparse_fx.explain(model)
                row["sparse_layers"], row["shard"] = len(report.sparse_layers), str(report.shard)
            rows.append(row)
            model.forward, cache = original, None
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        for r in rows:
            dense = next(d for d in rows if d["method"] == "dense" and (d["context"], d["batch"]) == (r["context"], r["batch"]))
            r["speedup_vs_dense_tp"] = dense["step_ms"] / r["step_ms"]
        if args.smoke:
            assert all(r.get("sparse_layers", args.layers) == args.layers for r in rows), rows
            print("smoke ok")
        else:
            benchlib.save(args.out, f"decode-tp-{meta['date'][:10]}", {"meta": meta, "rows": rows})
    dist.barrier()  # tear down together: gloo aborts a rank whose peer has already left
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
