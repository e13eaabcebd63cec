#!/usr/bin/env python
"""Lossless mode's speed on the Llama-3.1-8B shape (random bf16 weights, one GPU): the draft step,
the verify step and a whole round, against dense decoding (`dense-gqa`: SDPA with enable_gqa, CUDA
graphs) and the lossy plan alone, in one process on the same cache contents.

Random weights say nothing about acceptance, so the round is measured as it runs (greedy, gamma
fixed: `generate()` on a static cache whose first context - 1 slots hold random keys and values,
the prompt's last token prefilled densely) and tokens per second are then computed for the per-draft
acceptance a measured on the real model (`bench/lossless_acceptance.py`, SmolLM2): a row emits
E = (1 - a^(g+1)) / (1 - a) tokens a round when each row keeps what it accepted ("rows") and
1 + sum_i a^(i*batch) when the batch advances by its fewest ("min"). Per-round seconds are the wall
clock of the rounds (each ends in a device-to-host read); draft and verify seconds are CUDA events;
"of it neither" is what a round holds beyond gamma drafts and a verify (the GPU idle while the host
works).

A draft plan is compiled once per gamma and batch and then serves every context of that batch (the
cache length is symbolic in both graphs): `first_call_s` is the compile at a batch's first context,
at its later contexts what a never-seen length costs. Dense rows compile per shape, as today.

    python bench/lossless_speed.py --shapes 131072x1,131072x4,65536x4,65536x8,32768x8,32768x16 --layers 16 \\
        --gammas 4,8 --acceptance bench/results/lossless-acceptance-2026-12-07-cpu-fp32.json
Writes <out>/lossless-speed.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import sparse_fx
from sparse_fx.forward import cache_bucket
from torch._dynamo.utils import counters

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]
from benchlib.timing import kernel_times
from benchlib.llama import LLAMA_8B, build_model, random_static_cache, sdpa_gqa_attention, time_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="131072x4", help="CONTEXTxBATCH,...")
    ap.add_argument("--plans", default="hash", help="draft plans")
    ap.add_argument("--gammas", default="4", help="draft lengths, each its own compile")
    ap.add_argument("--modes", default="reduce-overhead", help="Inductor modes of the lossless rows (reduce-overhead: "
                    "CUDA graphs; default: none, to see what the graphs save)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--sink", type=int, default=128)
    ap.add_argument("--local", type=int, default=128)
    ap.add_argument("--new", type=int, default=48, help="tokens per timed generate() call")
    ap.add_argument("--repeat", type=int, default=3, help="timed generate() calls per configuration (median kept)")
    ap.add_argument("--steps", type=int, default=64, help="timed dense decode steps")
    ap.add_argument("--profile", action="store_true", help="also record the kernels of one generate() call "
                    "(torch.profiler: the top 15 by device time, per round)")
    ap.add_argument("--acceptance", default=None, help="lossless-acceptance.json: per-draft acceptance per plan (its "
                    "longest context, mean over gammas); else --alpha")
    ap.add_argument("--alpha", default="0.8,0.9,0.95", help="per-draft acceptances to tabulate without --acceptance")
    ap.add_argument("--retable", nargs="+", metavar="JSON", help="no GPU run: the rows of these results, tabulated for "
                    "--acceptance into --out/lossless-speed.*")
    ap.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=INT",
                    help="launch constants of sparse_fx.lowering.kernels before compiling (as kernel_step --set)")
    benchlib.add_out(ap)
    a = ap.parse_args()
    for knob in a.set:
        benchlib.set_kernel_constant(knob)
    if a.retable:
        runs = [json.loads(Path(f).read_text()) for f in a.retable]
        rows, alphas = [r for run in runs for r in run["rows"]], acceptances(a)
        meta = {**runs[0]["meta"], "retabled": benchlib.header(a), "sources": [run["meta"]["command"] for run in runs]}
        report = {"meta": meta, "rows": rows, "alphas": alphas, "table": table(rows, alphas)}
        benchlib.save(a.out, "lossless-speed", report, markdown=markdown(report))
        print(markdown(report))
        return
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa_gqa", sdpa_gqa_attention)
    model = build_model(a.layers)
    original = model.forward
    alphas = acceptances(a)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in a.shapes.split(",")]
    rows = []
    for n, batch in shapes:
        rows.append(dense_row(model, original, n, batch, a))
        print(json.dumps(rows[-1]), flush=True)
    for plan in a.plans.split(","):
        for mode in a.modes.split(","):
            for g in (int(x) for x in a.gammas.split(",")):
                for batch in sorted({b for _, b in shapes}):
                    contexts = [n for n, b in shapes if b == batch]
                    for row in lossless_rows(model, original, plan, contexts, batch, g, mode, a):
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    report = {"meta": benchlib.header(a), "rows": rows, "alphas": alphas, "table": table(rows, alphas)}
    benchlib.save(a.out, "lossless-speed", report, markdown=markdown(report))
    print(markdown(report))


def acceptances(a) -> dict[str, float]:
    """The per-draft acceptances to tabulate: "plan/gamma" -> the one measured on the real model at its
    longest context (with --acceptance), and the --alpha values keyed by themselves."""
    out = {f"a={x}": float(x) for x in a.alpha.split(",")}
    if a.acceptance:
        summary = json.loads(Path(a.acceptance).read_text())["summary"]
        longest = max(s["context"] for s in summary)
        out.update({f"{s['plan']}/{s['gamma']}": s["per_draft"] for s in summary if s["context"] == longest})
    return out


def dense_row(model, original, n: int, batch: int, a) -> dict:
    row = dict(kind="dense-gqa", context=n, batch=batch, layers=a.layers)
    model.forward = original
    model.config._attn_implementation = "sdpa_gqa"
    try:
        cache = random_static_cache(model, batch, n, 256)
        forward = torch.compile(original, mode="reduce-overhead", fullgraph=True)
        timed = time_decode(forward, cache, batch, a.steps, 3)
        row.update(step_ms=timed.step * 1e3, tokens_per_s=batch / timed.step, compile_s=timed.first - timed.step,
                   **timed.windows_ms())
    except torch.OutOfMemoryError:
        row["error"] = "does not fit in GPU memory"
    finally:
        model.config._attn_implementation = "sdpa"
        cache = forward = None
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return row


def lossless_rows(model, original, plan: str, contexts: list[int], batch: int, g: int, mode: str, a) -> list[dict]:
    """One compile of lossless mode with this draft plan, gamma and batch; a row per context."""
    model.forward = original
    rows = []
    try:
        sparse_fx.compile(model, plan, speculate=g, mode=mode, budget=a.budget, sink=a.sink, local=a.local, min_context=0)
        for n in contexts:
            rows.append(lossless_row(model, plan, n, batch, g, mode, a))
    finally:
        sparse_fx.api.restore(model)
        model.forward = original
        torch._dynamo.reset()
        counters.clear()
        torch.cuda.empty_cache()
    return rows


def lossless_row(model, plan: str, n: int, batch: int, g: int, mode: str, a) -> dict:
    row = dict(kind="lossless", plan=plan, context=n, batch=batch, gamma=g, layers=a.layers, mode=mode)
    room = cache_bucket(n - 1 + min(batch, g + 1) * a.new + g + 2) - (n - 1)  # the cache generate() allocates
    row["cache_len"] = n - 1 + room
    cache = None
    try:
        cache = random_static_cache(model, batch, n - 1, room)
        sparse_fx.attach_cache(model, cache)
        ids = torch.randint(0, LLAMA_8B["vocab_size"], (batch, n), device="cuda")
        seen = sparse_fx.acceptance(model)
        t0 = time.perf_counter()
        _generate(model, ids, cache, n, 2 * g)  # the first: compiles the draft and verify graphs; later: records
        row["first_call_s"] = time.perf_counter() - t0
        runs = []
        for _ in range(a.repeat):
            seen.reset()
            _generate(model, ids, cache, n, a.new)
            runs.append(dict(round_ms=seen.seconds / seen.rounds * 1e3, draft_ms=seen.draft_seconds / seen.rounds / g * 1e3,
                             verify_ms=seen.verify_seconds / seen.rounds * 1e3, rounds=seen.rounds,
                             random_weights_tokens_per_round=seen.tokens_per_round))
        for key in ("round_ms", "draft_ms", "verify_ms"):
            row[key] = statistics.median(r[key] for r in runs)
        if a.profile:
            seen.reset()
            times = kernel_times(lambda: _generate(model, ids, cache, n, a.new), reps=1)
            rounds = seen.rounds / 2  # kernel_times calls once to warm up, then once profiled
            top = sorted(times.items(), key=lambda kv: -kv[1][0])[:15]
            row["kernels_per_round"] = {name[:90]: dict(us=us / rounds, launches=calls / rounds)
                                        for name, (us, calls) in top}
        row["runs"] = runs
        row["graphs"] = len(sparse_fx.api.sparse_state(model).reports)
        row["inductor_counters"] = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
        row["sparse_layers"] = len(sparse_fx.explain(model).sparse_layers)
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError:
        row["error"] = "does not fit in GPU memory"
    except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others' numbers
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        del cache
        torch.cuda.empty_cache()
    return row


def _generate(model, ids, cache, n: int, new: int) -> None:
    """One lossless generate() from a cache holding the prompt less its last token (reset each call:
    the slots after it are rewritten by the call)."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(n - 1)
    cache.__dict__.pop("_sparse_fx_holes", None)  # the random prompt is whole again: no holes before n - 1
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=new, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
    torch.cuda.synchronize()


def expected_tokens(alpha: float, gamma: int, batch: int, policy: str) -> float:
    """Tokens a row emits per round under the geometric model (module docstring)."""
    if policy == "rows":
        return sum(alpha**i for i in range(gamma + 1))
    return 1 + sum(alpha ** (i * batch) for i in range(1, gamma + 1))


def table(rows: list[dict], alphas: dict[str, float]) -> list[dict]:
    out = []
    for r in rows:
        if r["kind"] != "lossless" or "round_ms" not in r:
            continue
        dense = next((d for d in rows if d["kind"] == "dense-gqa" and d["context"] == r["context"]
                      and d["batch"] == r["batch"] and "step_ms" in d), None)
        if dense is None:
            continue
        gamma = r["gamma"]
        for source, alpha in alphas.items():
            if not source.startswith("a=") and source != f"{r['plan']}/{gamma}":
                continue
            for policy in ("rows", "min"):
                tokens = expected_tokens(alpha, gamma, r["batch"], policy)
                per_s = r["batch"] * tokens / (r["round_ms"] / 1e3)
                label = r["plan"] if r.get("mode", "reduce-overhead") == "reduce-overhead" else f"{r['plan']} ({r['mode']})"
                out.append(dict(plan=label, context=r["context"], batch=r["batch"], gamma=gamma, policy=policy,
                                acceptance=alpha, acceptance_from=source, dense_ms=dense["step_ms"], draft_ms=r["draft_ms"],
                                verify_ms=r["verify_ms"], round_ms=r["round_ms"],
                                other_ms=r["round_ms"] - gamma * r["draft_ms"] - r["verify_ms"], tokens_per_round=tokens,
                                tokens_per_s=per_s, vs_dense=per_s / dense["tokens_per_s"],
                                lossy_vs_dense=dense["step_ms"] / r["draft_ms"]))
    return out


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Lossless mode: speed on the Llama-3.1-8B shape ({meta['args']['layers']} layers, {meta['gpu']})", "",
             f"`{meta['command']}` ({meta['date']})", "",
             "| plan | context | batch | gamma | policy | acceptance | dense step ms | draft step ms | verify ms | "
             "round ms | of it neither | tokens / row / round | vs dense | lossy plan vs dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in report["table"]:
        lines.append(f"| {t['plan']} | {t['context']} | {t['batch']} | {t['gamma']} | {t['policy']} | {t['acceptance']:.3f} "
                     f"({t['acceptance_from']}) | {t['dense_ms']:.2f} | {t['draft_ms']:.2f} | {t['verify_ms']:.2f} | "
                     f"{t['round_ms']:.2f} | {t.get('other_ms', float('nan')):.2f} | {t['tokens_per_round']:.2f} | "
                     f"{t['vs_dense']:.2f}x | {t['lossy_vs_dense']:.2f}x |")
    errors = [r for r in report["rows"] if "error" in r]
    for r in errors:
        lines.append(f"\n- {r['kind']} {r.get('plan', '')} {r['context']}x{r['batch']}: {r['error']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
