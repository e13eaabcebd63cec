"""Would refined layers lose quality if they re-scored the pool by their own INT2 keys?

A Prism refined layer re-scores the proposal's pool (ρ x budget keys) with its exact keys: at 128K,
batch 16, with a pool of 16384, that re-read is 145 us a refined layer at the H200's copy
bandwidth, a third of prism-g4's kernel step (bench/NOTES.md). INT2 keys are 48 bytes a key
against 256. `prism-g4-int2refine` (`refine="int2"`) keeps INT2 side caches in every sparse layer
and ranks a refined layer's pool by max over the group of <q, INT2 key> (as the proposal ranks its
own budget within the pool) instead of by exact mass. This compares the two by teacher-forced
agreement (`sparse_fx.offline.agreement`, as bench/teacher_agreement.py measures it) on the offline
SmolLM2, against the oracle, with uniform roles and the shipped calibrated ones.

    python bench/refine_by_int2.py --contexts 2048,4096 --windows 4 --span 128
Writes <out>/refine-by-int2.json and .md.
"""

from __future__ import annotations

import argparse
import time

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]

PLANS = ["oracle", "prism-g4", "prism-g4-uniform", "prism-g4-int2refine-uniform", "prism-g4-int2refine"]


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"Refined layers ranking the pool by INT2 keys (`-int2refine`) against exact mass, SmolLM2, "
             f"{benchlib.where(m)}, `{m['command']}`; agreement with dense ± one standard error over windows", "",
             "| context | plan | agreement | of oracle | CE delta | tokens kept |", "|---|---|---|---|---|---|"]
    for cell in report["cells"]:
        for name, r in cell["plans"].items():
            a = r["agreement"]
            lines.append(f"| {cell['context']} | {name} | {a['mean'] * 100:.2f} ± {a['stderr'] * 100:.2f}% | "
                         f"{r.get('agreement_of_oracle', float('nan')) * 100:.1f}% | {r['ce_delta']['mean']:+.4f} | "
                         f"{r['kept']['mean']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="2048,4096")
    p.add_argument("--sparsity", type=int, default=16)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--span", type=int, default=128)
    p.add_argument("--device", default="cpu")
    benchlib.add_out(p)
    a = p.parse_args()

    from sparse_fx.offline import agreement
    from sparse_fx.offline.models import load_model

    model, tok = load_model("smollm2", device=a.device)
    plans = agreement.plans_of(PLANS, [])  # prism-g4 and prism-g4-int2refine take the shipped calibrated roles
    t0 = time.perf_counter()
    cells = [agreement.evaluate(model, tok, plans, int(n), a.sparsity, a.windows, a.span) for n in a.contexts.split(",")]
    report = {"meta": benchlib.header(a), "cells": cells, "wall_s": time.perf_counter() - t0}
    benchlib.save(a.out, "refine-by-int2", report, markdown=markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
