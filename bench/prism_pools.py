#!/usr/bin/env python
"""Where Prism's pools lose attention: proposal scores against the attention each layer needs.

On pass-key prompts (SmolLM2-135M-Instruct, offline), one dense forward captures every layer's
last-position query and its keys. Then, per layer group of a `prism-g<G>` plan, the proposal
layer's pool (the best rho x budget candidates between the sink and the local window, by the
proposal score) is compared with what each layer of the group would attend to: the share of the
exact attention mass of the oracle's top `budget` that the layer's own choice within the pool
keeps (the proposal layer chooses by its proposal score, refined layers by exact mass, as Prism
does), and how much of the attention on the needle (the pass key's tokens) survives.

Proposal scores compared: `int2` (the plan's INT2 keys: group-wise 2-bit, 32 channels a scale),
`int2-centred` (keys minus their per-channel mean before quantising, as KIVI / SageAttention do
for outlier channels; the mean is added back), and `exact` (the proposal layer's exact attention
mass: what a perfect proposal scorer would pool). `exact` separates the loss INT2 causes from the
loss of sharing one layer's pool with the next layers.

    python bench/prism_pools.py --context 4096 --depths 10,50,90 --keys 3 --rho 4,8
Writes <out>/prism-pools-<context>.json and .md.
"""

from __future__ import annotations

import argparse

import torch

import sparse_fx
from sparse_fx.offline.calibrate import attention_mass, capture, decode_candidates, int2_score
from sparse_fx.offline.data import passkey_prompt
from sparse_fx.lowering.reference import choose, int2_dequantize, int2_quantize, selection_keys
from sparse_fx.offline.models import load_model

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]

PROPOSALS = ("int2", "int2-centred", "exact")
KEYS = (31415, 27182, 16180, 14142, 17320, 22360, 26457, 30000, 11235, 58132)


def centred_int2_score(q: torch.Tensor, k: torch.Tensor, group: int = 32) -> torch.Tensor:
    """`int2_score` of keys quantised minus their per-channel mean (added back after)."""
    mu = k.mean(1, keepdim=True)
    kd = int2_dequantize(*int2_quantize(k - mu, group)) + mu
    S, Hq, D = q.shape
    return torch.einsum("skgd,ktd->skgt", q.view(S, k.shape[0], Hq // k.shape[0], D), kd).amax(2)


def best(scores: torch.Tensor, k: int, allowed: torch.Tensor) -> torch.Tensor:
    """[..., N] bool: the k best allowed entries of each row, as the served selection chooses them."""
    return choose(selection_keys(scores), allowed, k)


def needle_span(ids: torch.Tensor, tokenizer, key: int) -> torch.Tensor:
    """[N] bool: the pass key's tokens where the prompt states it (not the closing question)."""
    digits = tokenizer(f" {key}", add_special_tokens=False)["input_ids"]
    row, n = ids[0].tolist(), len(digits)
    span = torch.zeros(len(row), dtype=torch.bool)
    for i in range(len(row) - n):
        if row[i:i + n] == digits:
            span[i:i + n] = True
    if not span.any():
        raise RuntimeError(f"the pass key {key} is not found as tokens in its prompt")
    return span


def measure(layers, needle, plan, group: int, proposal: str) -> dict:
    """Per layer of the plan's groups: chosen mass / oracle top-budget mass; and, over all layers,
    the share of the needle's attention mass that the choices keep."""
    T = layers[0][1].shape[1]
    allowed = decode_candidates(T, 1, plan, "cpu")
    kept, oracle, needle_kept, needle_all = [], [], 0.0, 0.0
    for layer in range(len(layers)):
        lead = layer - layer % group
        q, k = layers[lead]
        if proposal == "exact":
            score = attention_mass(q, k, allowed)
        else:
            score = (centred_int2_score if proposal == "int2-centred" else int2_score)(q, k, plan.options.int2_group)
        pool = best(score, plan.options.pool(plan.budget), allowed)
        mass = attention_mass(*layers[layer], allowed)
        chosen = best(score if layer == lead else mass, plan.budget, pool)
        kept.append(float((mass * chosen).sum()))
        oracle.append(float((mass * best(mass, plan.budget, allowed)).sum()))
        on_needle = mass * needle
        needle_kept += float((on_needle * chosen).sum())
        needle_all += float(on_needle.sum())
    return {"mass_vs_oracle": sum(kept) / sum(oracle), "per_layer": [a / b for a, b in zip(kept, oracle)],
            "needle_mass_kept": needle_kept / needle_all}


def markdown(doc: dict) -> str:
    a = doc["meta"]["args"]
    lines = [f"Prism pools on pass-key prompts, SmolLM2-135M-Instruct, context {a['context']}, budget "
             f"{a['context'] // a['sparsity']} + {a['sink']} + {a['local']}, group {a['group']}, {a['keys']} keys a depth; "
             f"`{doc['meta']['command']}`", "",
             "mass: attention mass the group's choices keep / the oracle's top-budget mass (summed over layers); "
             "needle: share of the attention on the pass key's tokens kept.", "",
             "| depth | proposal | rho | mass | needle | worst layer |", "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        worst = min(range(len(r["per_layer"])), key=lambda i: r["per_layer"][i])
        lines.append(f"| {r['depth']}% | {r['proposal']} | {r['rho']:g} | {r['mass_vs_oracle']:.3f} | "
                     f"{r['needle_mass_kept']:.3f} | L{worst} {r['per_layer'][worst]:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--depths", default="10,50,90", help="pass-key depths, %% of the filler")
    ap.add_argument("--keys", type=int, default=3, help=f"pass keys a depth (at most {len(KEYS)})")
    ap.add_argument("--proposals", default=",".join(PROPOSALS), help=f"from {', '.join(PROPOSALS)}")
    ap.add_argument("--rho", default="4,8", help="pool sizes / budget")
    ap.add_argument("--group", type=int, default=4, help="layers a proposal serves (prism-g<G>)")
    ap.add_argument("--sparsity", type=int, default=16, help="budget = context // sparsity")
    ap.add_argument("--sink", type=int, default=128)
    ap.add_argument("--local", type=int, default=128)
    benchlib.add_out(ap)
    args = ap.parse_args()
    proposals = args.proposals.split(",")
    if not set(proposals) <= set(PROPOSALS) or not 1 <= args.keys <= len(KEYS):
        ap.error(f"--proposals take {', '.join(PROPOSALS)}; --keys 1..{len(KEYS)}")
    model, tokenizer = load_model()
    meta = benchlib.header(args)
    rows = []
    for depth in map(int, args.depths.split(",")):
        per_key = []
        for key in KEYS[: args.keys]:
            ids = passkey_prompt(tokenizer, args.context, depth / 100, key)
            layers = capture(model, ids, 1)
            needle = needle_span(ids, tokenizer, key)
            per_key.append({(p, r): measure(layers, needle, sparse_fx.Plan.parse(
                                f"prism-g{args.group}", budget=args.context // args.sparsity, sink=args.sink,
                                local=args.local, rho=r), args.group, p)
                            for p in proposals for r in map(float, args.rho.split(","))})
        for (p, r) in per_key[0]:
            cells = [m[(p, r)] for m in per_key]
            rows.append({"depth": depth, "proposal": p, "rho": r,
                         "mass_vs_oracle": sum(c["mass_vs_oracle"] for c in cells) / len(cells),
                         "needle_mass_kept": sum(c["needle_mass_kept"] for c in cells) / len(cells),
                         "per_layer": [sum(c["per_layer"][i] for c in cells) / len(cells) for i in range(len(cells[0]["per_layer"]))]})
        doc = {"meta": meta, "rows": rows}
        benchlib.save(args.out, f"prism-pools-{args.context}", doc, markdown=markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
