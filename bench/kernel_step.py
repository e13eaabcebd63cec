#!/usr/bin/env python
"""Kernel benchmark: one sparse decode attention step (score -> select -> gather-attention) per layer.

Methods, each called through the ops the compiled graph runs (torch.ops.sparse_fx.*):
  hash      pack_signs(q logits) -> hamming_scores over the signature cache -> select_topk -> attention
  prism-g4  a group of 4 layers: one proposal layer (int2_scores -> select pool of rho*budget ->
            select budget from the pool -> attention) and three refined layers (mass_scores over the
            pool -> select -> attention); reported as the group average per layer
against dense decode attention over the whole cache:
  sdpa      F.scaled_dot_product_attention(enable_gqa=True), flash backend
  hf        HF repeat_kv (materialised expand) + SDPA
  flex      torch.nn.attention.flex_attention (compiled, enable_gqa=True)

Timing: each variant's step over NL distinct layers (so repeated replays do not find the previous
layer's data in L2) is captured in a CUDA graph and replayed; medians of several windows. Per-stage
breakdown (score / select / attention) from graphs of each stage alone. A bytes model per step and
the achieved bandwidth against a device-to-device copy measured in the same run.

  python bench/kernel_step.py                 # H200: ~8 minutes; writes <out>/kernels-<date>-<time>.json + .png
  python bench/kernel_step.py --contexts 32768 --batches 1 --budgets 4096      # a slice
  python bench/kernel_step.py --smoke         # CPU under TRITON_INTERPRET=1, tiny shapes, prints only
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import benchlib  # bench/benchlib.py: a script's own folder is sys.path[0]

SINK, LOCAL, RHO = 128, 128, 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072, 524288])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--budgets", nargs="+", default=["n/32", "1024", "2048", "4096"],
                   help="selected tokens per KV head besides sink+local: an int or n/<d>")
    p.add_argument("--heads", type=int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--sink", type=int, default=SINK)
    p.add_argument("--local", type=int, default=LOCAL)
    p.add_argument("--rho", type=int, default=RHO, help="prism pool = rho * budget")
    p.add_argument("--mask", choices=["bool", "float", "none"], default="bool",
                   help="attention mask given to the sparse ops (HF static-cache decode passes one); dense "
                        "baselines run unmasked (flash), which favours them")
    p.add_argument("--layers", type=int, default=4, help="distinct layers cycled per step (fewer when memory is short)")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention baseline (its compiles take ~10 s per shape)")
    p.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
    p.add_argument("--profile", action="store_true", help="print each kernel's time per step (torch.profiler)")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds; later measurements shrink or skip past it")
    p.add_argument("--mem-fraction", type=float, default=0.7, help="of free GPU memory a shape may use")
    benchlib.add_out(p)
    p.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes; prints only")
    return p.parse_args(argv)


ARGS = parse_args()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from sparse_fx.lowering import kernels as K  # noqa: E402
from sparse_fx.lowering import ops as _ops  # noqa: E402,F401  (registers torch.ops.sparse_fx)
from sparse_fx.lowering import reference as ref  # noqa: E402

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def budget_of(spec: str, n: int) -> int:
    return max(1, n // int(spec.split("/")[1])) if spec.startswith("n/") else int(spec)


# ------------------------------------------------------------------------------------ timing
def time_graph(fn, reps_in_graph: int = 1, target_ms: float = 60.0, windows: int = 5) -> float:
    """Median ms of one fn() call from CUDA-graph replays (reps_in_graph calls per graph)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps_in_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    stop.record()
    stop.synchronize()
    est = max(start.elapsed_time(stop), 1e-3)
    late = elapsed() > ARGS.time_budget
    n = max(2, min(500, int((target_ms / (4 if late else 1)) / est)))
    times = []
    for _ in range(2 if late else windows):
        start.record()
        for _ in range(n):
            g.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / n / reps_in_graph)
    del g
    return statistics.median(times)


def time_eager(fn, reps: int = 1) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e3 / reps


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = 1 << 30  # 2 GiB of bf16 each way
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = time_graph(lambda: b.copy_(a), target_ms=100)
    del a, b
    return 2 * n * 2 / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------------------ state
class Layers:
    """NL distinct decode layers of one (batch, context): q, K/V cache, side caches, masks."""

    def __init__(self, B, L, nl, a, dev, methods):
        Hq, Hkv, D = a.heads, a.kv_heads, a.head_dim
        bf = torch.bfloat16 if dev.type == "cuda" else torch.float32
        g = torch.Generator(device=dev).manual_seed(0)
        self.B, self.L, self.nl = B, L, nl
        self.q = [torch.randn(B, Hq, 1, D, generator=g, device=dev, dtype=bf) for _ in range(nl)]
        self.k = [torch.randn(B, Hkv, L, D, generator=g, device=dev, dtype=bf) for _ in range(nl)]
        self.v = [torch.randn(B, Hkv, L, D, generator=g, device=dev, dtype=bf) for _ in range(nl)]
        self.pos = torch.tensor([L - 1], device=dev)
        self.mask = None
        if a.mask == "bool":
            self.mask = torch.ones(B, 1, 1, L, dtype=torch.bool, device=dev)
        elif a.mask == "float":
            self.mask = torch.zeros(B, 1, 1, L, dtype=bf, device=dev)
        all_pos = torch.arange(L, device=dev)
        if "hash" in methods:
            self.qlog = [torch.randn(B, Hq, 1, 32, generator=g, device=dev, dtype=bf) for _ in range(nl)]
            self.sig = []
            for i in range(nl):
                sig = torch.empty(B, Hkv, L, 1, dtype=torch.int32, device=dev)
                # signatures of the keys through a random projection (LSH), written as prefill would
                proj = torch.randn(D, 32, generator=g, device=dev, dtype=bf)
                for s in range(0, L, 1 << 16):
                    e = min(L, s + (1 << 16))
                    K.signature_write(sig, self.k[i][:, :, s:e] @ proj, all_pos[s:e])
                self.sig.append(sig)
        if "prism" in methods:
            self.int2 = []
            for i in range(nl):
                codes = torch.empty(B, Hkv, L, D // 16, dtype=torch.int32, device=dev)
                scale = torch.empty(B, Hkv, L, D // 32, dtype=torch.float16, device=dev)
                zero = torch.empty_like(scale)
                for s in range(0, L, 1 << 16):
                    e = min(L, s + (1 << 16))
                    K.int2_write(codes, scale, zero, self.k[i][:, :, s:e], all_pos[s:e])
                self.int2.append((codes, scale, zero))


def layer_bytes(B, L, a) -> dict:
    Hkv, D = a.kv_heads, a.head_dim
    kv = 2 * B * Hkv * L * D * 2
    return dict(kv=kv, sig=B * Hkv * L * 4, int2=B * Hkv * L * (D // 16 * 4 + 2 * (D // 32) * 2), scores=B * Hkv * L * 4)


# ------------------------------------------------------------------------------------ steps
class Steps:
    """The decode step of every method, over all NL layers, split into stages."""

    def __init__(self, st: Layers, ops, a, budget: int):
        self.st, self.ops, self.a = st, ops, a
        self.budget = budget
        self.pool = min(a.rho * budget, st.L)
        self.win = a.sink + a.local
        self._cache = {}

    # hash -----------------------------------------------------------------
    def hash_score(self):
        o, st = self.ops, self.st
        self._cache["hs"] = [o.hamming_scores(o.pack_signs(st.qlog[i])[:, :, 0], st.sig[i]) for i in range(st.nl)]

    def hash_select(self):
        o, st, a = self.ops, self.st, self.a
        self._cache["hi"] = [o.select_topk(s, st.pos, self.budget, a.sink, a.local, st.mask) for s in self._cache["hs"]]

    def hash_attend(self):
        o, st = self.ops, self.st
        self._cache["ho"] = [o.sparse_decode_attention(st.q[i], st.k[i], st.v[i], idx, None, st.mask)
                             for i, idx in enumerate(self._cache["hi"])]

    def hash_step(self):
        self.hash_score()
        self.hash_select()
        self.hash_attend()
        return self._cache["ho"]

    # prism-g4: layer 0 proposes, layers 1..3 refine (KV copy = layer % NL) --------
    def _l(self, j):
        return j % self.st.nl

    def prism_score_proposal(self):
        st = self.st
        self._cache["ps"] = self.ops.int2_scores(st.q[0], *st.int2[0])

    def prism_select_proposal(self):
        o, st, a = self.ops, self.st, self.a
        scores = self._cache["ps"]
        ranked = o.select_topk(scores, st.pos, self.pool, a.sink, a.local, st.mask)
        pool = ranked[:, :, self.win:]
        at = torch.gather(scores, 2, pool.clamp(min=0).long())
        self._cache["pool"] = pool
        self._cache["pi"] = [o.select_topk(at, st.pos, self.budget, a.sink, a.local, st.mask, pool)]

    def prism_score_refined(self):
        o, st = self.ops, self.st
        pool = self._cache["pool"]
        self._cache["rs"] = [o.mass_scores(st.q[self._l(j)], st.k[self._l(j)], None, st.mask, pool) for j in (1, 2, 3)]

    def prism_select_refined(self):
        o, st, a = self.ops, self.st, self.a
        pool = self._cache["pool"]
        self._cache["pi"] = self._cache["pi"][:1] + [
            o.select_topk(s, st.pos, self.budget, a.sink, a.local, st.mask, pool) for s in self._cache["rs"]]

    def prism_attend(self):
        o, st = self.ops, self.st
        self._cache["po"] = [o.sparse_decode_attention(st.q[self._l(j)], st.k[self._l(j)], st.v[self._l(j)], idx, None, st.mask)
                             for j, idx in enumerate(self._cache["pi"])]

    def prism_score(self):  # the refined scores need the pool: run the proposal select in between
        self.prism_score_proposal()
        self.prism_select_proposal()
        self.prism_score_refined()

    def prism_select(self):
        self.prism_select_proposal()
        self.prism_select_refined()

    def prism_step(self):
        self.prism_score_proposal()
        self.prism_select_proposal()
        self.prism_score_refined()
        self.prism_select_refined()
        self.prism_attend()
        return self._cache["po"]


def dense_steps(st: Layers, a):
    G = a.heads // a.kv_heads

    def sdpa():
        return [F.scaled_dot_product_attention(st.q[i], st.k[i], st.v[i], enable_gqa=True) for i in range(st.nl)]

    def hf():
        def rep(x):
            B, H, L, D = x.shape
            return x[:, :, None].expand(B, H, G, L, D).reshape(B, H * G, L, D)

        return [F.scaled_dot_product_attention(st.q[i], rep(st.k[i]), rep(st.v[i])) for i in range(st.nl)]

    return sdpa, hf


_FLEX = None


def flex_step(st: Layers):
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return lambda: [_FLEX(st.q[i], st.k[i], st.v[i], enable_gqa=True) for i in range(st.nl)]


# ------------------------------------------------------------------------------------ bytes
def bytes_model(method: str, B, L, budget, pool, a) -> tuple[int, int]:
    """(minimal bytes per layer-step as DESIGN.md section 6, estimate incl. the scores round trip)."""
    Hkv, D = a.kv_heads, a.head_dim
    rows = B * Hkv
    sel = min(budget, L) + a.sink + a.local
    gathered = 2 * rows * sel * D * 2
    lb = layer_bytes(B, L, a)
    if method == "dense":
        return lb["kv"], lb["kv"]
    if method == "hash":
        return lb["sig"] + gathered, lb["sig"] + gathered + 2 * lb["scores"]  # scores written, read by select
    # prism-g4 average over 4 layers: one proposal, three refined
    proposal = lb["int2"] + gathered
    proposal_est = proposal + 2 * lb["scores"] + rows * pool * 12  # scores, pool gather + pool select
    refined = rows * pool * D * 2 + gathered
    refined_est = refined + rows * pool * 16  # logits scratch of G=4 heads, pool ids
    return (proposal + 3 * refined) // 4, (proposal_est + 3 * refined_est) // 4


# ------------------------------------------------------------------------------------ runs
def profile_kernels(steps: Steps, title: str) -> None:
    """Per-kernel CUDA time of one hash step and one prism-g4 group step (averaged over 3)."""
    from torch.profiler import ProfilerActivity, profile

    for name, step in (("hash", steps.hash_step), ("prism-g4 group", steps.prism_step)):
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
        print(f"  profile {title} {name} (us per step, all {steps.st.nl if name == 'hash' else 4} layers):")
        for e in rows:
            print(f"    {e.device_time_total / 3:9.1f}  x{e.count // 3:<3} {e.key[:70]}")


def run_gpu(a) -> dict:
    dev = torch.device("cuda")
    ops = torch.ops.sparse_fx
    res = dict(
        meta=benchlib.header(a),
        config=dict(heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, sink=a.sink, local=a.local, rho=a.rho,
                    mask=a.mask, dtype="bfloat16"),
        copy_gbps=None, shapes=[],
    )
    res["copy_gbps"] = copy_bandwidth()
    print(f"# {res['meta']['gpu']}  torch {torch.__version__}  triton {triton.__version__}  copy {res['copy_gbps']:.0f} GB/s", flush=True)
    methods = ("hash", "prism")
    for L in a.contexts:
        for B in a.batches:
            shape = dict(context=L, batch=B, dense={}, sparse=[], notes=[])
            res["shapes"].append(shape)
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0] * a.mem_fraction
            lb = layer_bytes(B, L, a)
            per_layer = lb["kv"] + lb["sig"] + lb["int2"] + 6 * lb["scores"]
            nl = min(a.layers, int(free // max(per_layer, 1)))
            if nl < 1:
                shape["notes"].append(f"does not fit: one layer needs {per_layer / 2**30:.1f} GiB, {free / 2**30:.1f} GiB usable")
                print(f"L={L} B={B}: skipped (does not fit)", flush=True)
                continue
            if nl < a.layers:
                shape["notes"].append(f"{nl} distinct layers (memory)")
            shape["layers"] = nl
            st = Layers(B, L, nl, a, dev, methods)
            sdpa, hf = dense_steps(st, a)
            reps = max(1, min(8, int(2e9 // (lb["kv"] * nl))))  # small shapes: several steps per graph
            try:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    shape["dense"]["sdpa"] = time_graph(sdpa, reps) / nl
                shape["dense"]["sdpa_backend"] = "flash"
            except RuntimeError as e:  # flash refused the shape: default dispatch
                shape["notes"].append(f"sdpa flash unavailable ({str(e).splitlines()[0][:80]}); default backend")
                shape["dense"]["sdpa"] = time_graph(sdpa, reps) / nl
                shape["dense"]["sdpa_backend"] = "default"
            if torch.cuda.mem_get_info()[0] * 0.9 > (a.heads // a.kv_heads) * lb["kv"] * 1.1:
                shape["dense"]["hf"] = time_graph(hf, reps) / nl
            else:
                shape["notes"].append("hf repeat_kv: the repeated K/V do not fit")
            if not a.no_flex and elapsed() < a.time_budget:
                try:
                    shape["dense"]["flex"] = time_graph(flex_step(st), reps) / nl
                except Exception as e:  # noqa: BLE001 (a baseline failing must not stop the run)
                    shape["notes"].append(f"flex failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            sdpa_ms = shape["dense"]["sdpa"]
            print(f"L={L:>7} B={B:>2} layers={nl} sdpa {sdpa_ms:.4f} ms  hf {shape['dense'].get('hf', float('nan')):.4f}"
                  f"  flex {shape['dense'].get('flex', float('nan')):.4f}", flush=True)
            for spec in a.budgets:
                budget = budget_of(spec, L)
                steps = Steps(st, ops, a, budget)
                row = dict(budget=spec, k=budget, pool=steps.pool)
                for m in methods:
                    step = steps.hash_step if m == "hash" else steps.prism_step
                    n_layers = nl if m == "hash" else 4
                    total = time_graph(step, reps) / n_layers
                    rec = dict(ms=total, speedup=sdpa_ms / total)
                    if not a.no_stages and elapsed() < a.time_budget:
                        if m == "hash":
                            steps.hash_step()
                            sc = time_graph(steps.hash_score, reps) / n_layers
                            se = time_graph(steps.hash_select, reps) / n_layers
                            at = time_graph(steps.hash_attend, reps) / n_layers
                        else:
                            steps.prism_step()
                            sc_all = time_graph(steps.prism_score, reps)
                            sp = time_graph(steps.prism_select_proposal, reps)
                            sc = (sc_all - sp) / n_layers  # prism_score includes the proposal select
                            se = time_graph(steps.prism_select, reps) / n_layers
                            at = time_graph(steps.prism_attend, reps) / n_layers
                        rec["stages_ms"] = dict(score=sc, select=se, attention=at)
                        rec["select_share"] = se / max(sc + se + at, 1e-9)
                    minimal, est = bytes_model(m, B, L, budget, steps.pool, a)
                    rec["bytes_model"] = minimal
                    rec["bytes_est"] = est
                    rec["gbps_est"] = est / (total * 1e-3) / 1e9
                    rec["bw_fraction_of_copy"] = rec["gbps_est"] / res["copy_gbps"]
                    if m == "hash":
                        steps.hash_step()
                    else:
                        steps.prism_step()
                    row[m] = rec
                    share = f" select {100 * rec['select_share']:.0f}%" if "select_share" in rec else ""
                    print(f"    {m:5s} budget {spec:>5} (k={budget:>5}) {total:.4f} ms/layer  x{rec['speedup']:.1f} vs sdpa"
                          f"{share}  {rec['gbps_est']:.0f} GB/s est", flush=True)
                if a.profile:
                    profile_kernels(steps, f"L={L} B={B} budget {spec}")
                shape["sparse"].append(row)
                del steps
            del st, sdpa, hf
            torch.cuda.empty_cache()
    res["wall_s"] = elapsed()
    return res


def summary_table(res: dict) -> str:
    lines = ["context  B  budget   k      sdpa ms   hash ms (x)       prism ms (x)     sel% h/p"]
    for sh in res["shapes"]:
        if "sdpa" not in sh["dense"]:
            lines.append(f"{sh['context']:>7} {sh['batch']:>2}  skipped: {'; '.join(sh['notes'])}")
            continue
        for row in sh["sparse"]:
            h, p = row["hash"], row["prism"]
            sel = (f"{100 * h.get('select_share', float('nan')):.0f}/{100 * p.get('select_share', float('nan')):.0f}")
            lines.append(
                f"{sh['context']:>7} {sh['batch']:>2}  {row['budget']:>6} {row['k']:>5}  {sh['dense']['sdpa']:9.4f}"
                f"  {h['ms']:8.4f} ({h['speedup']:5.1f})  {p['ms']:8.4f} ({p['speedup']:5.1f})  {sel:>8}")
    return "\n".join(lines)


def plot(res: dict, path) -> None:
    plt = benchlib.pyplot()
    budgets = list(dict.fromkeys(row["budget"] for sh in res["shapes"] for row in sh["sparse"]))
    fig, axes = plt.subplots(1, max(1, len(budgets)), figsize=(4.2 * max(1, len(budgets)), 3.6), squeeze=False)
    for ax, spec in zip(axes[0], budgets):
        series = {}
        for sh in res["shapes"]:
            for row in sh["sparse"]:
                if row["budget"] != spec:
                    continue
                for m in ("hash", "prism"):
                    series.setdefault((m, sh["batch"]), []).append((sh["context"], row[m]["speedup"]))
            for base in ("hf", "flex"):
                if base in sh["dense"] and "sdpa" in sh["dense"]:
                    series.setdefault((base, sh["batch"]), []).append((sh["context"], sh["dense"]["sdpa"] / sh["dense"][base]))
        for (m, b), pts in sorted(series.items()):
            pts.sort()
            style = "-" if m in ("hash", "prism") else ":"
            name = {"prism": "prism-g4"}.get(m, m)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=f"{name} B={b}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"budget {spec}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("speedup vs SDPA enable_gqa (flash)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"sparse decode step per layer, {res['meta']['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ------------------------------------------------------------------------------------ smoke
def run_smoke(a) -> None:
    """Every method's step end to end through the kernel launchers on CPU (interpreter), checked
    against the reference: scores, and the reference attention over the kernels' selections (ties
    at the threshold may be broken differently, so selections are not compared); prints only."""
    a.heads, a.kv_heads, a.head_dim, a.sink, a.local = 4, 2, 64, 8, 8
    dev = torch.device("cpu")
    B, L, nl = 1, 256, 2
    st = Layers(B, L, nl, a, dev, ("hash", "prism"))
    for spec in ("n/8", "32"):
        budget = budget_of(spec, L)
        kern = Steps(st, K, a, budget)
        for m in ("hash", "prism"):
            step = kern.hash_step if m == "hash" else kern.prism_step
            ms = time_eager(step)
            outs = step()
            c = kern._cache
            if m == "hash":
                err_s = max((s.float() - ref.hamming_scores(ref.pack_signs(st.qlog[i])[:, :, 0], st.sig[i]).float()).abs().max().item()
                            for i, s in enumerate(c["hs"]))
                layers, idxs = range(nl), c["hi"]
            else:
                err_s = (c["ps"] - ref.int2_scores(st.q[0], *st.int2[0])).abs().max().item()
                err_s = max([err_s] + [(s - ref.mass_scores(st.q[kern._l(j)], st.k[kern._l(j)], None, st.mask, c["pool"])).abs().max().item()
                                       for j, s in zip((1, 2, 3), c["rs"])])
                layers, idxs = [kern._l(j) for j in range(4)], c["pi"]
            err_o = max((o - ref.sparse_decode_attention(st.q[i], st.k[i], st.v[i], idx, None, st.mask)).abs().max().item()
                        for o, i, idx in zip(outs, layers, idxs))
            minimal, est = bytes_model(m, B, L, budget, kern.pool, a)
            print(f"smoke {m:5s} L={L} B={B} budget {spec:>4} (k={budget}): {ms:8.1f} ms/step (interpreter)  "
                  f"|scores - ref| {err_s:.1e}  |out - ref| {err_o:.1e}  bytes/layer {minimal}..{est}")
            assert err_s < 1e-3 and err_o < 1e-4, f"{m}: kernels disagree with the reference"
    sdpa, hf = dense_steps(st, a)
    err = max((x - y).abs().max().item() for x, y in zip(sdpa(), hf()))
    print(f"smoke dense sdpa vs hf repeat_kv: {err:.1e}")
    print("smoke ok (nothing written)")


def main() -> None:
    a = ARGS
    if a.smoke:
        run_smoke(a)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/kernel_step.py needs a CUDA GPU (or --smoke for the CPU interpreter check)")
    res = run_gpu(a)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    paths = benchlib.save(a.out, f"kernels-{stamp}", res, plot=lambda path: plot(res, path))
    print(f"\nwrote {' and '.join(map(str, paths))}  ({elapsed():.0f} s)\n")
    print(summary_table(res))


if __name__ == "__main__":
    main()
