"""Where one end-to-end decode step's time goes: device time per kernel (torch.profiler) of the
compiled step of a Llama-3.1-8B-shaped model (random bf16 weights, random filled cache), beside
the step's wall time, whether CUDA graphs were skipped, and the host's side: the time to issue a
step without waiting for the GPU and, by cProfile, where that time goes. The gap between the kernel table of `kernel_step.py` and the end-to-end
step of `decode_speed.py` is the glue this shows: every kernel the compiled graph runs, not only
ours.

    python bench/profile_step.py --layers 4 --context 131072 --batch 4 --methods dense-gqa,hash,prism-g4
Writes <out>/profile-step-<date>.json and prints a table per method.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch

import sparse_fx

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]
from benchlib.llama import build_model, random_static_cache, sdpa_gqa_attention, time_decode


def profile_method(model, original_forward, method: str, args) -> dict:
    from torch._dynamo.utils import counters

    counters.clear()
    cache = random_static_cache(model, args.batch, args.context, 6 * args.steps + 16)  # room for every step run here
    model.forward = original_forward
    model.config._attn_implementation = "sdpa_gqa" if method == "dense-gqa" else "sdpa"
    try:
        if method == "dense-gqa":
            forward = torch.compile(original_forward, mode="reduce-overhead", fullgraph=True)
        else:
            sparse_fx.compile(model, method, budget=args.budget, sink=args.sink, local=args.local, min_context=0)
            sparse_fx.attach_cache(model, cache)
            forward = model.forward
        timed = time_decode(forward, cache, args.batch, args.steps, 3)
        step, first = timed.step, timed.first
        ids = torch.randint(0, model.config.vocab_size, (args.batch, 1), device="cuda")
        with torch.no_grad():
            kernels = benchlib.kernel_times(lambda: forward(ids, past_key_values=cache, use_cache=True), reps=args.steps)
        host_ms, host_top = host_time(lambda: forward(ids, past_key_values=cache, use_cache=True), args.steps, args.top)
    finally:
        model.forward = original_forward
        cache = None
        torch.cuda.empty_cache()
    layers = model.config.num_hidden_layers
    table = sorted(({"kernel": k, "us_per_step": us, "launches_per_step": n, "us_per_layer": us / layers}
                    for k, (us, n) in kernels.items()), key=lambda r: -r["us_per_step"])
    return {"method": method, "step_ms": step * 1e3, "compile_s": first - step,
            "kernel_ms": sum(r["us_per_step"] for r in table) / 1e3,
            "launches": sum(r["launches_per_step"] for r in table),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"], "host_ms": host_ms, "host_top": host_top,
            "kernels": table}


def host_time(fn, steps: int, top: int) -> tuple[float, list[dict]]:
    """Milliseconds the host takes to issue one step (no wait for the GPU between steps), and the
    functions that take it (cProfile's own time, which inflates Python but ranks it)."""
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        host_ms = (time.perf_counter() - t0) / steps * 1e3
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive calls, own s, cumulative s, callers)}
    rows = sorted(((f"{name} ({file.rsplit('/', 2)[-2:][-1]}:{line})", v[0] / steps, v[2] / steps * 1e3)
                   for (file, line, name), v in stats.items()), key=lambda r: -r[2])
    return host_ms, [{"function": f, "calls_per_step": c, "own_ms_per_step": ms} for f, c, ms in rows[:top]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--methods", default="dense-gqa,hash,prism-g4")
    p.add_argument("--steps", type=int, default=8, help="steps timed and profiled")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--local", type=int, default=128)
    p.add_argument("--top", type=int, default=16, help="kernels printed per method")
    benchlib.add_out(p)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/profile_step.py needs a CUDA GPU")
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa_gqa", sdpa_gqa_attention)
    model = build_model(args.layers)
    original_forward = model.forward
    meta = benchlib.header(args)
    rows = []
    for method in args.methods.split(","):
        rows.append(profile_method(model, original_forward, method, args))
        benchlib.save(args.out, f"profile-step-{meta['date'][:10]}", {"meta": meta, "rows": rows})
        r = rows[-1]
        print(f"\n{method}: step {r['step_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms, {r['launches']} launches, "
              f"{r['cudagraph_skips']} CUDA-graph skips, "
              f"compile {r['compile_s']:.0f} s ({args.layers} layers, {args.context} x {args.batch})")
        for k in r["kernels"][: args.top]:
            print(f"  {k['us_per_step']:9.1f} us {k['launches_per_step']:4d}x  {k['kernel']}")
        print(f"  host: {r['host_ms']:.3f} ms to issue a step; own time under cProfile:")
        for h in r["host_top"]:
            print(f"  {h['own_ms_per_step']:9.3f} ms {h['calls_per_step']:6.1f}x  {h['function']}")
        print(json.dumps({k: v for k, v in r.items() if k not in ("kernels", "host_top")}), flush=True)


if __name__ == "__main__":
    main()
