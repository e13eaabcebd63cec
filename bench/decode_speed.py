"""End-to-end decode speed on a Llama-3.1-8B-shaped model (random weights, bf16) on one GPU.

Compares, in one process and on the same KV cache contents: Hugging Face's default generate path
(eager, DynamicCache), dense decode compiled with a static cache and CUDA graphs (HF's repeat_kv +
masked SDPA, and SDPA with enable_gqa), and `sparse_fx.compile` with `hash`, `prism-g4`, `prism-g4-hash` and
`prism-g4-int2refine` (refined layers ranking the pool by INT2 keys) (and `prism-g4-mass0.95`: over random caches attention is nearly uniform, so its row shows what the
adaptive budget's trim costs rather than what it saves).
Decode speed does not depend on weight or cache values, so caches are filled with random keys and
values instead of running a 128K prefill per method. Beside each step: the bytes it must read
(weights, then K/V or side caches and selected rows) and the speed-up that bound allows.

Time to first token (`--ttft`) is measured with real prefills: Hugging Face's own prefill on a
static cache (the dense baseline) and each plan's; cold (the first call, compilation and kernel
builds included) and warm (the median of 3 calls after it), and the end-to-end time of the prompt
plus 1000 generated tokens (warm TTFT + 1000 x the step).

    python bench/decode_speed.py --shapes 131072x4,131072x1 --ttft 32768,131072 --out DIR
    python bench/decode_speed.py --contexts 32768 --batches 1 --methods dense-gqa,hash --steps 32
Writes <out>/decode-<date>.json (rows so far, after every configuration) and, when complete, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import sparse_fx

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]
from benchlib.layers import step_floor_bytes
from benchlib.llama import build_model, random_static_cache, sdpa_gqa_attention, time_decode

SPARSE = ("hash", "prism-g4", "prism-g4-hash", "prism-g4-int2refine", "prism-g4-mass0.95")  # sparse_fx plans this bench compiles
METHODS = ("hf-default", "dense", "dense-gqa", *SPARSE)


def random_dynamic_cache(model, batch: int, filled: int):
    from transformers import DynamicCache

    c = model.config
    cache = DynamicCache(config=c)
    shape = (batch, c.num_key_value_heads, filled, c.hidden_size // c.num_attention_heads)
    for i in range(c.num_hidden_layers):
        cache.update(torch.randn(shape, device="cuda", dtype=torch.bfloat16), torch.randn(shape, device="cuda", dtype=torch.bfloat16), i)
    return cache


def time_prefill(forward, model, n: int, batch: int, calls: int = 4) -> tuple[float, float, list[float]]:
    """(cold s, warm s, all calls): a prompt of n tokens into a fresh static cache, as generate() does."""
    from transformers import StaticCache

    ids = torch.randint(0, 128256, (batch, n), device="cuda")
    times = []
    for _ in range(calls):
        cache = StaticCache(config=model.config, max_cache_len=n + 8)
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            forward(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        del cache
        torch.cuda.empty_cache()
    return times[0], statistics.median(times[1:]), times


def step_bytes(model, method: str, batch: int, n: int, args) -> float:
    """Bytes one decode step must read: the weights, and per layer all K/V (dense) or the side
    caches and the selected rows (a sparse plan)."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    R, D, layers = batch * c.num_key_value_heads, c.hidden_size // c.num_attention_heads, c.num_hidden_layers
    if method in SPARSE:  # a Prism pool: 4 x budget
        per_layer = step_floor_bytes(method.split("-mass")[0], R, n, args.budget + args.sink + args.local, 4 * args.budget, D)
    else:
        per_layer = R * n * D * 2 * 2
    return weights + layers * per_layer


def ttft_rows(model, original_forward, contexts: list[int], batches: list[int], args) -> list[dict]:
    """Cold and warm time to first token of dense (Hugging Face's own prefill) and each plan."""
    rows = []
    for n in contexts:
        for batch in batches:
            for method in ["dense"] + [m for m in args.methods.split(",") if m in SPARSE]:
                model.forward = original_forward
                try:
                    if method != "dense":
                        sparse_fx.compile(model, method, budget=args.budget, sink=args.sink, local=args.local,
                                          min_context=args.min_context)
                    cold, warm, times = time_prefill(model.forward, model, n, batch)
                    row = dict(kind="ttft", method=method, context=n, batch=batch, cold_s=cold, warm_s=warm, calls_s=times)
                except torch.OutOfMemoryError:
                    row = dict(kind="ttft", method=method, context=n, batch=batch, error="does not fit in GPU memory")
                finally:
                    model.forward = original_forward
                    torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
    for r in rows:
        dense = next((d for d in rows if d["method"] == "dense" and d["context"] == r["context"] and d["batch"] == r["batch"]
                      and "warm_s" in d), None)
        if dense and "warm_s" in r:
            r["warm_vs_dense"] = r["warm_s"] / dense["warm_s"]
    return rows


def run_method(model, original_forward, method: str, batch: int, n: int, args) -> dict:
    kv_bytes = 2 * model.config.num_hidden_layers * batch * model.config.num_key_value_heads * (n + args.room) * 128 * 2
    row = {"method": method, "batch": batch, "context": n, "kv_cache_gib": kv_bytes / 2**30,
           "step_bytes": step_bytes(model, method, batch, n, args)}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model.forward = original_forward
    model.config._attn_implementation = "sdpa_gqa" if method == "dense-gqa" else "sdpa"
    try:
        if method == "hf-default":
            cache = random_dynamic_cache(model, batch, n)
            step, first = time_decode(model.forward, cache, batch, max(4, args.steps // 8), 1, windows=1)[:2]
            row["compile_s"] = 0.0
        else:
            cache = random_static_cache(model, batch, n, args.room)
            if method.startswith("dense"):
                forward = torch.compile(original_forward, mode="reduce-overhead", fullgraph=True)
            else:
                sparse_fx.compile(model, method, budget=args.budget, sink=args.sink, local=args.local,
                                  min_context=args.min_context)
                sparse_fx.attach_cache(model, cache)
                forward = model.forward
            timed = time_decode(forward, cache, batch, args.steps, args.warmup)
            step, first, phases = timed.step, timed.first, timed.phases
            row.update(timed.windows_ms())
            row["compile_s"] = first - step
            # what of the first call torch.compile took (the rest: the first run of the compiled code)
            row["compile_phases_s"] = phases
            row["torch_compile_s"] = phases.get("_compile.compile_inner", 0.0)
            if not method.startswith("dense"):
                report = sparse_fx.explain(model)
                row["sparse_layers"] = len(report.sparse_layers)
                row["side_cache_gib"] = report.side_cache_bytes / 2**30
                row["side_cache_share_of_kv"] = report.side_cache_bytes / kv_bytes
        row["step_ms"] = step * 1e3
        row["tokens_per_s"] = batch / step
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        row["error"] = "does not fit in GPU memory"
    except Exception as e:  # noqa: BLE001 - one method failing must not lose the others' numbers
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        cache = None
        model.forward = original_forward
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="32768,65536,131072")
    p.add_argument("--batches", default="1,4", help="batches at every context (16 is added at 32K)")
    p.add_argument("--shapes", default=None, help="CONTEXTxBATCH,... instead of --contexts x --batches (e.g. 131072x4,65536x8)")
    p.add_argument("--methods", default="hf-default,dense-gqa,hash,prism-g4", help=f"from {', '.join(METHODS)}")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--room", type=int, default=256, help="free cache slots after the filled context")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--local", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--min-context", type=lambda v: v if v == "auto" else int(v), default="auto",
                   help="the plans' min_context: 'auto' (the product's: dense below the measured break-even, "
                        "sparse_layers 0 in the row) or a length (0: always sparse)")
    p.add_argument("--ttft", default="", help="contexts whose time to first token to measure (e.g. 32768,65536,131072)")
    p.add_argument("--ttft-batches", default="1", help="batches of the time-to-first-token runs")
    p.add_argument("--repeat", type=int, default=1, help="time each decode configuration this many times (median kept)")
    p.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=INT",
                   help="launch constants of sparse_fx.lowering.kernels before compiling (as kernel_step --set)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="combine the rows of these results into --out/NAME.json, .md, .png")
    p.add_argument("--name", default=None, help="file stem of --merge's result (default decode-<date>)")
    benchlib.add_out(p)
    args = p.parse_args()
    if args.merge:
        meta = benchlib.header(args)
        merge(args.merge, args.out, args.name or f"decode-{meta['date'][:10]}", meta)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_speed.py needs a CUDA GPU")
    for knob in args.set:
        benchlib.set_kernel_constant(knob)
    torch._dynamo.config.recompile_limit = 64  # one compiled graph per (method, batch, context)
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa_gqa", sdpa_gqa_attention)
    model = build_model(args.layers)
    original_forward = model.forward
    if args.shapes:
        configs = [(int(b), int(n)) for n, b in (s.split("x") for s in args.shapes.split(","))]
    else:
        configs = [(b, n) for n in map(int, args.contexts.split(",")) for b in map(int, args.batches.split(","))]
        if "32768" in args.contexts.split(",") and "16" not in args.batches.split(","):
            configs.append((16, 32768))
    meta = benchlib.header(args)
    rows = []
    if args.ttft:
        rows += ttft_rows(model, original_forward, [int(n) for n in args.ttft.split(",")],
                          [int(b) for b in args.ttft_batches.split(",")], args)
        save(rows, configs, args.out, meta, complete=False)
    for batch, n in configs:
        for method in args.methods.split(","):
            t0 = time.perf_counter()
            runs = [run_method(model, original_forward, method, batch, n, args) for _ in range(args.repeat)]
            row = runs[0]
            if all("step_ms" in r for r in runs) and len(runs) > 1:
                row["runs_step_ms"] = [r["step_ms"] for r in runs]
                row["step_ms"] = statistics.median(row["runs_step_ms"])
                row["tokens_per_s"] = batch / row["step_ms"] * 1e3
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(rows, configs, args.out, meta, complete=False)  # a run stopped at its time limit keeps its rows
    save(rows, configs, args.out, meta, complete=True)
    print_table(rows)


def save(rows: list[dict], configs, out, meta: dict, complete: bool, stem: str | None = None) -> None:
    decode = [r for r in rows if r.get("kind") != "ttft"]
    for batch, n in configs:
        same = [r for r in decode if r["batch"] == batch and r["context"] == n and "tokens_per_s" in r]
        dense = [r for r in same if r["method"] in ("dense", "dense-gqa", "hf-default")]
        best = max(dense, key=lambda r: r["tokens_per_s"], default=None)
        for r in same:
            r["speedup_vs_best_dense"] = r["tokens_per_s"] / best["tokens_per_s"] if best else None
            r["bytes_ceiling_vs_best_dense"] = best["step_bytes"] / r["step_bytes"] if best else None
    for r in rows:  # a prompt of `context` tokens and 1000 generated ones, from the two measurements
        step = next((d["step_ms"] for d in decode if d["method"] == (r["method"] if r["method"] != "dense" else "dense-gqa")
                     and d["context"] == r["context"] and d["batch"] == r["batch"] and "step_ms" in d), None)
        if r.get("kind") == "ttft" and step is not None and "warm_s" in r:
            r["prompt_plus_1000_tokens_s"] = r["warm_s"] + 1000 * step / 1e3
    benchlib.save(out, stem or f"decode-{meta['date'][:10]}", {"meta": meta, "complete": complete, "rows": rows},
                  keep_others=stem is None,
                  markdown=markdown(rows, meta) if complete else None,
                  plot=(lambda path: plot(decode, path)) if complete else None)


def markdown(rows: list[dict], meta: dict) -> str:
    commands = "; ".join(f"`{r['command']}`" for r in meta.get("runs", [meta]))
    lines = [f"End to end on {meta['gpu']}, Llama-3.1-8B shape (random bf16 weights); {commands}", "",
             "| context | batch | method | tokens/s | step ms | vs best dense | bytes bound | compile s (torch.compile) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("kind") == "ttft" or "step_ms" not in r:
            continue
        s, c = r.get("speedup_vs_best_dense"), r.get("bytes_ceiling_vs_best_dense")
        ratios = f"{s:.2f}x | {c:.2f}x" if s is not None else "- | -"
        compiled = f"{r['compile_s']:.0f}" + (f" ({r['torch_compile_s']:.0f})" if "torch_compile_s" in r else "")
        lines.append(f"| {r['context']} | {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | "
                     f"{ratios} | {compiled} |")
    ttft = [r for r in rows if r.get("kind") == "ttft" and "warm_s" in r]
    if ttft:
        lines += ["", "| context | batch | method | TTFT warm s | vs dense | TTFT cold s | prompt + 1000 tokens s |", "|---|---|---|---|---|---|---|"]
        for r in ttft:
            e2e = r.get("prompt_plus_1000_tokens_s")
            lines.append(f"| {r['context']} | {r['batch']} | {r['method']} | {r['warm_s']:.3f} | {r.get('warm_vs_dense', 1.0):.3f} | "
                         f"{r['cold_s']:.3f} | {f'{e2e:.2f}' if e2e else '-'} |")
    return "\n".join(lines) + "\n"


def merge(paths: list[str], out, stem: str, meta: dict) -> None:
    """One result from several runs' JSONs (a device call has a time limit, so a full matrix takes
    several): their rows, ratios recomputed within each (context, batch), every run's header kept."""
    runs = [json.loads(open(p).read()) for p in paths]
    rows = [{k: v for k, v in r.items() if k not in ("speedup_vs_best_dense", "bytes_ceiling_vs_best_dense")}
            for run in runs for r in run["rows"]]
    configs = sorted({(r["batch"], r["context"]) for r in rows if r.get("kind") != "ttft"})
    first = runs[0]["meta"]
    merged = [m for run in runs for m in run["meta"].get("runs", [run["meta"]])]  # a merged input: its own runs
    meta = {**meta, "gpu": first["gpu"], "versions": first["versions"], "runs": merged}
    save(rows, configs, out, meta, complete=True, stem=stem)
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    print(markdown(rows, {"gpu": "this GPU", "command": "(above)"}))


def plot(rows, path) -> None:
    plt = benchlib.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in SPARSE:
        for batch in sorted({r["batch"] for r in rows}):
            pts = sorted((r["context"], r["speedup_vs_best_dense"]) for r in rows
                         if r["method"] == method and r["batch"] == batch and r.get("speedup_vs_best_dense"))
            if pts:
                ax.plot([p[0] // 1024 for p in pts], [p[1] for p in pts], marker="o", label=f"{method}, batch {batch}")
    ax.axhline(1.0, color="gray", lw=0.8)
    benchlib.axes(ax, "context (K tokens)", "decode tokens/s vs best dense", "Llama-3.1-8B shape, bf16, one H200")
    ax.legend()
    benchlib.savefig(fig, path, dpi=120)


if __name__ == "__main__":
    main()
