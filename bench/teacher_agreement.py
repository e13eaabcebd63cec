#!/usr/bin/env python
"""Next-token agreement and cross-entropy delta vs dense over many tokens: teacher forcing in one pass.

The quality harness (`sparse_fx.harness`) decodes token by token through the compiled model: the
product's path, but about 90 s per 256 tokens of one plan at 4K on 2 CPU cores, so its model-level
numbers rest on one window of 256 tokens, where one token is 0.4%. Teacher-forced sparse decoding
is one forward pass in which each of the last `span` positions attends only to what the plan would
select for it (the first `sink` and last `local` keys up to it, and the top n/s of the rest by the
plan's score, a KV head choosing for its query heads) while earlier positions attend densely: later
layers then read keys and values computed from sparse hidden states, as in decode. On the harness's
window and tokens it gives the harness's numbers (tests/test_quality.py checks it); here it runs
8-16 windows of 1024 tokens each in minutes on a CPU, seconds on a GPU.

Plans: dense, oracle, hash, hash-b<bits>, plan files; `--encoders DIR` adds learned `hash` per DIR.
Prism and static plans are not supported (their INT2 proposal layers need the runtime's caches).

    python bench/teacher_agreement.py --contexts 2048,4096,8192 --windows 8 --encoders ~/.cache/sparse_fx/encoders/smollm2-b32
Writes <out>/agreement.json, .md and .png (agreement-<tag>.* with --tag).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AttentionInterface

import sparse_fx
from sparse_fx.data import token_windows
from sparse_fx.models import load_model
from sparse_fx.lowering.reference import kept, selection_keys
from sparse_fx.model_info import ModelInfo
from sparse_fx.runtime.encoders import Encoders, SignatureEncoders, apply_head_mlp
from sparse_fx.train import oracle_scores

import benchlib  # bench/benchlib.py: a script's own folder is sys.path[0]

ATTENTION = "sparse_fx_teacher_mask"


class Selector:
    """The plan's selection for the last `span` query positions of a sequence, per layer and KV head."""

    def __init__(self, plan: sparse_fx.Plan, model, budget: int):
        if plan.method not in ("oracle", "hash"):
            raise ValueError(f"bench/teacher_agreement.py: plan {plan.name!r} is not supported; valid: dense, oracle, hash, hash-b<bits>")
        c = model.config
        self.plan, self.budget = plan, budget
        self.roles = sparse_fx.methods.get(plan.method).roles(plan, c.num_hidden_layers, set(plan.dense_layers))
        self.shape = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        trained = SignatureEncoders.load(plan.encoders) if plan.encoders else None
        if trained is not None:
            trained.check(ModelInfo.of(model).fingerprint(model))
        self.encoders = Encoders(plan.bits, plan.seed, trained) if plan.method == "hash" else None

    def scores(self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
        """[Hkv, E, T], higher first: summed over a KV head's query heads, as the served kernels do."""
        if self.encoders is None:
            return oracle_scores(layer, q, k, positions, scale)
        # Signs: the dot of two sign vectors is bits - 2 * Hamming distance, the served score's order
        # (lowering.reference.hamming_scores scores one query at a time; this takes all E at once).
        Hkv, G = k.shape[0], q.shape[0] // k.shape[0]
        enc = self.encoders.layer(layer, *self.shape, q.device)
        qs = torch.sign(apply_head_mlp(q[None], *enc.query.params()))[0]
        ks = torch.sign(apply_head_mlp(k[None], *enc.key.params()))[0].repeat_interleave(G, 0)
        s = qs @ ks.transpose(-1, -2)
        return s.reshape(Hkv, G, *s.shape[1:]).sum(1)

    def mask(self, layer: int, q, k, positions, scale) -> torch.Tensor:
        """[Hkv, E, T] bool: the keys each of the last E positions reads."""
        T = k.shape[1]
        key = torch.arange(T, device=k.device)[None, :]
        visible = key <= positions[:, None]
        keep = kept(key, positions[:, None], self.plan.sink, self.plan.local) & visible
        # the served ranking: keys as the kernels compare them, equal keys to the most recent position
        ranked = selection_keys(self.scores(layer, q, k, positions, scale).float()) * (T + 1) + key
        ranked = ranked.masked_fill(~visible[None] | keep[None], torch.iinfo(torch.int64).min)
        top = torch.topk(ranked, self.budget, -1)
        chosen = torch.zeros(ranked.shape, dtype=torch.bool, device=k.device)
        chosen.scatter_(2, top.indices, top.values > torch.iinfo(torch.int64).min)
        return (chosen | keep[None]) & visible[None]


class TeacherMask:
    """An attention function for `AttentionInterface`: dense causal SDPA for all but the last `span`
    positions; those read only their selection. Layers the plan keeps dense read everything."""

    def __init__(self, span: int):
        self.span, self.selector = span, None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        B, Hq, T, D = query.shape
        G = Hq // key.shape[1]
        E = self.span
        scale = D**-0.5 if scaling is None else scaling
        k, v = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
        head = F.scaled_dot_product_attention(query[:, :, : T - E], k[:, :, : T - E], v[:, :, : T - E], is_causal=True, scale=scale)
        positions = torch.arange(T - E, T, device=query.device)
        if self.selector.roles[module.layer_idx] == "dense":
            allowed = (torch.arange(T, device=query.device)[None, :] <= positions[:, None])[None, None]
        else:
            allowed = torch.stack([self.selector.mask(module.layer_idx, query[b, :, T - E:].float(), key[b].float(), positions, scale)
                                   for b in range(B)]).repeat_interleave(G, 1)
        tail = F.scaled_dot_product_attention(query[:, :, T - E:], k, v, attn_mask=allowed, scale=scale)
        return torch.cat([head, tail], 2).transpose(1, 2).contiguous(), None


def plans_of(names: list[str], encoders: list[str]) -> dict[str, sparse_fx.Plan]:
    plans = {name: sparse_fx.Plan.parse(name) for name in names}
    for d in encoders:
        plans[f"hash learned ({Path(d).name})"] = sparse_fx.Plan.parse("hash", encoders=d)
    return plans


def evaluate(model, tok, plans: dict, n: int, sparsity: int, windows: int, span: int, seed: int = 0, progress: bool = False) -> dict:
    """Per plan: agreement and CE delta vs dense over `windows` held-out windows' last `span` tokens."""
    device = next(model.parameters()).device
    teacher = TeacherMask(span)
    AttentionInterface.register(ATTENTION, teacher)
    ids = token_windows(tok, "heldout", n + 1, windows, seed=seed).to(device)
    sparse = {name: Selector(p, model, max(1, n // sparsity)) for name, p in plans.items() if not p.dense}
    rows = {name: {"agreement": [], "ce_delta": [], "seconds": 0.0} for name in sparse}
    dense_ce = []
    previous = model.config._attn_implementation
    try:
        for w in tqdm(ids, desc=f"context {n}, 1/{sparsity}", disable=not progress):
            inputs, targets = w[None, :n], w[n - span + 1:]
            with torch.no_grad():
                model.config._attn_implementation = previous
                ref = torch.log_softmax(model(inputs, use_cache=False).logits[0, n - span:].double(), -1)
                ref_t = ref.gather(1, targets[:, None])[:, 0]
                dense_ce.append(float(-ref_t.mean()))
                model.config._attn_implementation = ATTENTION
                for name, sel in sparse.items():
                    t0 = time.perf_counter()
                    teacher.selector = sel
                    lp = torch.log_softmax(model(inputs, use_cache=False).logits[0, n - span:].double(), -1)
                    r = rows[name]
                    r["agreement"].append(float((lp.argmax(-1) == ref.argmax(-1)).double().mean()))
                    r["ce_delta"].append(float((ref_t - lp.gather(1, targets[:, None])[:, 0]).mean()))
                    r["seconds"] += time.perf_counter() - t0
    finally:
        model.config._attn_implementation = previous
    out = {"context": n, "sparsity": sparsity, "budget": max(1, n // sparsity), "windows": windows, "span": span,
           "dense_ce": dense_ce, "plans": {}}
    for name, r in rows.items():
        out["plans"][name] = {"plan": plans[name].to_dict(), **{m: summary(r[m]) for m in ("agreement", "ce_delta")},
                              "per_window": {m: r[m] for m in ("agreement", "ce_delta")}, "seconds": r["seconds"]}
    if "oracle" in out["plans"]:
        oracle = out["plans"]["oracle"]["per_window"]["agreement"]
        for row in out["plans"].values():
            row["agreement_of_oracle"] = sum(row["per_window"]["agreement"]) / sum(oracle)
    return out


def summary(values: list[float]) -> dict:
    """Mean over windows (each the same number of tokens) and its standard error."""
    m = sum(values) / len(values)
    se = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values)) if len(values) > 1 else float("nan")
    return {"mean": m, "stderr": se}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default="oracle,hash,hash-b256")
    ap.add_argument("--encoders", nargs="*", default=[], help="encoder directories: one learned `hash` row each")
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--sparsity", default="16")
    ap.add_argument("--windows", type=int, default=8, help="held-out windows per context")
    ap.add_argument("--span", type=int, default=1024, help="positions scored per window (the last ones)")
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    ap.add_argument("--tag", default="", help="names the outputs agreement-<tag>.* (default: agreement.*)")
    benchlib.add_out(ap)
    a = ap.parse_args()
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device))
    plans = plans_of([p for p in a.plans.split(",") if p], a.encoders)
    contexts = [int(x) for x in a.contexts.split(",")]
    if not 0 < a.span < min(contexts) or a.windows < 1:
        ap.error(f"--span must lie in 1..{min(contexts) - 1} (below the shortest context) and --windows be >= 1")
    model, tok = load_model(device=device)
    report = {"meta": benchlib.header(a), "runs": []}
    t0 = time.perf_counter()
    for n in contexts:
        for sp in [int(x) for x in a.sparsity.split(",")]:
            report["runs"].append(evaluate(model, tok, plans, n, sp, a.windows, a.span, progress=True))
            print(markdown(report), flush=True)
    report["seconds"] = time.perf_counter() - t0
    stem = f"agreement-{a.tag}" if a.tag else "agreement"
    benchlib.save(a.out, stem, report, markdown=markdown(report), plot=lambda png: plot(report, png))
    print(markdown(report))


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"Teacher-forced agreement with dense (`{meta['command']}`; {benchlib.where(meta)}, torch {meta['versions']['torch']}, "
             f"{meta['date'][:10]}): mean over windows ± standard error; budget n/s + sink + local.", "",
             "| context | sparsity | plan | tokens | agreement | of oracle | CE delta |", "|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        for name, r in run["plans"].items():
            a, c = r["agreement"], r["ce_delta"]
            lines.append(f"| {run['context']} | 1/{run['sparsity']} | {name} | {run['windows']} x {run['span']} | "
                         f"{a['mean']:.2%} ± {a['stderr']:.2%} | {r.get('agreement_of_oracle', float('nan')):.1%} | "
                         f"{c['mean']:+.4f} ± {c['stderr']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Agreement with dense vs context, one panel per sparsity, error bars of one standard error."""
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
    benchlib.savefig(fig, path)


if __name__ == "__main__":
    main()
