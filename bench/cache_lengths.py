#!/usr/bin/env python
"""What a never-seen static-cache length costs: one compiled decode graph serves every length (the
length is symbolic), so a new length is a CUDA-graph recording, not a compile.

On the Llama-3.1-8B shape (random bf16 weights, `--layers` of them), per plan: compile once at the
first length, then decode on caches of each further length in turn. Per length: the first decode
call's wall time (the compile at the first length; afterwards a recording, or a recompile where the
graph was specialised), the decode step (median of --repeat windows of --steps steps, CUDA-graph
replays), the graphs compiled so far, and the GPU memory the process holds once that length's cache
is freed, beyond what it held before the plan's first graph: the recordings' share (CUDA graph trees
record every length into one memory pool, so this should grow by each graph's own structures, not by
a step's intermediates per length). `--static` runs the same with the length fixed in the
graph (the behaviour before: every new length compiles), for the A/B of the step time.

    python bench/cache_lengths.py --plans dense hash prism-g4 --lengths 32768,40960,65536,98304,131072 --batch 1
    python bench/cache_lengths.py --plans hash --static
Writes <out>/cache-lengths.json and .md.
"""

from __future__ import annotations

import argparse
import time

import torch

import sparse_fx
import sparse_fx.forward

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]
from benchlib.llama import build_model, random_static_cache, time_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", nargs="+", default=["dense", "hash", "prism-g4"])
    ap.add_argument("--lengths", default="32768,40960,65536,98304,131072", help="contexts, in the order decoded")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--static", action="store_true", help="the length fixed in each graph (a compile per length)")
    benchlib.add_out(ap)
    a = ap.parse_args()
    if a.static:
        sparse_fx.forward.symbolic_length = lambda cache, mask: None
    model = build_model(a.layers)
    original = model.forward
    rows = []
    for plan in a.plans:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()  # what the process holds before this plan's first graph
        model.forward = original
        sparse_fx.compile(model, plan, mode="reduce-overhead", budget=a.budget, min_context=0)
        state = sparse_fx.api.sparse_state(model)
        for n in (int(x) for x in a.lengths.split(",")):
            cache = random_static_cache(model, a.batch, n, sparse_fx.forward.cache_bucket(n + 256) - n)
            sparse_fx.attach_cache(model, cache)
            t0 = time.perf_counter()
            timed = time_decode(model, cache, a.batch, a.steps, 3, windows=a.repeat)
            row = dict(plan=plan, context=n, cache_len=cache.layers[0].keys.shape[2], batch=a.batch,
                       first_call_s=timed.first, step_ms=timed.step * 1e3, steps_ms=[s * 1e3 for s in timed.windows],
                       graphs=sum(1 for r in state.reports if r.decode),
                       sparse_layers=len(sparse_fx.explain(model).sparse_layers), wall_s=time.perf_counter() - t0)
            rows.append(row)
            cache = None
            torch.cuda.empty_cache()
            row["held_gib"] = (torch.cuda.memory_reserved() - before) / 2**30
            print(row, flush=True)
        sparse_fx.api.restore(model)
        torch._dynamo.reset()
    report = {"meta": benchlib.header(a), "rows": rows}
    benchlib.save(a.out, "cache-lengths", report, markdown=markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# A new static-cache length ({meta['gpu']}, {meta['args']['layers']} layers of the 8B shape, batch "
             f"{meta['args']['batch']}{', length fixed in each graph' if meta['args']['static'] else ''})", "",
             f"`{meta['command']}` ({meta['date']})", "",
             "| plan | context | cache length | first decode call s | step ms | graphs so far | sparse layers | held GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['plan']} | {r['context']} | {r['cache_len']} | {r['first_call_s']:.2f} | {r['step_ms']:.3f} | "
                     f"{r['graphs']} | {r['sparse_layers']} | {r.get('held_gib', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
