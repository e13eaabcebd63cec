#!/usr/bin/env python
"""A verify step's dense attention, one layer of the Llama-3.1-8B shape (32 query heads, 8 KV heads,
head dim 128, bf16): `few_query_attention` against SDPA with enable_gqa (the kernel torch picks: cuDNN
on an H100), for T = 1..9 queries over a cache of each context, with the mask a verify step gets
(bool [B, 1, T, L], causal by slot). Times are CUDA-graph replays (median of 5 windows after warm-up);
the bytes model is K and V read once (the mask's T bytes a slot beside), against the card's measured
read bandwidth. Outputs are checked against each other first.

    python bench/verify_attention.py --shapes 131072x1,131072x4,65536x8,32768x16 --queries 1,2,3,5,9
Writes <out>/verify-attention.json and .md.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F
import triton

import sparse_fx  # noqa: F401  (registers torch.ops.sparse_fx)
from sparse_fx.lowering import kernels

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]
from benchlib.timing import bandwidth_gbps, time_graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="131072x1,131072x4,65536x8,32768x16", help="CONTEXTxBATCH,...")
    ap.add_argument("--queries", default="1,2,3,5,9")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--room", type=int, default=256, help="cache slots past the context (generate() sizes caches to "
                    "multiples of 256; an odd room shows the cost of an unaligned cache length)")
    ap.add_argument("--tune", action="store_true", help="also time few_query_attention's launch knobs (block_n x "
                    "stages x warps x waves) at every cell; the best by geometric mean over the cells is written "
                    "as --set arguments to <out>/verify-attention-knobs.txt")
    benchlib.add_out(ap)
    a = ap.parse_args()
    peak = bandwidth_gbps()["read"]
    rows = []
    for shape in a.shapes.split(","):
        n, batch = (int(x) for x in shape.split("x"))
        L = n + a.room  # a static cache holds room for the new tokens
        g = torch.Generator("cuda").manual_seed(0)
        k = torch.randn(batch, a.kv_heads, L, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        for T in (int(t) for t in a.queries.split(",")):
            q = torch.randn(batch, a.heads, T, a.head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
            mask = (torch.arange(L, device="cuda") <= n - T + torch.arange(T, device="cuda")[:, None]).expand(batch, 1, T, L)
            mask = mask.contiguous()
            ours = kernels.few_query_attention(q, k, v, None, mask)
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            err = (ours.float() - sdpa.float()).abs().max().item()
            bytes_ = 2 * k.numel() * k.element_size() + mask.numel()
            row = dict(context=n, batch=batch, queries=T, cache_len=L, max_abs_diff=err,
                       sdpa_ms=time_graph(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)),
                       ours_ms=time_graph(lambda: kernels.few_query_attention(q, k, v, None, mask)),
                       bytes=bytes_)
            row.update(speedup=row["sdpa_ms"] / row["ours_ms"], ours_of_peak=bytes_ / row["ours_ms"] / 1e6 / peak,
                       sdpa_of_peak=bytes_ / row["sdpa_ms"] / 1e6 / peak)
            if a.tune:
                row["knobs_ms"] = {",".join(map(str, c)): knob_time(q, k, v, mask, *c) for c in KNOBS}
            rows.append(row)
            print({k: v for k, v in row.items() if k != "knobs_ms"}, flush=True)
        k = v = None
        torch.cuda.empty_cache()
    report = {"meta": benchlib.header(a), "read_gbps": peak, "rows": rows}
    if a.tune:
        report["best_knobs"] = best = min(KNOBS, key=lambda c: statistics.geometric_mean(
            r["knobs_ms"][",".join(map(str, c))] / r["ours_ms"] for r in rows if r["queries"] > 1))
        report["best_vs_default"] = statistics.geometric_mean(
            r["knobs_ms"][",".join(map(str, best))] / r["ours_ms"] for r in rows if r["queries"] > 1)
        block, stages, warps, waves = best
        knobs = dict(TILE_BYTES=block * a.head_dim * 2, STAGES=stages, WARPS=warps, WAVES=waves)
        (a.out / "verify-attention-knobs.txt").write_text(
            " ".join(f"few_query_attention.{n}={v}" for n, v in knobs.items()) + "\n")
    benchlib.save(a.out, "verify-attention", report, markdown=markdown(report))
    print(markdown(report))


def knob_time(q, k, v, mask, block_n, stages, warps, waves) -> float:
    """ms of one launch configuration; inf where it does not fit the card (shared memory)."""
    try:
        return time_graph(lambda: kernels.few_query_attention(q, k, v, None, mask, block_n=block_n, stages=stages,
                                                               warps=warps, waves=waves), windows=3)
    except triton.runtime.errors.OutOfResources:
        return float("inf")


KNOBS = list(itertools.product((32, 64, 128), (2, 3, 4), (4, 8), (2, 4, 8)))  # block_n, stages, warps, waves


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# A verify step's attention, one layer of the 8B shape ({meta['gpu']})", "",
             f"`{meta['command']}` ({meta['date']}); read bandwidth {report['read_gbps']:.0f} GB/s", "",
             "| context | batch | queries | SDPA ms | few_query_attention ms | speed-up | ours of read peak | SDPA of read peak | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['context']} | {r['batch']} | {r['queries']} | {r['sdpa_ms']:.3f} | {r['ours_ms']:.3f} | "
                     f"{r['speedup']:.2f}x | {r['ours_of_peak']:.0%} | {r['sdpa_of_peak']:.0%} | {r['max_abs_diff']:.1e} |")
    if "best_knobs" in report:
        lines.append(f"\nBest launch knobs (block_n, stages, warps, waves) over the cells of more than one query: "
                     f"{report['best_knobs']}, {report['best_vs_default']:.2f}x the defaults' time (geometric mean).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
