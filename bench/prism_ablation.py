#!/usr/bin/env python
"""Prism's ablation on SmolLM2-135M-Instruct (offline; CPU or GPU): index sharing with and without
refinement, with uniform and calibrated layer roles, group-4 and group-9, rho and budget sweeps.

1. Calibrate roles (`sparse_fx.offline.calibrate`, by default the attention mass the pools keep; training
   split, at the deployed length) for prism and static at group 4 and 9; the plans are written to
   <out>/plans/.
2. Main table (held-out text, sparsity 16), measured by one-pass teacher forcing through the
   product's own selection (`sparse_fx.offline.agreement`, as bench/teacher_agreement.py):
   per-layer INT2 selection (prism-g1: every layer proposes), static reuse and proposal-refine,
   uniform (`roles="uniform"`) and calibrated, group 4 and 9: next-token agreement and
   cross-entropy delta with standard errors, teacher-forced pass keys.
3. Sweeps without pass keys: rho in {1, 2, 4, 8} for calibrated prism-g4, and sparsity {8, 16, 32}
   for calibrated prism-g4 and static-g4.

    python bench/prism_ablation.py --device cuda   # minutes on an H200; hours on 2 CPU cores; --quick: a smoke run
Writes <out>/prism-ablation.json / .md / .png (calibrated plans in <out>/plans/).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import sparse_fx
from sparse_fx.offline import agreement
from sparse_fx.offline.models import load_model

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,8192", help="contexts of the main table and the sweeps")
    ap.add_argument("--sparsity", type=int, default=16, help="budget = context // sparsity")
    ap.add_argument("--calib-context", type=int, default=4096, help="tokens per calibration window (the deployed length)")
    ap.add_argument("--calib-windows", type=int, default=16, help="calibration windows (training split)")
    ap.add_argument("--calib-steps", type=int, default=64, help="decode positions per calibration window (the last ones)")
    ap.add_argument("--objective", choices=("mass", "ce"), default="mass", help="calibration objective (sparse_fx.offline.calibrate)")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows per cell")
    ap.add_argument("--span", type=int, default=256, help="teacher-forced positions per window (the last ones)")
    ap.add_argument("--passkey-trials", type=int, default=10, help="pass-key trials per depth (main table)")
    ap.add_argument("--depths", default="10,50,90", help="pass-key depths, percent")
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline in minutes")
    benchlib.add_out(ap, render=True)
    a = ap.parse_args()
    if a.render:
        report = benchlib.load(a.out, "prism-ablation")
        print(save(report, a.out, final=report.get("complete", False)))
        return
    if a.quick:
        a.contexts, a.calib_context, a.calib_windows, a.calib_steps = "1024", 1024, 1, 4
        a.windows, a.span, a.passkey_trials, a.depths = 1, 8, 1, "50"
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device))
    contexts = [int(x) for x in a.contexts.split(",")]
    depths = [int(d) for d in a.depths.split(",")]
    out = a.out
    plans_dir = out / "plans"
    plans_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(device=device)
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
            calibrated[(method, group)] = plan
            print(f"{plan.note}  ({timings[f'{method}-g{group}']:.0f} s)\n  roles: {''.join(r[0].upper() for r in plan.options.roles)}",
                  flush=True)
    report["calibration_seconds"] = timings
    report["calibrated_roles"] = {f"{m}-g{g}": "".join(r[0].upper() for r in p.options.roles) for (m, g), p in calibrated.items()}

    def measure(plans: dict, sparsities: list[int], keys: bool) -> list[dict]:
        runs = []
        for n in contexts:
            for sp in sparsities:
                run = agreement.evaluate(model, tok, plans, n, sp, a.windows, a.span, progress=True)
                if keys:
                    run["passkey"] = agreement.passkey(model, tok, plans, n, sp, depths, a.passkey_trials, progress=True)
                runs.append(run)
        return runs

    # 2. main table
    main = {"oracle": sparse_fx.Plan.parse("oracle"), "prism-g1": sparse_fx.Plan.parse("prism-g1")}
    for group in (4, 9):
        for method in ("static", "prism"):
            main[f"{method}-g{group} uniform"] = sparse_fx.Plan.parse(f"{method}-g{group}", roles="uniform")
            main[f"{method}-g{group} calibrated"] = calibrated[(method, group)]
    report["main"] = measure(main, [a.sparsity], keys=a.passkey_trials > 0)
    save(report, out, final=False)

    # 3. sweeps on calibrated prism-g4 (and its static twin for the budget sweep)
    base = calibrated[("prism", 4)]
    report["rho_sweep"] = measure({f"rho {rho:g}": base.replace(rho=rho) for rho in (1.0, 2.0, 4.0, 8.0)},
                                  [a.sparsity], keys=False)
    save(report, out, final=False)
    report["budget_sweep"] = measure({"prism-g4 calibrated": base, "static-g4 calibrated": calibrated[("static", 4)]},
                                     [8, 16, 32], keys=False)
    print(save(report, out, final=True))


def save(report: dict, out: Path, final: bool) -> str:
    """Write the JSON and table after each section, so that an interrupted run keeps its numbers."""
    report["complete"] = final
    md = markdown(report)
    benchlib.save(out, "prism-ablation", report, markdown=md, plot=(lambda png: plot(report, png)) if final else None)
    return md


def markdown(report: dict) -> str:
    lines = ["Prism ablation (held-out text; budget n/s + 128 sink + 128 local; rho 4 unless named; mean over windows "
             "± standard error; pass keys found of the trials at each depth, teacher-forced):", "",
             "| section | context | sparsity | plan | agreement | of oracle | CE delta | pass keys |", "|---|---|---|---|---|---|---|---|"]
    for section in ("main", "rho_sweep", "budget_sweep"):
        for run in report.get(section, []):
            keys = run.get("passkey", {})
            for name, r in run["plans"].items():
                found = keys.get(name, {})
                pk = " / ".join(f"{sum(v)}" for v in found.get("found", {}).values()) or "-"
                lines.append(f"| {section.replace('_', ' ')} | {run['context']} | 1/{run['sparsity']} | {name} | "
                             f"{r['agreement']['mean']:.2%} ± {r['agreement']['stderr']:.2%} | "
                             f"{r.get('agreement_of_oracle', float('nan')):.1%} | {r['ce_delta']['mean']:+.4f} ± {r['ce_delta']['stderr']:.4f} | {pk} |")
    lines += ["", "Calibrated roles (P = proposal, R = refined): " +
              "; ".join(f"{k}: {v}" for k, v in report["calibrated_roles"].items())]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Agreement of calibrated prism-g4 against rho, one line per context."""
    plt = benchlib.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in report["rho_sweep"]:
        pts = sorted((r["plan"]["rho"], r["agreement"]["mean"]) for r in run["plans"].values())
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=f"context {run['context']}")
    benchlib.axes(ax, "rho (pool = rho x budget)", "next-token agreement with dense (%)", "calibrated prism-g4")
    ax.legend()
    benchlib.savefig(fig, path)


if __name__ == "__main__":
    main()
