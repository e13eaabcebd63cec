#!/usr/bin/env python
"""Learned HashAttention signatures vs LSH on SmolLM2-135M-Instruct (offline; CPU, or a GPU with --device).

1. Train 32-bit encoders with the defaults of `sparse_fx.train_signatures` on the training split
   (timed), then variants on the same tokens: the paper's recipe (per-query-head labels and loss,
   no sink/local exclusion), per-query-head keys, and the defaults at each --also-train-at length
   (fewer, longer windows). Saved beside --encoders as <dir>-paper-recipe and <dir>-trained-at-<n>,
   for bench/teacher_agreement.py.
2. Selection recall@32 on held-out windows at each context and sparsity: the top n/s keys by
   Hamming similarity (a KV head's query heads summed) against each query head's true top-32, for
   learned 32-bit, LSH 32/128/256-bit, and the exact attention-mass oracle; then again with the
   plan's sink and local keys always kept, the score choosing only among the keys between them.
3. Model level, through the quality harness (`sparse_fx.offline.harness`): next-token agreement and
   cross-entropy delta vs dense for oracle, LSH and learned hash (a plan file with the encoders).

    python bench/learned_signatures.py --device cuda --skip-harness   # minutes on a GPU; over an hour on 2 CPU cores
Writes <out>/signatures.json, signatures.md and signatures-recall.png; the encoders go to
--encoders (default ~/.cache/sparse_fx/encoders/smollm2-b32, not committed: weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

import sparse_fx
from sparse_fx.offline import harness
from sparse_fx.offline.data import token_windows
from sparse_fx.lowering.reference import hamming_scores, pack_signs
from sparse_fx.offline.models import cache_root, load_model
from sparse_fx.runtime.encoders import apply_head_mlp, lsh_layer
from sparse_fx.offline.train import WINDOWS, TrainConfig, capture_windows, oracle_scores, selection_recall

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]



def hamming_fn(layers):
    """score_fn for selection_recall: summed Hamming similarity of each KV head's query heads."""

    def score(layer, q, k, positions):
        enc = layers[layer]
        enc = type(enc)(query=enc.query.to(q.device), key=enc.key.to(q.device))
        q_sig = pack_signs(apply_head_mlp(q[None], *enc.query.params()))[0]  # [Hq,S,W]
        if enc.key.heads != k.shape[0]:  # per-query-head key encoders: each query head signs the keys itself
            k = k.repeat_interleave(enc.key.heads // k.shape[0], 0)
        k_sig = pack_signs(apply_head_mlp(k[None], *enc.key.params()))  # [1,Hk,T,W]
        out = [hamming_scores(q_sig[:, s][None], k_sig)[0] for s in range(q_sig.shape[1])]
        return torch.stack(out, 1).float()

    return score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--sparsity", default="16,32")
    ap.add_argument("--heldout-windows", type=int, default=2, help="held-out windows per context for recall")
    ap.add_argument("--train-windows", type=int, default=WINDOWS,
                    help="default: train_signatures'")
    ap.add_argument("--steps", type=int, default=None, help="default: TrainConfig's")
    ap.add_argument("--train-context", type=int, default=None, help="default: TrainConfig's (train at the deployed length)")
    ap.add_argument("--also-train-at", default="2048,4096",
                    help="contexts to train more encoders at (same tokens: fewer, longer windows), recall only; '' for none")
    ap.add_argument("--harness-sparsity", default=None, help="sparsities of the model-level part (default: --sparsity)")
    ap.add_argument("--encoders", default=str(cache_root() / "encoders" / "smollm2-b32"))
    ap.add_argument("--harness-contexts", default=None, help="contexts of the model-level part (default: --contexts)")
    ap.add_argument("--skip-harness", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the harness part runs on the CPU only)")
    benchlib.add_out(ap, render=True)
    a = ap.parse_args()
    if a.render:
        report = benchlib.load(a.out, "signatures")
        save(report, report["selection_recall_at_32"], a.out)
        return
    torch.manual_seed(0)
    if a.device != "cpu" and not a.skip_harness:
        ap.error("--device other than cpu needs --skip-harness (bench/teacher_agreement.py measures the model level on a GPU)")
    model, tok = load_model(device=a.device)
    contexts = [int(x) for x in a.contexts.split(",")]
    fractions = [1 / int(x) for x in a.sparsity.split(",")]
    overrides = {k: v for k, v in (("steps", a.steps), ("context", a.train_context)) if v}
    cfg = TrainConfig(**overrides)
    report = {"meta": benchlib.header(a), "train_config": dataclasses.asdict(cfg)}

    def train(name: str, cfg: TrainConfig, windows: int, out: str | None) -> list:
        """Train one variant on the train split (same tokens for every variant); save it to `out`."""
        enc = sparse_fx.train_signatures(model, tokenizer=tok, windows=windows, **dataclasses.asdict(cfg))
        m = enc.metadata
        report["train"][name] = {"config": m["train_config"], "windows": windows, "capture_s": m["capture_seconds"],
                                 "total_s": m["train_seconds"], "loss_history": m["loss_history"], "saved_to": out}
        if out:
            enc.save(out)
        print(f"{name}: {m['train_seconds']:.0f} s (capture {m['capture_seconds']:.0f} s); "
              f"loss {m['loss_history'][0]:.4f} -> {m['loss_history'][-1]:.4f}", flush=True)
        return enc.layers

    report["train"] = {}
    learned = {"learned-32": train("learned-32", cfg, a.train_windows, a.encoders)}
    variants = {  # name -> (config changes, windows, saved beside --encoders as)
        "learned-32 paper recipe": ({"labels": "query", "sink": 0, "local": 0}, a.train_windows, "paper-recipe"),
        "learned-32 per-query-head keys": ({"labels": "query", "key_sharing": "query"}, a.train_windows, None),
        **{f"learned-32 trained at {n}": ({"context": n}, max(1, a.train_windows * cfg.context // n), f"trained-at-{n}")
           for n in [int(x) for x in a.also_train_at.split(",") if x]},
    }
    for name, (changes, windows, suffix) in variants.items():
        learned[name] = train(name, TrainConfig(**{**dataclasses.asdict(cfg), **changes}), windows,
                              f"{a.encoders}-{suffix}" if suffix else None)

    q_heads, kv_heads, d = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    lsh = {b: [lsh_layer(q_heads, kv_heads, d, b, seed=l) for l in range(model.config.num_hidden_layers)] for b in (32, 128, 256)}
    plan = sparse_fx.Plan.parse("hash")
    fixed = (plan.sink, plan.local)
    recall, recall_fixed = {}, {}
    for n in contexts:
        held = capture_windows(model, token_windows(tok, "heldout", n, a.heldout_windows, seed=1),
                               TrainConfig(**{**dataclasses.asdict(cfg), "context": n, "queries": 64}))
        scores = {"oracle": (oracle_scores, False)}
        for name, layers in learned.items():
            scores[name] = (hamming_fn(layers), name.endswith("per-query-head keys"))
        for b, layers_b in lsh.items():
            scores[f"lsh-{b}"] = (hamming_fn(layers_b), False)
        for table, kept in ((recall, (0, 0)), (recall_fixed, fixed)):
            table[n] = {name: {f"1/{round(1 / f)}": v for f, v in
                               selection_recall(held, fn, fractions, per_query_head=pq, fixed=kept).items()}
                        for name, (fn, pq) in scores.items()}
            print(n, kept, json.dumps(table[n]), flush=True)
    report["selection_recall_at_32"] = recall
    report["selection_recall_at_32_plan_windows"] = {"sink": fixed[0], "local": fixed[1], "recall": recall_fixed}
    save(report, recall, a.out)

    if not a.skip_harness:
        plan_file = Path(a.encoders) / "plan.json"
        sparse_fx.Plan.parse("hash", encoders=a.encoders).save(plan_file)
        harness_contexts = [int(x) for x in a.harness_contexts.split(",")] if a.harness_contexts else contexts
        settings = harness.Settings(plans=["dense", "oracle", "hash", "hash-b256", str(plan_file)], contexts=harness_contexts,
                                    sparsities=[int(x) for x in (a.harness_sparsity or a.sparsity).split(",")],
                                    passkey_trials=0, depths=[])
        report["harness"] = harness.run(model, tok, settings)
        save(report, recall, a.out)
    print(markdown(report))


def save(report: dict, recall: dict, out: Path) -> None:
    benchlib.save(out, "signatures", report, markdown=markdown(report), plot=lambda png: plot(recall, png))


def recall_table(rec: dict) -> list[str]:
    """Markdown rows of context -> method -> sparsity -> recall."""
    names = list(next(iter(rec.values())))
    lines = ["| context | sparsity | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for n, row in rec.items():
        for f in row[names[0]]:
            lines.append(f"| {n} | {f} | " + " | ".join(f"{row[name][f]:.3f}" for name in names) + " |")
    return lines


def markdown(report: dict) -> str:
    lines = ["Selection recall@32 (top n/s keys by score vs each query head's true top-32), held-out text:", "",
             *recall_table(report["selection_recall_at_32"])]
    if "selection_recall_at_32_plan_windows" in report:
        w = report["selection_recall_at_32_plan_windows"]
        lines += ["", f"The same with the plan's first {w['sink']} and last {w['local']} keys kept on top of the budget "
                  "(what the `hash` plan serves; the score decides only among the keys between them):", "",
                  *recall_table(w["recall"])]
    c = report["train_config"]
    lines += ["", f"Training (`{report['meta']['command']}`; {benchlib.where(report['meta'])}; {c['steps']} Adam steps of "
              f"{c['batch_queries']} queries x {c['batch_keys']} keys), each variant on the same tokens:", "",
              "| encoders | windows x tokens | capture | total | loss (first step -> last tenth) |", "|---|---|---|---|---|"]
    for name, t in report["train"].items():
        lines.append(f"| {name} | {t['windows']} x {t['config']['context']} | {t['capture_s']:.0f} s | {t['total_s']:.0f} s | "
                     f"{t['loss_history'][0]:.4f} -> {t['loss_history'][-1]:.4f} |")
    if "harness" in report:
        lines += ["", "Model level (the quality harness, teacher forcing over held-out text; budget n/s + 128 + 128):", "",
                  "| plan | context | sparsity | agreement | CE delta | recall@32 |", "|---|---|---|---|---|---|"]
        for r in report["harness"]["rows"]:
            rec = r["probes"].get("recall", {}).get("mean")
            name = "hash (learned 32-bit)" if str(r["plan"]).endswith(".json") else r["plan"]
            lines.append(f"| {name} | {r['context']} | {('1/' + str(r['sparsity'])) if r['sparsity'] else '-'} | "
                         f"{r['teacher']['agreement']:.1%} | {r['teacher']['ce_delta']:+.4f} | "
                         f"{'-' if rec is None else f'{rec:.3f}'} |")
    return "\n".join(lines) + "\n"


def plot(recall: dict, png: Path) -> list[Path]:
    """Recall@32 vs context, one panel per sparsity; written as <stem>-recall.png beside `png`."""
    plt = benchlib.pyplot()
    recall = {int(n): v for n, v in recall.items()}  # JSON turned the context keys into strings
    names = list(next(iter(recall.values())))
    fracs = list(next(iter(recall.values()))[names[0]])
    fig, axes = plt.subplots(1, len(fracs), figsize=(5 * len(fracs), 4), squeeze=False)
    for ax, f in zip(axes[0], fracs):
        for name in names:
            ax.plot(list(recall), [recall[n][name][f] for n in recall], marker="o", label=name)
        benchlib.axes(ax, "context (tokens)", "recall@32", f"sparsity {f}")
    axes[0][0].legend(fontsize=8)
    return [benchlib.savefig(fig, png.with_name(f"{png.stem}-recall.png"))]


if __name__ == "__main__":
    main()
