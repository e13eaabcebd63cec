#!/usr/bin/env python
"""Next-token agreement and cross-entropy delta vs dense over many tokens: teacher forcing in one pass.

The command line over `sparse_fx.offline.agreement` (which says what is measured and how): every
plan selects through the product's own ops, in one masked forward pass per window; with
--passkey-trials, teacher-forced pass keys too; --merge combines the cells of earlier results.

--plans takes plan names and plan files, as bench/quality_sweep.py does; `--encoders DIR` adds a
learned row, per DIR, of every signature plan in --plans (hash, prism-g<G>-hash) of its width.

    python bench/teacher_agreement.py --contexts 2048,4096,8192 --windows 8 --encoders ~/.cache/sparse_fx/encoders/smollm2-b32
    python bench/teacher_agreement.py --plans oracle,hash,prism-g4,static-g4,prism-g4-hash,bench/results/plans/smollm2-prism-g4-calibrated-mass.json \\
        --sparsity 16,32 --windows 16 --span 256
Writes <out>/agreement.json, .md and .png (agreement-<tag>.* with --tag).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparse_fx.offline.agreement import evaluate, merge, passkey, plans_of
from sparse_fx.offline.models import load_model

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default=None, help="comma-separated plan names or plan files (any sparse_fx plan; default "
                    "oracle,hash,hash-b256); with --merge, the rows to keep (default: all)")
    ap.add_argument("--encoders", nargs="*", default=[],
                    help="encoder directories: each adds a learned row of every signature plan in --plans of its width")
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--sparsity", default="16")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows per context")
    ap.add_argument("--span", type=int, default=1024, help="positions scored per window (the last ones)")
    ap.add_argument("--passkey-trials", type=int, default=0, help="pass-key trials per depth and cell (0: none)")
    ap.add_argument("--depths", default="10,25,50,75,90", help="pass-key depths, percent")
    ap.add_argument("--passkey-sparsity", default="", help="sparsities that get pass keys (default: all of --sparsity)")
    ap.add_argument("--refresh", default="1", help="selections shared across steps: s = 1,2,4,... (a row per plan and s > 1, "
                    "'<plan> refresh=<s>': a step reads the selection of the last step that was a multiple of s, plus its window)")
    ap.add_argument("--pool-refresh", default="", help="proposals shared across steps: s = 2,4,... (a row per plan whose "
                    "refined layers re-score a proposal's pool, and s, '<plan> pool-refresh=<s>': every s-th step the "
                    "proposal layers choose their pools; between, every layer re-scores the last pool with its own query)")
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    ap.add_argument("--tag", default="", help="names the outputs agreement-<tag>.* (default: agreement.*)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="combine the cells of these results into --out/agreement-<tag>.*")
    benchlib.add_out(ap)
    a = ap.parse_args()
    stem = f"agreement-{a.tag}" if a.tag else "agreement"
    if a.merge:
        report = merge([json.loads(Path(f).read_text()) for f in a.merge], benchlib.header(a),
                       a.plans.split(",") if a.plans else None)
        benchlib.save(a.out, stem, report, markdown=markdown(report), plot=lambda png: plot(report, png))
        print(markdown(report))
        return
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device))
    try:
        plans = plans_of([p for p in (a.plans or "oracle,hash,hash-b256").split(",") if p], a.encoders)
    except ValueError as e:
        ap.error(str(e))
    contexts = [int(x) for x in a.contexts.split(",")]
    if not 0 < a.span < min(contexts) or a.windows < 1:
        ap.error(f"--span must lie in 1..{min(contexts) - 1} (below the shortest context) and --windows be >= 1")
    model, tok = load_model(device=device)
    report = {"meta": benchlib.header(a), "runs": []}
    t0 = time.perf_counter()
    sparsities = [int(x) for x in a.sparsity.split(",")]
    refresh = tuple(int(x) for x in a.refresh.split(","))
    pool_refresh = tuple(int(x) for x in a.pool_refresh.split(",") if x)
    keyed = [int(x) for x in a.passkey_sparsity.split(",")] if a.passkey_sparsity else sparsities
    for n in contexts:
        for sp in sparsities:
            run = evaluate(model, tok, plans, n, sp, a.windows, a.span, progress=True, refresh=refresh,
                           pool_refresh=pool_refresh)
            if a.passkey_trials and sp in keyed:
                run["passkey"] = passkey(model, tok, plans, n, sp, [int(d) for d in a.depths.split(",")], a.passkey_trials,
                                         progress=True, refresh=refresh, pool_refresh=pool_refresh)
            report["runs"].append(run)
            report["seconds"] = time.perf_counter() - t0
            benchlib.save(a.out, stem, report, markdown=markdown(report))  # a run cut short keeps its cells
            print(markdown(report), flush=True)
    benchlib.save(a.out, stem, report, markdown=markdown(report), plot=lambda png: plot(report, png))
    print(markdown(report))


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"Teacher-forced agreement with dense (`{meta['command']}`; {benchlib.where(meta)}, torch {meta['versions']['torch']}, "
             f"{meta['date'][:10]}): mean over windows ± standard error; budget n/s + sink + local; kept: tokens chosen by score per step and KV head "
             "(the budget; fewer under -mass<p>), mean over sparse layers.", "",
             "| context | sparsity | plan | tokens | kept | agreement | of oracle | CE delta |", "|---|---|---|---|---|---|---|---|"]
    if "merged" in meta:
        lines[1:1] = ["", "Cells of: " + "; ".join(f"`{m['command']}` ({m['commit']})" for m in meta["merged"])]
    for run in report["runs"]:
        for name, r in run["plans"].items():
            a, c = r["agreement"], r["ce_delta"]
            lines.append(f"| {run['context']} | 1/{run['sparsity']} | {name} | {run['windows']} x {run['span']} | {r['kept']['mean']:.0f} | "
                         f"{a['mean']:.2%} ± {a['stderr']:.2%} | {r.get('agreement_of_oracle', float('nan')):.1%} | "
                         f"{c['mean']:+.4f} ± {c['stderr']:.4f} |")
    keyed = [run for run in report["runs"] if "passkey" in run]
    if keyed:
        depths = [d for d in keyed[0]["passkey"]["dense"] if d not in ("trials", "found")]
        lines += ["", f"Pass-key retrieval, teacher-forced (found: greedy decoding writes the key first), {keyed[0]['passkey']['dense']['trials']} "
                  "trials a depth:", "", "| context | sparsity | plan | " + " | ".join(f"{d}%" for d in depths) + " |",
                  "|---|---|---|" + "---|" * len(depths)]
        for run in keyed:
            for name, r in run["passkey"].items():
                lines.append(f"| {run['context']} | 1/{run['sparsity']} | {name} | " + " | ".join(f"{r[d]:.0%}" for d in depths) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> list[Path]:
    """Agreement with dense vs context, one panel per sparsity, error bars of one standard error;
    with adaptive plans (-mass<p>), also agreement against the tokens kept (<stem>-tradeoff.png)."""
    paths = [_plot_contexts(report, path)]
    panels: dict = {}
    for run in report["runs"]:
        for name, r in run["plans"].items():
            panels.setdefault(run["context"], {}).setdefault(name, []).append((r["kept"]["mean"], 100 * r["agreement"]["mean"]))
    if any("-mass" in name for series in panels.values() for name in series):
        paths.append(benchlib.tradeoff(path.with_name(f"{path.stem}-tradeoff.png"), panels, lambda name: "-mass" in name))
    return paths


def _plot_contexts(report: dict, path: Path) -> Path:
    plt = benchlib.pyplot()
    sparsities = sorted({r["sparsity"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(sparsities), figsize=(5.5 * len(sparsities), 4.2), squeeze=False)
    for ax, sp in zip(axes[0], sparsities):
        runs = [r for r in report["runs"] if r["sparsity"] == sp]
        for name in runs[0]["plans"]:
            rows = [(r["context"], r["plans"][name]["agreement"]) for r in runs if name in r["plans"]]
            ax.errorbar([n for n, _ in rows], [100 * a["mean"] for _, a in rows], yerr=[100 * a["stderr"] for _, a in rows],
                        marker="o", capsize=3, label=name)
        benchlib.axes(ax, "context (tokens)", "next-token agreement with dense (%)", f"sparsity 1/{sp}, budget n/{sp} + sink + local")
    axes[0][0].legend(fontsize=7)
    return benchlib.savefig(fig, path)


if __name__ == "__main__":
    main()
