#!/usr/bin/env python
"""Kernel roofline: one sparse decode step per layer, kernel by kernel, against dense attention.

Each plan's step is called through the ops the compiled graph runs (torch.ops.sparse_fx.*):
  hash      query signature logits (a matmul) -> hash_select (Hamming keys fused with the select)
            -> sparse_decode_attention
  prism-g4  a group of 4 layers: a proposal layer (int2_scores -> select_nested: the pool of
            rho * budget and its best budget in one selection -> attention) and three refined
            layers (mass_select: the pool's logits, then a selection whose key pass computes the
            mass from them -> attention); reported per layer, as the group's average
  prism-g4-hash  the same group with a signature proposal (hash_select_nested: Hamming keys fused
            with the pool's and the budget's selection)
  prism-g4-int2refine  prism-g4 whose refined layers rank the pool by their own INT2 keys
            (int2_scores over the pool's slots -> select_topk of the pool -> attention)
  prism-g4-mass0.95  prism-g4 with the adaptive budget: refined layers' selections trimmed to 0.95
            of the pool's attention mass (mass_select's trim); the mean tokens they keep is reported
against dense decode attention over the whole cache (SDPA with enable_gqa, unmasked), timed under
each backend that takes the shape (flash, cuDNN, memory-efficient): the headline ratio is against
the fastest, and the report gives each plan's ratio against each backend. bf16, Hq=32, Hkv=8,
D=128 (Llama-3.1-8B), sink 128 + local 128 + budget.

The step of NL distinct layers (so replays do not find the previous layer's data in L2) is
captured in a CUDA graph and replayed (median of windows). Per kernel: device time from the
profiler, the bytes it must move by the model below, achieved bandwidth and its share of a
copy by the SMs (bytes read + written, benchlib.bandwidth_gbps) measured in the same run; the whole step against the floor of its bytes;
launches per layer. `--dense-in-step` adds each plan's ratio against dense attention as it runs inside
the compiled decode step (read from `bench/profile_step.py` results of the same card and shape: the
standalone SDPA call here runs a few percent slower than it does in the step, which flatters us).
`--short` adds a cache filled only to budget + sink + local. Random keys and
queries attend almost uniformly; `--sharpness` scales the queries (logits' spread) so that an
adaptive budget has something to trim (3.25: 0.95 of a random 16K pool's mass in ~85% of a
4096 budget, as SmolLM2 kept at 2K, 1/8).

    python bench/kernel_step.py --out DIR             # H200: about 4 minutes
    python bench/kernel_step.py --contexts 32768 --batches 1
    python bench/kernel_step.py --contexts 131072 --plans prism-g4 prism-g4-mass0.95 --sharpness 3.25
    python bench/kernel_step.py --contexts 131072 --batches 1 --dense-in-step bench/results/profile-step-2026-12-06-b1.json
    python bench/kernel_step.py --smoke                # CPU, TRITON_INTERPRET=1, tiny shapes, prints only
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]

HQ, HKV, D = 32, 8, 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--budget", type=int, default=4096, help="tokens chosen by score per KV head")
    p.add_argument("--sink", type=int, default=128)
    p.add_argument("--local", type=int, default=128)
    p.add_argument("--rho", type=float, default=4.0, help="prism pool = rho * budget")
    p.add_argument("--layers", type=int, default=4, help="distinct layers cycled per step")
    p.add_argument("--short", action="store_true", help="also a cache filled to budget + sink + local")
    p.add_argument("--repeat", type=int, default=1, help="measure each shape this many times (medians reported)")
    p.add_argument("--plans", nargs="+", default=["hash", "prism-g4", "prism-g4-hash"],
                   choices=["hash", "prism-g4", "prism-g4-hash", "prism-g4-int2refine", "prism-g4-mass0.95"])
    p.add_argument("--sharpness", type=float, default=1.0, help="query scale: the spread of the attention logits")
    p.add_argument("--dense-in-step", nargs="+", default=[], metavar="JSON",
                   help="bench/profile_step.py results: dense attention's kernel time per layer inside the compiled step "
                   "at their shape, for a second ratio")
    p.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes; prints only")
    p.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=INT",
                   help="launch constants of sparse_fx.lowering.kernels, read at launch: e.g. select.WIDE_CAP=16 "
                   "int2.POOL_CODES_AHEAD=0 int2.POOL_BLOCK_L=128")
    benchlib.add_out(p)
    return p.parse_args(argv)


ARGS = parse_args()
DEV = "cpu" if ARGS.smoke else "cuda"
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
from benchlib.layers import OPS, Layers, fastest, int2_key_bytes, step_floor_bytes  # noqa: E402

from sparse_fx.lowering import reference as ref  # noqa: E402

for _knob in ARGS.set:
    benchlib.set_kernel_constant(_knob)

T0 = time.perf_counter()


# ------------------------------------------------------------------------------------ steps
class Steps:
    """Each plan's decode step over the NL layers, as the compiled graph runs it."""

    def __init__(self, st: Layers, a):
        self.st, self.a = st, a
        self.pool = round(a.rho * a.budget)
        self.win = a.sink + a.local

    def hash(self):
        st, a = self.st, self.a
        out = []
        for i in range(st.nl):
            q_logits = (st.q[i] @ st.proj)[:, :, 0]
            idx = OPS.hash_select(q_logits, st.sig[i], st.pos, a.budget, a.sink, a.local, st.mask, None)
            out.append(OPS.sparse_decode_attention(st.q[i], st.k[i], st.v[i], idx, None, st.mask))
        return out

    def prism(self, proposal: str = "int2", mass: float = 1.0, refine: str = "exact"):
        """One group: layer 0 proposes, layers 1..3 refine (their K/V: layer j % NL); mass < 1 trims
        the refined layers' selections (the adaptive budget); refine="int2" ranks the pool by the
        refined layer's INT2 keys."""
        st, a = self.st, self.a
        if proposal == "hash":
            q_logits = (st.q[0] @ st.proj)[:, :, 0]
            ranked, own = OPS.hash_select_nested(q_logits, st.sig[0], st.pos, self.pool, a.budget, a.sink, a.local,
                                                 st.mask, None)
        else:
            scores = OPS.int2_scores(st.q[0], *st.int2[0], st.pos)
            ranked, own = OPS.select_nested(scores, st.pos, self.pool, a.budget, a.sink, a.local, st.mask, None)
        pool = ranked[:, :, self.win:]
        idx = [own]
        for j in (1, 2, 3):
            i = j % st.nl
            if refine == "int2":
                scores = OPS.int2_scores(st.q[i], *st.int2[i], st.pos, pool)
                idx.append(OPS.select_topk(scores, st.pos, a.budget, a.sink, a.local, st.mask, pool, None))
            else:
                idx.append(OPS.mass_select(st.q[i], st.k[i], None, st.mask, pool, st.pos, a.budget, a.sink, a.local, None,
                                           mass))
        self.refined = idx[1:]
        return [OPS.sparse_decode_attention(st.q[j % st.nl], st.k[j % st.nl], st.v[j % st.nl], x, None, st.mask)
                for j, x in enumerate(idx)]

    def prism_hash(self):
        return self.prism("hash")

    def prism_mass(self):
        return self.prism(mass=0.95)

    def prism_int2refine(self):
        return self.prism(refine="int2")

    def refined_kept(self) -> float:
        """Mean tokens a refined layer chose by score in the last Prism step (besides the window)."""
        return statistics.mean(float((x[..., self.win:] >= 0).sum(-1).double().mean()) for x in self.refined)

    def plans(self, names):
        """(plan, its step, the layers one call covers): a hash step covers every layer, a Prism step one group."""
        return tuple((plan, getattr(self, PLANS[plan]), self.st.nl if plan == "hash" else 4) for plan in names)


PLANS = {"hash": "hash", "prism-g4": "prism", "prism-g4-hash": "prism_hash", "prism-g4-int2refine": "prism_int2refine",
         "prism-g4-mass0.95": "prism_mass"}  # plan -> its Steps method


# ------------------------------------------------------------------------------------ bytes
def kernel_bytes(B: int, L: int, filled: int, a) -> dict[str, float]:
    """Bytes each kernel must move per call (reads + writes) at this shape, by design: the rows
    it scans, the keys it writes and reads back, the K/V rows it gathers."""
    R = B * HKV
    n = filled  # scans stop at the query
    K = a.budget + a.sink + a.local
    P = round(a.rho * a.budget)
    return {
        "_hash_keys_kernel": R * n * (4 + 1 + 1) + B * n,  # signatures, keys written; the mask row
        "_hist_kernel": R * n * 2,  # keys (1-2 bytes) read back
        "_select_kernel": R * n * 2 + R * K * 4,
        "_int2_scores_kernel": R * n * (int2_key_bytes(D) + 4),  # codes, fp16 scale/zero, fp32 score
        "_int2_pool_scores_kernel": R * P * (4 + int2_key_bytes(D) + 4),  # the pool's slots, their INT2, scores
        "_score_keys_kernel": R * n * (4 + 2) + B * n,
        "_mass_logits_kernel": R * P * (2 * D + 8 + 4 * HQ // HKV),  # pool K rows, positions, logits scratch
        # a proposal's inner list: the pool's positions twice, its keys gathered, written and read 3 times; the list
        "_row_select_kernel": R * P * (4 + 4 + 2 + 2 + 3 * 2) + R * K * 4,
        "_sparse_attn_kernel": R * K * (2 * 2 * D + 4),  # gathered K and V rows, indices
        "_combine_kernel": B * HQ * D * 2,
    }


# ------------------------------------------------------------------------------------ runs
def measure_shape(L: int, B: int, filled: int, a, copy: float) -> dict:
    dev = torch.device(DEV)
    st = Layers(B, L, a.layers, dev, HQ, HKV, D, filled)
    st.q = [q * a.sharpness for q in st.q]
    steps = Steps(st, a)
    row = dict(context=L, filled=filled, batch=B, layers=st.nl)
    row["dense_backends_ms"] = st.dense_times(benchlib.time_graph, cpu=a.smoke)
    pick_dense(row)
    kv = 2 * B * HKV * L * D * 2
    row["dense_gbps"] = kv / row["dense_ms"] / 1e6
    per = kernel_bytes(B, L, filled, a)
    for plan, fn, layers in steps.plans(a.plans):
        ms = benchlib.time_graph(fn) / layers
        fn()
        kept = steps.refined_kept() if plan.startswith("prism") else a.budget
        kernels = []
        for name, (us, launches) in sorted(benchlib.kernel_times(fn).items(), key=lambda kv_: -kv_[1][0]):
            b = per.get(name)
            if b is not None:
                b = b * launches / layers
            rec = dict(kernel=name, us=us / layers, launches=launches / layers)
            if b is not None:
                rec.update(bytes=b, gbps=b / (us / layers) / 1e3, copy_fraction=b / (us / layers) / 1e3 / copy)
            kernels.append(rec)
        floor = step_floor_bytes(plan.split("-mass")[0], B * HKV, filled, a.budget + a.sink + a.local,
                                 round(a.rho * a.budget), D, refined_kept=kept + a.sink + a.local)
        row[plan] = dict(ms=ms, speedup=row["dense_ms"] / ms, kernels=kernels, refined_kept=kept, speedups=speedups(row, ms),
                         launches_per_layer=sum(k["launches"] for k in kernels),
                         floor_bytes=floor, floor_ms=floor / copy / 1e6,
                         ceiling_speedup=row["dense_ms"] / (floor / copy / 1e6))
    del st, steps
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return row


ATTENTION_KERNEL = ("sdpa", "flash", "fmha", "attn", "attention")  # dense attention's kernels, by name


def dense_in_step(paths: list[str]) -> dict[tuple[int, int], dict]:
    """{(context, batch): dense attention in the compiled step} from profile_step results: the
    `dense-gqa` row's attention kernels (split and combine, if any), us per layer, and the card."""
    out = {}
    for path in paths:
        report = json.loads(Path(path).read_text())
        args = report["meta"]["args"]
        for row in report["rows"]:
            if row.get("method") != "dense-gqa" or "kernels" not in row:
                continue
            attention = [k for k in row["kernels"] if any(w in k["kernel"].lower() for w in ATTENTION_KERNEL)]
            if attention:
                out[(args["context"], args["batch"])] = dict(us=sum(k["us_per_layer"] for k in attention),
                                                            kernels=[k["kernel"] for k in attention],
                                                            gpu=report["meta"].get("gpu"), source=str(path))
    return out


def with_dense_in_step(row: dict, plans: list[str], known: dict) -> None:
    """Each plan's ratio against dense attention inside the compiled step, where a profile has the shape."""
    step = known.get((row["context"], row["batch"])) if row["filled"] == row["context"] else None
    if step is None:
        return
    row["dense_in_step"] = step
    for plan in plans:
        row[plan]["speedup_in_step"] = step["us"] / (row[plan]["ms"] * 1e3)


def pick_dense(row: dict) -> None:
    """The row's dense is its fastest SDPA backend (`dense_backend`, `dense_ms`)."""
    row["dense_backend"], row["dense_ms"] = fastest(row["dense_backends_ms"])


def speedups(row: dict, ms: float) -> dict[str, float]:
    """A plan's step time against each dense backend's (the headline `speedup` is against the fastest)."""
    return {name: dense / ms for name, dense in row["dense_backends_ms"].items()}


def median_rows(runs: list[dict]) -> dict:
    """The median over repeated measurements of one shape (per plan and per kernel; dense per backend)."""
    out = dict(runs[0])
    out["dense_backends_ms"] = {name: statistics.median(r["dense_backends_ms"][name] for r in runs)
                                for name in runs[0]["dense_backends_ms"]}
    pick_dense(out)
    for plan in (p for p in PLANS if p in runs[0]):
        out[plan] = dict(runs[0][plan])
        out[plan]["ms"] = statistics.median(r[plan]["ms"] for r in runs)
        out[plan]["speedup"] = out["dense_ms"] / out[plan]["ms"]
        out[plan]["speedups"] = speedups(out, out[plan]["ms"])
        out[plan]["runs_ms"] = [r[plan]["ms"] for r in runs]
    out["dense_runs_ms"] = [r["dense_ms"] for r in runs]
    return out


def run_gpu(a) -> dict:
    res = dict(meta=benchlib.header(a), config=dict(heads=HQ, kv_heads=HKV, head_dim=D, budget=a.budget, sink=a.sink,
                                                     local=a.local, rho=a.rho, dtype="bfloat16", sharpness=a.sharpness),
               rows=[])
    shapes = [(L, B, L) for L in a.contexts for B in a.batches]
    if a.short:
        filled = a.budget + a.sink + a.local
        shapes += [(L, B, filled) for L in a.contexts[:1] for B in a.batches]
    warm = torch.randn(1 << (10 if a.smoke else 28), device=DEV)  # clocks up before the first measurement
    for _ in range(50):
        warm.mul_(1.0)
    res["bandwidth_gbps"] = bw = benchlib.bandwidth_gbps()
    res["copy_gbps"] = copy = bw["copy"]
    print(f"# {res['meta']['gpu']}  copy {copy:.0f} GB/s (SM copy, read + written), read {bw['read']:.0f} GB/s", flush=True)
    known = dense_in_step(a.dense_in_step)
    for L, B, filled in shapes:
        row = median_rows([measure_shape(L, B, filled, a, copy) for _ in range(a.repeat)])
        with_dense_in_step(row, a.plans, known)
        res["rows"].append(row)
        print(f"L={L:>7} filled={filled:>7} B={B:>2}  dense {row['dense_ms'] * 1e3:7.1f} us ({row['dense_backend']})  "
              + "  ".join(f"{p} {row[p]['ms'] * 1e3:7.1f} us (x{row[p]['speedup']:.2f})" for p in a.plans), flush=True)
    res["wall_s"] = time.perf_counter() - T0
    return res


def markdown(res: dict) -> str:
    lines = [f"Kernel roofline, {res['meta']['gpu']} (SM copy {res['copy_gbps']:.0f} GB/s), bf16, Hq={HQ}, Hkv={HKV}, "
             f"D={D}, budget {res['config']['budget']} + {res['config']['sink']} + {res['config']['local']}; "
             f"per layer (prism-g4: group average); query sharpness {res['config'].get('sharpness', 1.0)}; "
             f"`{res['meta']['command']}`", ""]
    plans = [p for p in PLANS if p in res["rows"][0]]
    lines += ["| context | filled | batch | dense | " + " | ".join(f"{p} | x | floor x" for p in plans) + " | launches |",
              "|---|---|---|---|" + "---|---|---|" * len(plans) + "---|"]
    for r in res["rows"]:
        cells = [f"{r[p]['ms'] * 1e3:.1f} us | {r[p]['speedup']:.2f} | {r[p]['ceiling_speedup']:.1f}" for p in PLANS if p in r]
        launches = " / ".join(f"{r[p]['launches_per_layer']:.1f}" for p in PLANS if p in r)
        lines.append(f"| {r['context']} | {r['filled']} | {r['batch']} | {r['dense_ms'] * 1e3:.1f} us ({r['dense_backend']}) | "
                     + " | ".join(cells) + f" | {launches} |")
    backends = list(res["rows"][0]["dense_backends_ms"])
    lines += ["", "Dense by SDPA backend (us per layer; `x` above is against the fastest), and each plan's ratio against each:",
              "", "| context | filled | batch | " + " | ".join(backends) + " | " + " | ".join(plans) + " |",
              "|---|---|---|" + "---|" * (len(backends) + len(plans))]
    for r in res["rows"]:
        lines.append(f"| {r['context']} | {r['filled']} | {r['batch']} | "
                     + " | ".join(f"{r['dense_backends_ms'][b] * 1e3:.1f}" for b in backends) + " | "
                     + " | ".join(" / ".join(f"{r[p]['speedups'][b]:.2f}" for b in backends) for p in plans) + " |")
    in_step = [r for r in res["rows"] if "dense_in_step" in r]
    if in_step:
        lines += ["", "Against dense attention as it runs inside the compiled decode step (its kernels' us per layer, "
                  "from bench/profile_step.py; the card it ran on):", "",
                  "| context | batch | dense in the step | here | card | " + " | ".join(plans) + " |",
                  "|---|---|---|---|---|" + "---|" * len(plans)]
        for r in in_step:
            step = r["dense_in_step"]
            card = step["gpu"] if step["gpu"] == res["meta"]["gpu"] else f"{step['gpu']} (not this card: not comparable)"
            lines.append(f"| {r['context']} | {r['batch']} | {step['us']:.1f} us | {r['dense_ms'] * 1e3:.1f} us | {card} | "
                         + " | ".join(f"{r[p]['speedup_in_step']:.2f}" for p in plans) + " |")
    lines += where_plans_pay(res, plans)
    adaptive = [p for p in plans if "-mass" in p]
    if adaptive:
        lines += ["", "Tokens a refined layer chose by score (mean over rows; the fixed budget: "
                  f"{res['config']['budget']}): "
                  + "; ".join(f"{p} at {r['context']} B{r['batch']}: {r[p]['refined_kept']:.0f}" for r in res["rows"]
                              for p in adaptive)]
    read = res.get("bandwidth_gbps", {}).get("read")  # results before the read stream have none
    lines += ["", "Per kernel (us per layer, bytes it must move, achieved GB/s, share of the SM copy's bandwidth and"
              + (f" of the read stream's, {read:.0f} GB/s; a kernel that mostly reads can pass the copy" if read else "")
              + "):", "",
              "| context | batch | plan | kernel | launches | us | MB | GB/s | of copy | of read |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        for plan in (p for p in PLANS if p in r):
            for k in r[plan]["kernels"]:
                mb = f"{k['bytes'] / 1e6:.1f}" if "bytes" in k else "-"
                gb = f"{k['gbps']:.0f}" if "gbps" in k else "-"
                frac = f"{100 * k['copy_fraction']:.0f}%" if "copy_fraction" in k else "-"
                of_read = f"{100 * k['gbps'] / read:.0f}%" if read and "gbps" in k else "-"
                lines.append(f"| {r['context']} | {r['batch']} | {plan} | {k['kernel']} | {k['launches']:.2f} | "
                             f"{k['us']:.1f} | {mb} | {gb} | {frac} | {of_read} |")
    return "\n".join(lines) + "\n"


def where_plans_pay(res: dict, plans: list[str]) -> list[str]:
    """Markdown: from which full cache length each plan paid in this run, beside the points that
    min_context="auto" ships (`Method.break_even`, which the pass keeps dense below)."""
    from sparse_fx import Plan, methods

    full = [r for r in res["rows"] if r["filled"] == r["context"]]
    rows_of = {b: b * res["config"]["kv_heads"] for b in sorted({r["batch"] for r in full})}
    lines = ["", f"Where each plan pays: the shortest full cache from which every longer one ran >= {methods.PAYS}x "
             "dense here, beside the point min_context='auto' ships (below it the pass keeps dense attention):", "",
             "| plan | batch | KV rows | pays from (this run) | shipped |", "|---|---|---|---|---|"]
    for p in plans:
        plan = Plan.parse(p)
        shipped = methods.get(plan.method).break_even(plan)
        measured = methods.break_even_points({rows: {r["context"]: r[p]["speedup"] for r in full if r["batch"] == b}
                                              for b, rows in rows_of.items()})
        lines += [f"| {p} | {b} | {rows} | {measured[rows] or 'none measured'} | {shipped.get(rows, '-')} |"
                  for b, rows in rows_of.items()]
    return lines


def plot(res: dict, path) -> None:
    plt = benchlib.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for plan, style in zip((p for p in PLANS if p in res["rows"][0]), itertools.cycle(("-", "--", ":", "-."))):
        for B in sorted({r["batch"] for r in res["rows"]}):
            pts = sorted((r["context"], r[plan]["speedup"]) for r in res["rows"] if r["batch"] == B and r["filled"] == r["context"])
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=f"{plan} B={B}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("speed-up vs the fastest SDPA backend (per layer)")
    ax.set_title(f"decode step per layer, {res['meta']['gpu']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    benchlib.savefig(fig, path)


# ------------------------------------------------------------------------------------ smoke
def run_smoke(a) -> None:
    """Every plan's step through the kernel launchers on CPU (interpreter), against the reference."""
    a.budget, a.sink, a.local = 16, 4, 4
    global HQ, HKV, D
    HQ, HKV, D = 4, 2, 64
    st = Layers(1, 256, 2, torch.device("cpu"), HQ, HKV, D, filled=200)
    steps = Steps(st, a)
    from sparse_fx.lowering import kernels as K

    for name, fn, _ in steps.plans(PLANS):
        outs = fn()
        assert all(torch.isfinite(o).all() for o in outs), name
    q_logits = (st.q[0] @ st.proj)[:, :, 0]
    got = K.hash_select(q_logits, st.sig[0], st.pos, a.budget, a.sink, a.local, st.mask)
    want = ref.hash_select(q_logits, st.sig[0], st.pos, a.budget, a.sink, a.local, st.mask)
    assert torch.equal(got, want), "hash_select kernel differs from the reference"
    # the measuring and reporting paths, untimed: one tiny shape per plan, a cache filled to the window
    benchlib.time_graph = lambda fn, **_: (fn(), 1.0)[1]
    benchlib.kernel_times = lambda fn, reps=5: {"_sparse_attn_kernel": (1.0, 1), "_row_select_kernel": (1.0, 1)}
    benchlib.bandwidth_gbps = lambda: dict(copy=1.0, read=1.0)
    a.contexts, a.batches, a.layers, a.short, a.repeat, a.plans = [256], [1], 2, True, 2, list(PLANS)
    profile = dict(meta=dict(gpu="cpu", args=dict(context=256, batch=1)), rows=[dict(method="dense-gqa", kernels=[
        dict(kernel="flash_fwd_splitkv_kernel", us_per_layer=3.0), dict(kernel="flash_fwd_splitkv_combine_kernel",
                                                                          us_per_layer=1.0),
        dict(kernel="nvjet_gemm", us_per_layer=50.0)])])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "profile.json").write_text(json.dumps(profile))
        a.dense_in_step = [str(Path(tmp) / "profile.json")]
        res = run_gpu(a)
    md = markdown(res)
    assert all(p in md for p in PLANS) and "Tokens a refined layer chose" in md and "Dense by SDPA backend" in md, md
    (full,) = [r for r in res["rows"] if r["filled"] == r["context"]]
    assert full["dense_in_step"]["us"] == 4.0 and "inside the compiled decode step" in md, full.get("dense_in_step")
    assert all(full[p]["speedup_in_step"] == 4.0 / (full[p]["ms"] * 1e3) for p in PLANS), full
    assert "Where each plan pays" in md, md
    print("smoke ok: every plan's step ran through the kernels; hash_select equals the reference; the report renders "
          "(nothing written)")


def main() -> None:
    a = ARGS
    if a.smoke:
        run_smoke(a)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/kernel_step.py needs a CUDA GPU (or --smoke for the CPU interpreter check)")
    res = run_gpu(a)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    md = markdown(res)
    paths = benchlib.save(a.out, f"kernels-{stamp}", res, markdown=md, plot=lambda path: plot(res, path), keep_others=True)
    print(md.split("\n\nPer kernel")[0])
    print(f"wrote {', '.join(str(p) for p in paths)} ({time.perf_counter() - T0:.0f} s)")


if __name__ == "__main__":
    main()
