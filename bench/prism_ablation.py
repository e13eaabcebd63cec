#!/usr/bin/env python
"""Prism's ablation on SmolLM2-135M-Instruct (offline, CPU): index sharing with and without
refinement, with uniform and calibrated layer roles, group-4 and group-9, rho and budget sweeps.

1. Calibrate roles (`sparse_fx.calibrate` with its default objective, the attention mass the pools
   keep; training split, at the deployed length) for prism and static at group 4 and 9; the plans
   are written to <out>/plans/.
2. Main table through the quality harness (held-out text, contexts 4K and 8K, sparsity 16):
   per-layer INT2 selection (prism-g1: every layer proposes), static reuse and proposal-refine,
   uniform and calibrated, group 4 and 9: next-token agreement, cross-entropy delta, pool recall,
   passkey accuracy.
3. Sweeps without passkey: rho in {1, 2, 4, 8} and sparsity {8, 16, 32} for calibrated prism-g4.

    python bench/prism_ablation.py            # several hours on 2 CPU cores; --quick for a smoke run
Writes <out>/prism-ablation.json / .md / .png (calibrated plans in <out>/plans/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import sparse_fx
from sparse_fx import harness
from sparse_fx.models import load_model

import benchlib  # bench/benchlib.py: a script's own folder is sys.path[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,8192", help="contexts of the main table and the sweeps")
    ap.add_argument("--sparsity", type=int, default=16, help="budget = context // sparsity")
    ap.add_argument("--calib-context", type=int, default=4096, help="tokens per calibration window (the deployed length)")
    ap.add_argument("--calib-windows", type=int, default=16, help="calibration windows (training split)")
    ap.add_argument("--calib-steps", type=int, default=64, help="decode positions per calibration window (the last ones)")
    ap.add_argument("--objective", choices=("mass", "ce"), default="mass", help="calibration objective (sparse_fx.calibrate)")
    ap.add_argument("--passkey-trials", type=int, default=10, help="passkey trials per depth (main table)")
    ap.add_argument("--decode-tokens", type=int, default=256, help="teacher-forced sparse decode steps per window")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline in minutes")
    benchlib.add_out(ap, render=True)
    a = ap.parse_args()
    if a.render:
        report = benchlib.load(a.out, "prism-ablation")
        print(save(report, a.out, final=report.get("complete", False)))
        return
    if a.quick:
        a.contexts, a.calib_context, a.calib_windows, a.calib_steps = "1024", 1024, 1, 4
        a.passkey_trials, a.decode_tokens = 1, 16
    contexts = [int(x) for x in a.contexts.split(",")]
    out = a.out
    plans_dir = out / "plans"
    plans_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_model()
    report = {"meta": benchlib.header(a)}

    # 1. calibration: budget at the table's sparsity for the calibration context
    budget = a.calib_context // a.sparsity
    calibrated, timings = {}, {}
    for method in ("prism", "static"):
        for group in (4, 9):
            t0 = time.perf_counter()
            plan = sparse_fx.calibrate(model, tokenizer=tok, method=method, group=group, context=a.calib_context,
                                       windows=a.calib_windows, steps=a.calib_steps, objective=a.objective, budget=budget,
                                       sink=128, local=128)
            timings[f"{method}-g{group}"] = time.perf_counter() - t0
            path = plans_dir / f"smollm2-{method}-g{group}-calibrated.json"
            plan.save(path)
            calibrated[(method, group)] = str(path)
            print(f"{plan.note}  ({timings[f'{method}-g{group}']:.0f} s)\n  roles: {''.join(r[0].upper() for r in plan.roles)}",
                  flush=True)
    report["calibration_seconds"] = timings
    report["calibrated_roles"] = {k: "".join(r[0].upper() for r in sparse_fx.Plan.load(v).roles) for k, v in
                                  {f"{m}-g{g}": p for (m, g), p in calibrated.items()}.items()}

    # 2. main table
    main_plans = ["dense", "prism-g1"]
    for group in (4, 9):
        main_plans += [f"static-g{group}", calibrated[("static", group)], f"prism-g{group}", calibrated[("prism", group)]]
    s = harness.Settings(plans=main_plans, contexts=contexts, sparsities=[a.sparsity], passkey_trials=a.passkey_trials,
                   decode_tokens=a.decode_tokens)
    report["main"] = harness.run(model, tok, s)
    save(report, out, final=False)

    # 3. sweeps on calibrated prism-g4 (and its static twin for the budget sweep)
    base = sparse_fx.Plan.load(calibrated[("prism", 4)])
    rho_plans = []
    for rho in (1.0, 2.0, 4.0, 8.0):
        path = plans_dir / f"smollm2-prism-g4-calibrated-rho{int(rho)}.json"
        dataclasses.replace(base, rho=rho).save(path)
        rho_plans.append(str(path))
    s = harness.Settings(plans=rho_plans, contexts=contexts, sparsities=[a.sparsity], passkey_trials=0, depths=[],
                   decode_tokens=a.decode_tokens)
    report["rho_sweep"] = harness.run(model, tok, s)
    save(report, out, final=False)
    s = harness.Settings(plans=[calibrated[("prism", 4)], calibrated[("static", 4)]], contexts=contexts,
                   sparsities=[8, 16, 32], passkey_trials=0, depths=[], decode_tokens=a.decode_tokens)
    report["budget_sweep"] = harness.run(model, tok, s)

    print(save(report, out, final=True))


def save(report: dict, out: Path, final: bool) -> str:
    """Write the JSON and table after each section, so that an interrupted run keeps its numbers."""
    report["complete"] = final
    md = markdown(report)  # plan files in it and in the JSON become repo-relative (benchlib.save)
    benchlib.save(out, "prism-ablation", report, markdown=md, plot=(lambda png: plot(report, png)) if final else None)
    return md


def _rows(section: dict):
    """(plan label, context, sparsity, row) of a harness result, whatever its nesting."""
    for row in section.get("rows", []):
        yield row


def label(plan: str) -> str:
    """A plan file's name without the directory (smollm2-prism-g4-calibrated), a plan name as is."""
    return Path(plan).stem.removeprefix("smollm2-") if plan.endswith(".json") else plan


def markdown(report: dict) -> str:
    def cell(row, *path, fmt="{:.3f}"):
        v = row
        for p in path:
            v = v.get(p, {}) if isinstance(v, dict) else {}
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    lines = ["Main ablation (held-out text; budget n/16 + 128 sink + 128 local; rho 4):", "",
             "| plan | context | agreement | CE delta | pool recall | recall@32 | passkey |", "|---|---|---|---|---|---|---|"]
    for row in _rows(report["main"]):
        lines.append(f"| {label(row['plan'])} | {row['context']} | {cell(row, 'teacher', 'agreement')} | "
                     f"{cell(row, 'teacher', 'ce_delta', fmt='{:+.4f}')} | {cell(row, 'probes', 'pool_recall', 'mean')} | "
                     f"{cell(row, 'probes', 'recall', 'mean')} | {cell(row, 'passkey', 'accuracy', fmt='{:.2f}')} |")
    for name in ("rho_sweep", "budget_sweep"):
        lines += ["", f"{name.replace('_', ' ')}:", "", "| plan | context | sparsity | agreement | CE delta | pool recall |",
                  "|---|---|---|---|---|---|"]
        for row in _rows(report.get(name, {})):
            lines.append(f"| {label(row['plan'])} | {row['context']} | {row.get('sparsity', '-')} | {cell(row, 'teacher', 'agreement')} | "
                         f"{cell(row, 'teacher', 'ce_delta', fmt='{:+.4f}')} | {cell(row, 'probes', 'pool_recall', 'mean')} |")
    lines += ["", "Calibrated roles (P = proposal, R = refined): " +
              "; ".join(f"{k}: {v}" for k, v in report["calibrated_roles"].items())]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    plt = benchlib.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in _rows(report["rho_sweep"]) if isinstance(r.get("teacher"), dict)]
    for ctx in sorted({r["context"] for r in rows}):
        pts = sorted((float(json.loads((benchlib.ROOT / r["plan"]).read_text())["rho"]) if str(r["plan"]).endswith(".json") else 0,
                      r["teacher"]["agreement"]) for r in rows if r["context"] == ctx)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"context {ctx}")
    benchlib.axes(ax, "rho (pool = rho x budget)", "next-token agreement with dense", "calibrated prism-g4, sparsity 16")
    ax.legend()
    benchlib.savefig(fig, path)


if __name__ == "__main__":
    main()
