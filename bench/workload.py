#!/usr/bin/env python
"""A stream of requests through `model.generate`, timed whole: what a user's day pays, every
compile, prefill and decode step included.

On the Llama-3.1-8B shape (random bf16 weights, `--layers` of them, one GPU), for each method in
turn on a fresh model: --requests prompts of random tokens, their lengths drawn log-uniformly from
[--min-context, --max-context] (seeded: every method sees the same stream), each asking for one of
--new new tokens, at each --batches size (rows of one length), through
`generate(ids, cache_implementation="static", max_new_tokens=...)`. Methods:

- hf-static: Hugging Face's own static-cache generate(), which compiles its decode step on a GPU;
- dense-gqa: `sparse_fx.compile(model, "dense")` (compiled, CUDA graphs, SDPA reading KV heads);
- any plan (hash, prism-g4, ...): `sparse_fx.compile(model, plan, min_context=0)`.

Per request: wall seconds and whether a graph was compiled (Dynamo's frame count moved). Then, per
method but hf-static, generate()'s time per new token at the longest prompt, (t(N new) - t(1 new))
/ (N - 1) of warm calls, beside the tight loop's step on the same compiled forward and cache length
(`time_decode`: replays only): what generate() adds over the graph replay. On a GPU also with
transformers' `DeferredStopCheck` forced on (it reads the stop flag one step late instead of every
step; transformers enables it on `mps` only): whether that per-step read is what generate() adds.

    python bench/workload.py --methods hf-static,dense-gqa,hash,prism-g4 --requests 16 --batches 1,4
    python bench/workload.py --smoke   # CPU, a tiny Llama, the eager backend: checks it runs
Writes <out>/workload.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import statistics
import time

import torch

import sparse_fx
from sparse_fx.forward import cache_bucket
from torch._dynamo.utils import counters

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]
from benchlib.llama import TINY, build_model, random_static_cache, time_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="hf-static,dense-gqa,hash,prism-g4")
    ap.add_argument("--requests", type=int, default=16, help="requests per batch size")
    ap.add_argument("--min-context", type=int, default=8192)
    ap.add_argument("--max-context", type=int, default=131072)
    ap.add_argument("--new", default="256,2048", help="new tokens a request asks for, drawn uniformly")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--per-token-new", type=int, default=64, help="new tokens of the per-token comparison")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny shape, the eager backend, short prompts: checks it runs")
    benchlib.add_out(ap)
    a = ap.parse_args()
    if a.smoke:
        a.min_context, a.max_context, a.new, a.requests, a.per_token_new, a.repeat, a.budget = 100, 900, "4,8", 3, 4, 1, 32
    a.device = "cpu" if a.smoke else "cuda"
    model = build_model(TINY["num_hidden_layers"], device="cpu", **TINY) if a.smoke else build_model(a.layers)
    original = model.forward
    streams = {b: stream(a, b) for b in (int(x) for x in a.batches.split(","))}
    rows, per_token = [], []
    for method in a.methods.split(","):
        for batch, requests in streams.items():
            prepare(model, original, method, a)
            try:
                rows.append(run_stream(model, method, batch, requests, a.device))
                print(summary_line(rows[-1]), flush=True)
                if method != "hf-static":
                    per_token.append(generate_vs_loop(model, method, batch, max(n for n, _ in requests), a))
                    print(per_token[-1], flush=True)
            except torch.OutOfMemoryError:
                rows.append(dict(method=method, batch=batch, error="does not fit in GPU memory"))
            finally:
                reset(model, original)
    if a.smoke:
        assert all("error" not in r for r in rows) and len(per_token) == len(streams) * (len(a.methods.split(",")) - 1), rows
        print("smoke ok")
    report = {"meta": benchlib.header(a), "streams": {str(b): s for b, s in streams.items()}, "rows": rows,
              "per_token": per_token}
    benchlib.save(a.out, "workload", report, markdown=markdown(report))
    print(markdown(report))


def stream(a, batch: int) -> list[tuple[int, int]]:
    """(prompt length, new tokens) per request; the same for every method."""
    rng = random.Random(f"{a.seed}-{batch}")
    lo, hi = math.log(a.min_context), math.log(a.max_context)
    news = [int(x) for x in a.new.split(",")]
    return [(int(math.exp(rng.uniform(lo, hi))), rng.choice(news)) for _ in range(a.requests)]


def prepare(model, original, method: str, a) -> None:
    model.forward = original
    if method == "hf-static":
        model.generation_config.disable_compile = False
    else:
        plan = "dense" if method == "dense-gqa" else method
        compile_as = dict(backend="eager") if a.smoke else dict(mode="reduce-overhead")
        sparse_fx.compile(model, plan, **compile_as, **({} if plan == "dense" else dict(budget=a.budget, min_context=0)))


def reset(model, original) -> None:
    sparse_fx.api.restore(model)  # a no-op for hf-static
    model.forward = original
    torch._dynamo.reset()
    counters.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _generate(model, n: int, new: int, batch: int, device: str) -> float:
    """Seconds of one greedy generate() of `new` tokens after a random prompt of n tokens."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ids = torch.randint(0, model.config.vocab_size, (batch, n), device=device)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
                       pad_token_id=0)
    sync()
    return time.perf_counter() - t0


def run_stream(model, method: str, batch: int, requests: list[tuple[int, int]], device: str) -> dict:
    out = []
    start = time.perf_counter()
    for n, new in requests:
        frames = counters["stats"]["unique_graphs"]
        seconds = _generate(model, n, new, batch, device)
        out.append(dict(context=n, new=new, seconds=seconds, compiled=counters["stats"]["unique_graphs"] > frames))
    total = time.perf_counter() - start
    return dict(method=method, batch=batch, stream_s=total, requests=out, tokens=batch * sum(new for _, new in requests),
                compiles=sum(r["compiled"] for r in out), compile_heavy_s=sum(r["seconds"] for r in out if r["compiled"]))


@contextlib.contextmanager
def deferred_stop_check():
    """transformers' DeferredStopCheck wherever its other conditions hold (as on `mps`), for the A/B;
    yields whether this transformers has it."""
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:
        yield False
        return
    real = DeferredStopCheck.__dict__["is_supported"]

    def is_supported(device, cache, cache_is_returned, is_assistant):
        return real.__func__(torch.device("mps"), cache, cache_is_returned, is_assistant)

    DeferredStopCheck.is_supported = staticmethod(is_supported)
    try:
        yield True
    finally:
        DeferredStopCheck.is_supported = real


def per_new_token(model, n: int, batch: int, a) -> float:
    """generate()'s seconds per new token, warm: (t(N new) - t(1 new)) / (N - 1), medians of --repeat."""
    new = a.per_token_new
    full = statistics.median(_generate(model, n, new, batch, a.device) for _ in range(a.repeat))
    one = statistics.median(_generate(model, n, 1, batch, a.device) for _ in range(a.repeat))
    return (full - one) / (new - 1)


def generate_vs_loop(model, method: str, batch: int, n: int, a) -> dict:
    """generate()'s seconds per new token (warm) against the tight loop's step at the same cache."""
    new = a.per_token_new
    _generate(model, n, new, batch, a.device)  # warm: graphs for this length recorded
    per_token = per_new_token(model, n, batch, a)
    deferred = None
    if a.device == "cuda":  # the deferred check records events, which the CPU has not
        with deferred_stop_check() as available:
            deferred = per_new_token(model, n, batch, a) if available else None
    cache = random_static_cache(model, batch, n, cache_bucket(n + new) - n, device=a.device)
    sparse_fx.attach_cache(model, cache)
    loop = time_decode(model, cache, batch, new, 3, windows=a.repeat).step
    return dict(method=method, batch=batch, context=n, generate_ms_per_token=per_token * 1e3, loop_step_ms=loop * 1e3,
                overhead=per_token / loop - 1, deferred_ms_per_token=None if deferred is None else deferred * 1e3,
                deferred_overhead=None if deferred is None else deferred / loop - 1)


def summary_line(row: dict) -> str:
    return (f"{row['method']} batch {row['batch']}: stream {row['stream_s']:.1f} s, {row['compiles']} requests compiled "
            f"({row['compile_heavy_s']:.1f} s), {row['tokens'] / row['stream_s']:.1f} tokens/s")


def markdown(report: dict) -> str:
    meta = report["meta"]
    shape = "a tiny Llama" if meta["args"].get("smoke") else f"{meta['args']['layers']} layers of the 8B shape"
    lines = [f"# A stream of requests through generate() ({shape}, {meta['gpu']})",
             "", f"`{meta['command']}` ({meta['date']})", "",
             "| method | batch | stream s | requests that compiled | their seconds | tokens / s (whole stream) |",
             "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['batch']} | {r['error']} | | | |")
            continue
        lines.append(f"| {r['method']} | {r['batch']} | {r['stream_s']:.1f} | {r['compiles']} of {len(r['requests'])} | "
                     f"{r['compile_heavy_s']:.1f} | {r['tokens'] / r['stream_s']:.1f} |")
    lines += ["", "generate() per new token (warm) against the tight loop's step, same compiled forward and cache length:", "",
              "| method | batch | context | generate() ms / token | loop step ms | generate() adds | "
              "with the deferred stop check |", "|---|---|---|---|---|---|---|"]
    for p in report["per_token"]:
        deferred = "-" if p.get("deferred_ms_per_token") is None else \
            f"{p['deferred_ms_per_token']:.2f} ms ({100 * p['deferred_overhead']:+.1f}%)"
        lines.append(f"| {p['method']} | {p['batch']} | {p['context']} | {p['generate_ms_per_token']:.2f} | "
                     f"{p['loop_step_ms']:.2f} | {100 * p['overhead']:+.1f}% | {deferred} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
