#!/usr/bin/env python
"""Quality sweep: sparse_fx plans against dense attention on SmolLM2-135M-Instruct (offline).

The command line over the quality harness (`sparse_fx.offline.harness`, which says what is measured and
how): recall@k and output error of each layer's selection, next-token agreement and cross-entropy
delta under teacher forcing, passkey retrieval; per plan x context x sparsity, where a sparse step
attends to n // s chosen tokens plus the first --sink and the last --local.

  python bench/quality_sweep.py --plans dense,oracle,hash,prism-g4,static-g4 --contexts 2048,4096,8192 --sparsity 16,32
  python bench/quality_sweep.py --contexts 512 --sparsity 1,4 --sink 32 --local 32 --decode-tokens 32 \\
      --passkey-trials 2 --depths 20,80 --tag smoke --out /tmp/q      # a few minutes
Writes <out>/quality-<tag>.json, .md and quality-<tag>-<metric>.png (default out: bench/results).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import sparse_fx
from sparse_fx.offline import harness
from sparse_fx.offline.models import load_model

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]

PLOTTED = {  # metric -> (label, where it lives in a row)
    "recall": ("recall@k of the selection", ("probes", "recall", "mean")),
    "output_error": ("relative error of the attention output", ("probes", "output_error", "mean")),
    "mass": ("attention mass kept", ("probes", "mass", "mean")),
    "kept": ("tokens chosen by score per step and KV head", ("probes", "kept", "mean")),
    "agreement": ("next-token agreement with dense", ("teacher", "agreement")),
    "ce_delta": ("cross-entropy delta vs dense (nats/token)", ("teacher", "ce_delta")),
    "passkey": ("passkey accuracy", ("passkey", "accuracy")),
}


def metric(row: dict, path: tuple) -> float | None:
    for key in path:
        row = row.get(key) if isinstance(row, dict) else None
    return row


def plot(results: dict, png: Path) -> list[Path]:
    """One figure per metric, <stem>-<metric>.png beside `png` (<stem>.png): metric vs sparsity, one
    line per plan, one panel per context; dense as a dashed level."""
    plt = benchlib.pyplot()
    rows = results["rows"]
    ns = sorted({r["context"] for r in rows})
    paths = []
    for name, (label, path) in PLOTTED.items():
        if all(metric(r, path) is None for r in rows):
            continue
        fig, axes = plt.subplots(1, len(ns), figsize=(4.2 * len(ns), 3.4), squeeze=False, sharey=True)
        for ax, n in zip(axes[0], ns):
            sub = [r for r in rows if r["context"] == n]
            for plan in dict.fromkeys(r["plan"] for r in sub):
                pts = sorted((r["sparsity"], metric(r, path)) for r in sub if r["plan"] == plan and r["sparsity"])
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=plan)
                for r in sub:
                    if r["plan"] == plan and not r["sparsity"] and metric(r, path) is not None:
                        ax.axhline(metric(r, path), color="gray", ls="--", label=f"{plan} (reference)")
            benchlib.axes(ax, "sparsity (context / budget)", title=f"context {n}")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(label)
        axes[0][-1].legend(fontsize=8)
        paths.append(benchlib.savefig(fig, png.with_name(f"{png.stem}-{name}.png")))
        plt.close(fig)
    tradeoff = tradeoff_plot(rows, png.with_name(f"{png.stem}-tradeoff.png"))
    return paths + ([tradeoff] if tradeoff else [])


def tradeoff_plot(rows: list[dict], path: Path) -> Path | None:
    """Agreement against the mean tokens chosen per step (benchlib.tradeoff), one panel per context."""
    kept, agreement = PLOTTED["kept"][1], PLOTTED["agreement"][1]
    rows = [r for r in rows if metric(r, kept) is not None and metric(r, agreement) is not None]
    if not rows:
        return None
    panels: dict = {}
    for r in rows:
        panels.setdefault(r["context"], {}).setdefault(r["plan"], []).append((metric(r, kept), metric(r, agreement)))
    return benchlib.tradeoff(path, panels, lambda plan: sparse_fx.Plan.parse(plan).mass < 1)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    d = harness.Settings()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", default=",".join(d.plans), help="comma-separated plan names (any sparse_fx plan)")
    p.add_argument("--contexts", default=",".join(map(str, d.contexts)), help="context lengths n, tokens")
    p.add_argument("--sparsity", default=",".join(map(str, d.sparsities)), help="sparsities s: budget = n // s")
    p.add_argument("--sink", type=int, default=d.sink, help="first tokens every sparse step keeps")
    p.add_argument("--local", type=int, default=d.local, help="last tokens every sparse step keeps")
    p.add_argument("--recall-k", type=int, default=d.recall_k, help="k of recall@k against the true attention top-k")
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens, help="teacher-forced sparse decode steps per window")
    p.add_argument("--windows", type=int, default=d.windows, help="held-out text windows per context")
    p.add_argument("--depths", default=",".join(map(str, d.depths)), help="passkey depths, %% of the filler")
    p.add_argument("--passkey-trials", type=int, default=d.passkey_trials, help="trials (keys) per context x depth")
    p.add_argument("--passkey-offset", type=int, default=d.passkey_offset,
                   help="last prompt tokens decoded sparsely (>= 1: the answer is always sparse)")
    p.add_argument("--answer-tokens", type=int, default=d.answer_tokens, help="greedy tokens generated per passkey trial")
    p.add_argument("--probe-passkey", action="store_true",
                   help="decode passkeys with the probing models: half the compiles, slower steps (short contexts)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for decode steps (1 is fastest on a shared 2-core machine)")
    p.add_argument("--prefill-threads", type=int, default=None, help="torch CPU threads for dense prefills")
    p.add_argument("--tag", default="full", help="names the outputs quality-<tag>.*")
    benchlib.add_out(p)
    a = p.parse_args(argv)
    if a.passkey_offset < 1 or a.decode_tokens < 1 or a.passkey_trials < 1 or a.windows < 1 or a.answer_tokens < 1:
        p.error("--passkey-offset, --decode-tokens, --passkey-trials, --windows and --answer-tokens must be >= 1")
    for plan in a.plans.split(","):
        try:
            sparse_fx.Plan.parse(plan)
        except ValueError as e:
            p.error(str(e))
    return a


def settings_from(a: argparse.Namespace) -> harness.Settings:
    return harness.Settings(plans=a.plans.split(","), contexts=ints(a.contexts), sparsities=ints(a.sparsity), sink=a.sink,
                    local=a.local, recall_k=a.recall_k, decode_tokens=a.decode_tokens, windows=a.windows,
                    depths=ints(a.depths), passkey_trials=a.passkey_trials, passkey_offset=a.passkey_offset,
                    answer_tokens=a.answer_tokens, seed=a.seed, probe_passkey=a.probe_passkey,
                    prefill_threads=a.prefill_threads)



def document(model, a: argparse.Namespace, s: harness.Settings, results: dict, argv: list[str] | None = None) -> dict:
    """What the JSON holds: the bench header, then the harness's description and numbers."""
    return {"meta": benchlib.header(a, argv), **harness.describe(model, s, a.tag, results)}


def write_outputs(doc: dict, out, tag: str) -> list[Path]:
    return benchlib.save(out, f"quality-{tag}", doc, markdown=harness.markdown(doc), plot=lambda path: plot(doc, path))


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device))
    s = settings_from(a)
    model, tok = load_model(device=device)
    script_argv = None if argv is None else [__file__, *argv]
    t0 = time.perf_counter()

    def checkpoint(rows, contexts):  # an interrupted long run keeps what it measured
        partial = {"rows": rows, "contexts": contexts, "incomplete": True, "seconds": time.perf_counter() - t0}
        write_outputs(document(model, a, s, partial, script_argv), a.out, a.tag)

    results = harness.run(model, tok, s, checkpoint=checkpoint)
    paths = write_outputs(document(model, a, s, results, script_argv), a.out, a.tag)
    print(f"wrote {', '.join(map(str, paths))} ({results['seconds'] / 60:.1f} min)")
    print(paths[1].read_text())


if __name__ == "__main__":
    main()
