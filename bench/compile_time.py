"""Where torch.compile's time goes when a plan's decode graph is compiled, phase by phase.

Each plan compiles in a fresh process with empty Inductor and Triton caches (a cold compile, as a
user's first call), on the Llama-3.1-8B shape with random weights (`--small` or no GPU: a narrow
model of the same depth, for a smoke run on the CPU). Per plan: the first decode call's time less a
second's, torch's own compile phases (what `torch._dynamo.utils.compile_times` prints), and the counts that
scale Inductor's work: scheduler nodes, fusion pairs tried (`Scheduler.can_fuse`), and our Triton
kernels Inductor defines in its code.

    python bench/compile_time.py --plans dense hash prism-g4 --layers 32
    python bench/compile_time.py --plans prism-g4 --fusion-window 64   # torch's default fusion search
    python bench/compile_time.py --plans dense hash --restart         # cold, then two kinds of restart
    python bench/compile_time.py --plans prism-g4 --restart --static-launcher  # Inductor's static launcher on
    python bench/compile_time.py --plans dense prism-g4 --profile --out DIR  # cProfile of each first call
    python bench/compile_time.py --one hash --layers 2 --small      # one plan, this process (the worker)

`--restart` adds, per plan, two fresh processes after the cold one: one on the same on-disk caches
(a restart on the same machine) and one on empty caches that loads the cold process's portable
artifacts (`torch.compiler.save_cache_artifacts` / `load_cache_artifacts`: another machine). Each
row gives `to_first_step_s`: from the compile call (the artifacts' load included) to the end of
the first decode step, which is what a restarted server waits for beyond loading its weights.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import subprocess
import sys
import tempfile
import time

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]

def _counting():
    """Counters of Inductor's scheduler work, by wrapping three of its methods (absent ones stay 0)."""
    from torch._inductor import scheduler as S
    from torch._inductor.codegen import wrapper as W

    counts = {"scheduler_nodes": 0, "fused_nodes": 0, "fusion_pairs_tried": 0, "user_kernels_defined": 0}

    def wrap(owner, name, key, size=None, out_key=None):
        real = getattr(owner, name, None)
        if real is None:
            return

        def counted(*args, **kwargs):
            counts[key] += size(args) if size else 1
            out = real(*args, **kwargs)
            if out_key:
                counts[out_key] += len(out)
            return out

        setattr(owner, name, counted)

    # nodes before and after fusion: a narrower fusion search must leave the second unchanged
    wrap(S.Scheduler, "fuse_nodes", "scheduler_nodes", lambda a: len(a[1]) if len(a) > 1 else 0, "fused_nodes")
    wrap(S.Scheduler, "can_fuse", "fusion_pairs_tried")
    wrap(W.PythonWrapperCodegen, "define_user_defined_triton_kernel", "user_kernels_defined")
    return counts


def _analyses() -> dict:
    """torch's kernel-access analysis in this process: runs (the memo's entries) and calls the memo
    answered (`lowering/kernels/access_memo.py`); {} where the memo is not installed."""
    fn = benchlib.kernel_analysis()
    memo = getattr(fn, "sparse_fx_memo", None)
    return {} if memo is None else {"run": len(memo), "hits": fn.sparse_fx_hits}


def measure_one(plan: str, layers: int, small: bool, fusion_window: int | None = None,
                save: str = "", load: str = "", static_launcher: bool = False, profile: str = "") -> dict:
    import torch
    from torch._dynamo.utils import counters

    import sparse_fx
    from benchlib.llama import build_model, random_static_cache
    from sparse_fx import backend

    if fusion_window:  # A/B of the fusion search's window (the plan's own compile only)
        backend.FUSION_PAIR_WINDOW = fusion_window
    backend.STATIC_LAUNCHER = static_launcher  # A/B of Inductor's static launcher (the plan's own compile only)

    dev = "cuda" if torch.cuda.is_available() and not small else "cpu"
    # small: 32 heads of 32, a narrow model of the same depth
    model = build_model(layers, dev, **(dict(vocab_size=1024, hidden_size=1024, intermediate_size=1024) if small else {}))
    # compile time does not depend on the context; a fill past the budget keeps every stage live
    cache = random_static_cache(model, 1, 8192, 64, device=dev)
    start = time.perf_counter()
    if load:
        torch.compiler.load_cache_artifacts(open(load, "rb").read())
    if plan == "dense":
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    else:
        sparse_fx.compile(model, plan, budget=1024, sink=128, local=128, min_context=0)  # the sparse graph at 8K
        sparse_fx.attach_cache(model, cache)
        forward = model.forward
    counts = _counting()
    ids = torch.randint(0, model.config.vocab_size, (1, 1), device=dev)
    calls = []
    profiler = cProfile.Profile() if profile else None
    with torch.no_grad():
        for _ in range(2):
            t0 = time.perf_counter()
            if profiler and not calls:
                profiler.runcall(forward, ids, past_key_values=cache, use_cache=True)
            else:
                forward(ids, past_key_values=cache, use_cache=True)
            if dev == "cuda":
                torch.cuda.synchronize()
            calls.append(time.perf_counter() - t0)
            if not calls[1:]:
                to_first_step = time.perf_counter() - start
    if profiler:
        benchlib.write_profile(profiler, profile)
    if save:
        open(save, "wb").write(torch.compiler.save_cache_artifacts()[0])
    hits = {f"{k}_{n}": v for k in ("inductor", "aot_autograd") for n, v in counters[k].items()
            if n.startswith(("fxgraph_cache", "autograd_cache"))}
    return {"plan": plan, "layers": layers, "device": dev, "fusion_window": backend.FUSION_PAIR_WINDOW,
            "kernel_analyses": _analyses(),
            "static_launcher": static_launcher, "profiled": bool(profile),
            "compile_s": calls[0] - calls[1], "to_first_step_s": to_first_step, "step_s": calls[1],
            "caches": hits, "phases_s": benchlib.compile_phases(), **counts}


PROFILE_NAMES = {"cold": "cold", "warm (same caches)": "restart", "warm (portable artifacts)": "portable"}


def run_fresh(plan: str, args, caches: str, start: str = "cold", save: str = "", load: str = "") -> dict:
    """measure_one in a child process whose compile caches live under `caches`."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor", TRITON_CACHE_DIR=f"{caches}/triton")
    cmd = [sys.executable, __file__, "--one", plan, "--layers", str(args.layers)] + (["--small"] if args.small else [])
    cmd += ["--fusion-window", str(args.fusion_window)] if args.fusion_window else []
    cmd += ["--static-launcher"] if args.static_launcher else []
    cmd += (["--save", save] if save else []) + (["--load", load] if load else [])
    if args.profile:  # (--out is created when parsed)
        cmd += ["--profile-path", os.path.join(args.out, f"profile-{plan}-{PROFILE_NAMES[start]}-{args.layers}layers.prof")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"plan": plan, "layers": args.layers, "start": start,
                "error": (r.stderr or r.stdout).strip().splitlines()[-1][:300]}
    return {**json.loads(lines[-1]), "start": start}


def runs_of(plan: str, args) -> list[dict]:
    """A cold compile on empty caches; with --restart, then a restart on the same caches and one on
    empty caches that loads the cold run's portable artifacts."""
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = f"{tmp}/artifacts.bin"
        rows = [run_fresh(plan, args, f"{tmp}/first", save=artifacts if args.restart else "")]
        if args.restart and "error" not in rows[0]:
            rows.append(run_fresh(plan, args, f"{tmp}/first", start="warm (same caches)"))
            rows.append(run_fresh(plan, args, f"{tmp}/second", start="warm (portable artifacts)", load=artifacts))
    return rows


def table(rows: list[dict], meta: dict) -> str:
    out = [f"Cold compile of the decode graph, {benchlib.where(meta)}, `{meta['command']}`; seconds "
           "(phases overlap: the scheduler's and codegen's sit inside GraphLowering's caller)", "",
           "| plan | start | layers | fusion window | to first step s | compile s | " + " | ".join(benchlib.COMPILE_PHASES)
           + " | scheduler nodes | after fusion | fusion pairs | our kernels | kernel analyses run / memo hits | graph cache |",
           "|---|---|---|---|---|---|" + "---|" * (len(benchlib.COMPILE_PHASES) + 6)]
    for r in rows:
        start = r.get("start", "cold")
        if "error" in r:
            out.append(f"| {r['plan']} | {start} | {r['layers']} | | error: {r['error']} |")
            continue
        ph = " | ".join(f"{r['phases_s'].get(k, float('nan')):.1f}" for k in benchlib.COMPILE_PHASES)
        window = "torch's" if r["plan"] == "dense" else r.get("fusion_window", 64)
        window = f"{window}, static launcher" if r.get("static_launcher") else window
        caches = r.get("caches", {})
        hit = "hit" if caches.get("inductor_fxgraph_cache_hit") and not caches.get("inductor_fxgraph_cache_miss") else "miss"
        first = r.get("to_first_step_s")
        analysed = r.get("kernel_analyses") or {}
        analysed = f"{analysed['run']} / {analysed['hits']}" if analysed else "-"
        out.append(f"| {r['plan']} | {start} | {r['layers']} | {window} | {'-' if first is None else f'{first:.1f}'} | "
                   f"{r['compile_s']:.1f} | {ph} | {r['scheduler_nodes']} | {r.get('fused_nodes', '-')} | "
                   f"{r['fusion_pairs_tried']} | {r['user_kernels_defined']} | {analysed} | {hit} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", nargs="+", default=["dense", "hash", "prism-g4", "prism-g4-hash"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--small", action="store_true", help="a narrow model on the CPU (smoke runs)")
    p.add_argument("--fusion-window", type=int, help="Inductor's fusion pairs per buffer group for our compiles "
                   "(default: sparse_fx.backend.FUSION_PAIR_WINDOW; torch's own is 64)")
    p.add_argument("--static-launcher", action="store_true", help="Inductor's static CUDA launcher for its own "
                   "kernels in the plan's graph (sparse_fx.backend.STATIC_LAUNCHER; off by default)")
    p.add_argument("--restart", action="store_true", help="after each cold compile, a restart on the same caches "
                   "and one on empty caches from the portable artifacts")
    p.add_argument("--profile", action="store_true", help="cProfile each process's first call: PROF files and "
                   "text summaries in the output folder")
    p.add_argument("--one", metavar="PLAN", help="measure one plan in this process and print its row (the worker)")
    p.add_argument("--save", default="", help=argparse.SUPPRESS)  # the worker: write portable artifacts here
    p.add_argument("--load", default="", help=argparse.SUPPRESS)  # the worker: load portable artifacts first
    p.add_argument("--profile-path", default="", help=argparse.SUPPRESS)  # the worker: write its profile here
    benchlib.add_out(p)
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure_one(a.one, a.layers, a.small, a.fusion_window, a.save, a.load, a.static_launcher,
                                     a.profile_path)),
              flush=True)
        return
    rows = []
    for plan in a.plans:
        for row in runs_of(plan, a):
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = benchlib.header(a)
    stamp = time.strftime("%Y-%m-%d-%H%M")
    benchlib.save(a.out, f"compile-{stamp}", {"meta": meta, "rows": rows}, markdown=table(rows, meta), keep_others=True)
    print(table(rows, meta))


if __name__ == "__main__":
    main()
