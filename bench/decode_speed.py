"""End-to-end decode speed on a Llama-3.1-8B-shaped model (random weights, bf16) on one GPU.

Compares, in one process and on the same KV cache contents: Hugging Face's default generate path
(eager, DynamicCache), dense decode compiled with a static cache and CUDA graphs (HF's repeat_kv +
masked SDPA, and SDPA with enable_gqa), and `sparse_fx.compile` with `hash` and `prism-g4`.
Decode speed does not depend on weight or cache values, so caches are filled with random keys and
values instead of running a 128K prefill per method; time to first token is measured with real
prefills at batch 1.

    python bench/decode_speed.py                      # the whole matrix (H200: about 10 minutes)
    python bench/decode_speed.py --contexts 32768 --batches 1 --methods dense,hash --steps 32
Writes <out>/decode-<date>.json (rows so far, after every configuration) and, when complete, .png.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import sparse_fx

import benchlib  # bench/benchlib.py: a script's own folder is sys.path[0]

METHODS = ("hf-default", "dense", "dense-gqa", "hash", "prism-g4")
LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072 + 4096,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)


def build_model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": layers})
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention function: SDPA with enable_gqa=True (no repeat_kv) even when a mask is given."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def random_static_cache(model, batch: int, filled: int, room: int):
    """A StaticCache of max length filled + room whose first `filled` slots hold random K/V."""
    from transformers import StaticCache

    c = model.config
    cache = StaticCache(config=c, max_cache_len=filled + room)
    cache.early_initialization(batch, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, torch.bfloat16, "cuda")
    g = torch.Generator("cuda").manual_seed(0)
    for layer in cache.layers:
        layer.keys[:, :, :filled].normal_(generator=g)
        layer.values[:, :, :filled].normal_(generator=g)
        layer.cumulative_length.fill_(filled)
    return cache


def random_dynamic_cache(model, batch: int, filled: int):
    from transformers import DynamicCache

    c = model.config
    cache = DynamicCache(config=c)
    shape = (batch, c.num_key_value_heads, filled, c.hidden_size // c.num_attention_heads)
    for i in range(c.num_hidden_layers):
        cache.update(torch.randn(shape, device="cuda", dtype=torch.bfloat16), torch.randn(shape, device="cuda", dtype=torch.bfloat16), i)
    return cache


def time_decode(forward, cache, batch: int, steps: int, warmup: int) -> tuple[float, float]:
    """(seconds per step, seconds of the first call) over `steps` timed single-token steps."""
    vocab = 128256
    ids = torch.randint(0, vocab, (batch, 1), device="cuda")
    with torch.no_grad():
        t0 = time.perf_counter()
        forward(ids, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        for _ in range(warmup - 1):
            forward(ids, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            forward(ids, past_key_values=cache, use_cache=True).logits.argmax(-1)
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / steps, first


def time_prefill(forward, model, n: int) -> float:
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=n + 8)
    ids = torch.randint(0, 128256, (1, n), device="cuda")
    with torch.no_grad():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward(ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_method(model, original_forward, method: str, batch: int, n: int, args) -> dict:
    kv_bytes = 2 * model.config.num_hidden_layers * batch * model.config.num_key_value_heads * (n + args.room) * 128 * 2
    row = {"method": method, "batch": batch, "context": n, "kv_cache_gib": kv_bytes / 2**30}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model.forward = original_forward
    model.config._attn_implementation = "sdpa_gqa" if method == "dense-gqa" else "sdpa"
    try:
        if method == "hf-default":
            cache = random_dynamic_cache(model, batch, n)
            step, first = time_decode(model.forward, cache, batch, max(4, args.steps // 8), 1)
            row["compile_s"] = 0.0
        else:
            cache = random_static_cache(model, batch, n, args.room)
            if method.startswith("dense"):
                forward = torch.compile(original_forward, mode="reduce-overhead", fullgraph=True)
            else:
                sparse_fx.compile(model, method, budget=args.budget, sink=args.sink, local=args.local)
                sparse_fx.attach_cache(model, cache)
                forward = model.forward
            step, first = time_decode(forward, cache, batch, args.steps, args.warmup)
            row["compile_s"] = first - step
            if not method.startswith("dense"):
                report = sparse_fx.explain(model)
                row["sparse_layers"] = len(report.sparse_layers)
                row["side_cache_gib"] = report.side_cache_bytes / 2**30
                row["side_cache_share_of_kv"] = report.side_cache_bytes / kv_bytes
        row["step_ms"] = step * 1e3
        row["tokens_per_s"] = batch / step
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if args.ttft and batch == 1:
            row["ttft_s"] = time_prefill(model.forward if method in ("hash", "prism-g4") else original_forward, model, n) + step
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
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--room", type=int, default=256, help="free cache slots after the filled context")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--local", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--ttft", action="store_true", help="also time real prefills at batch 1")
    benchlib.add_out(p)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_speed.py needs a CUDA GPU")
    torch._dynamo.config.recompile_limit = 64  # one compiled graph per (method, batch, context)
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa_gqa", sdpa_gqa_attention)
    model = build_model(args.layers)
    original_forward = model.forward
    configs = [(b, n) for n in map(int, args.contexts.split(",")) for b in map(int, args.batches.split(","))]
    if "32768" in args.contexts.split(",") and "16" not in args.batches.split(","):
        configs.append((16, 32768))
    meta = benchlib.header(args)
    rows = []
    for batch, n in configs:
        for method in args.methods.split(","):
            t0 = time.perf_counter()
            row = run_method(model, original_forward, method, batch, n, args)
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(rows, configs, args.out, meta, complete=False)  # a run stopped at its time limit keeps its rows
    save(rows, configs, args.out, meta, complete=True)
    print_table(rows)


def save(rows: list[dict], configs, out, meta: dict, complete: bool) -> None:
    for batch, n in configs:
        same = [r for r in rows if r["batch"] == batch and r["context"] == n and "tokens_per_s" in r]
        best = max((r["tokens_per_s"] for r in same if r["method"] in ("dense", "dense-gqa", "hf-default")), default=None)
        for r in same:
            r["speedup_vs_best_dense"] = r["tokens_per_s"] / best if best else None
    benchlib.save(out, f"decode-{meta['date'][:10]}", {"meta": meta, "complete": complete, "rows": rows},
                  plot=(lambda path: plot(rows, path)) if complete else None)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'ctx':>7} {'B':>3} {'method':<11} {'tok/s':>9} {'vs dense':>8} {'step ms':>8} {'compile s':>9} {'peak GiB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['context']:>7} {r['batch']:>3} {r['method']:<11} {r['error']}")
            continue
        s = r.get("speedup_vs_best_dense")
        print(f"{r['context']:>7} {r['batch']:>3} {r['method']:<11} {r['tokens_per_s']:>9.1f} {s or 0:>8.2f} "
              f"{r['step_ms']:>8.2f} {r['compile_s']:>9.1f} {r['peak_gib']:>8.1f}")


def plot(rows, path) -> None:
    plt = benchlib.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in ("hash", "prism-g4"):
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
