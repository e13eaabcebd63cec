"""Run by tests/generate/test_gpu.py in a process of its own: prefill times (ms) of an 8K-token prompt on a
4-layer toy Llama, dense and under `hash` and `prism-g4`, medians of 7 interleaved runs, as JSON.

A process of its own because the toy's prefill is host-bound (13 ms of CPU for 4 ms of GPU work)
and a test process that has compiled and replayed decode graphs runs every eager op slower: on the
H200 (2026-12-02) dense went 5.7 -> 7.1 ms and hash 6.5 -> 9.0 ms after one compiled generate().
Interleaved, so that clocks and host load move all three alike."""

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import StaticCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support module
import sparse_fx  # noqa: E402
from support import tiny_model  # noqa: E402
from sparse_fx.api import sparse_state  # noqa: E402


def main() -> None:
    base = tiny_model("llama", layers=4, heads=16, kv_heads=4, hidden_size=1024, head_dim=64, intermediate_size=2048,
                      vocab_size=256, max_position_embeddings=9000).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (1, 8192), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    # min_context 0: the 8K cache is below where the plans pay; the prefill must still fill the side caches
    models = {"dense": base, **{p: sparse_fx.compile(copy.deepcopy(base), p, min_context=0) for p in ("hash", "prism-g4")}}
    times = {name: [] for name in models}
    for _ in range(8):  # the first round warms up
        for name, model in models.items():
            cache = StaticCache(config=model.config, max_cache_len=8200)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                model(ids, past_key_values=cache)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3)
    print(json.dumps({"ms": {n: statistics.median(t[1:]) for n, t in times.items()}, "layers": base.config.num_hidden_layers,
                      "compiled_graphs": {n: len(sparse_state(m).reports) for n, m in models.items() if n != "dense"}}))


if __name__ == "__main__":
    main()
