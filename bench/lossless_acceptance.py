#!/usr/bin/env python
"""Lossless mode's acceptance on the real model (SmolLM2-135M, held-out text), and where its tokens
leave the dense model's.

For each context, held-out window, plan and draft length gamma: `generate()` in lossless mode
(greedy, speculate=gamma) from the window as prompt, against the dense model's own greedy
`generate()`. Recorded: drafts proposed and accepted, tokens per row and round, the per-draft
acceptance a of the geometric model (accepted / (accepted + rejections), what
`bench/lossless_speed.py` turns into tokens per second), and whether the tokens equal the dense
model's; where they part (possible in bf16: the verify step runs gamma + 1 queries at once, rounding
differently), the dense model's gap between its top two logits there, against the bf16 spacing at
that logit (a tie within rounding is the only admissible cause). Budgets are 1/--sparsity of the
context (sink and local window as given).

With --timed (a GPU), one real end-to-end run per plan as well: `generate()` compiled (Inductor, CUDA
graphs) in lossless mode at each of --timed-gammas (an int, or auto: the adaptive choice) against the dense model's greedy decoding compiled
the same way, the median of --repeat warm calls each, on the first window of
the longest context, at batch 1 and the batch given; the baseline is the `dense` plan compiled alike.

    python bench/lossless_acceptance.py --contexts 2048,4096,8192 --windows 2 --gammas 1,2,4,8 --new 64
    python bench/lossless_acceptance.py --device cuda --timed --timed-batch 4 --windows 3
Writes <out>/lossless-acceptance.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import statistics
import time

import torch

import sparse_fx
from sparse_fx.offline.data import token_windows
from sparse_fx.offline.models import load_model

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plans", default="prism-g4,hash")
    ap.add_argument("--contexts", default="2048,4096,8192")
    ap.add_argument("--sparsity", type=int, default=16, help="budget = context / sparsity")
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--local", type=int, default=64)
    ap.add_argument("--gammas", default="1,2,4,8")
    ap.add_argument("--windows", type=int, default=2, help="held-out windows (prompts) per context")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda")
    ap.add_argument("--timed", action="store_true", help="also time compiled end-to-end generate() (GPU)")
    ap.add_argument("--timed-gammas", default="4", help="draft lengths of the timed runs: ints, or auto (adaptive)")
    ap.add_argument("--timed-batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    benchlib.add_out(ap)
    a = ap.parse_args()
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else ("cpu" if a.device == "auto" else a.device))
    dtype = getattr(torch, a.dtype)
    model, tok = load_model(dtype=dtype, device=device)
    rows = []
    for n in [int(c) for c in a.contexts.split(",")]:
        prompts = token_windows(tok, "heldout", length=n, count=a.windows, seed=11)
        for w, prompt in enumerate(prompts):
            ids = prompt[None].to(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                # Hugging Face's own one-token decode, uncompiled (on a GPU it would compile a graph per prompt length)
                dense = model.generate(ids, max_new_tokens=a.new, do_sample=False, cache_implementation="static",
                                       pad_token_id=tok.eos_token_id, eos_token_id=None, output_logits=True,
                                       return_dict_in_generate=True, disable_compile=True)
            dense_s = time.perf_counter() - t0
            want = dense.sequences[0, n:]
            for plan in a.plans.split(","):
                copy_ = copy.deepcopy(model)
                for gamma in [int(g) for g in a.gammas.split(",")]:
                    m = sparse_fx.compile(copy_, plan, backend="eager", speculate=gamma, budget=n // a.sparsity,
                                          sink=a.sink, local=a.local)
                    seen = sparse_fx.acceptance(m)
                    seen.reset()
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        got = m.generate(ids, max_new_tokens=a.new, do_sample=False, pad_token_id=tok.eos_token_id,
                                         eos_token_id=None)[0, n:]
                    row = dict(context=n, window=w, plan=plan, gamma=gamma, budget=n // a.sparsity,
                               drafted=seen.drafted, accepted=seen.accepted, rounds=seen.rounds,
                               rate=seen.rate, per_draft=seen.per_draft, tokens_per_round=seen.tokens_per_round,
                               seconds=time.perf_counter() - t0, dense_seconds=dense_s, **_parting(want, got, dense.logits))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    timed = end_to_end(model, tok, a) if a.timed else []
    report = {"meta": benchlib.header(a), "rows": rows, "summary": summary(rows), "timed": timed}
    benchlib.save(a.out, "lossless-acceptance", report, markdown=markdown(report))
    print(markdown(report))


def end_to_end(model, tok, a) -> list[dict]:
    """Compiled lossless generate() against compiled dense greedy decoding (warm medians)."""
    n = max(int(c) for c in a.contexts.split(","))
    prompt = token_windows(tok, "heldout", length=n, count=1, seed=11)[0]
    out = []
    for batch in sorted({1, a.timed_batch}):
        ids = prompt.expand(batch, -1).to(model.device)
        if batch > 1:  # rows of different texts: a shifted window each
            ids = torch.stack([prompt.roll(-97 * b) for b in range(batch)]).to(model.device)
        kwargs = dict(max_new_tokens=a.new, do_sample=False, cache_implementation="static", pad_token_id=tok.eos_token_id,
                      eos_token_id=None)
        dense = sparse_fx.compile(copy.deepcopy(model), "dense")  # compiled, CUDA graphs, KV heads read by enable_gqa
        dense_s, want = _timed(lambda: dense.generate(ids, **kwargs), a.repeat)
        for plan, gamma in itertools.product(a.plans.split(","), a.timed_gammas.split(",")):
            gamma = gamma if gamma == "auto" else int(gamma)
            m = sparse_fx.compile(copy.deepcopy(model), plan, speculate=gamma, budget=n // a.sparsity,
                                  sink=a.sink, local=a.local, min_context=0)
            seen = sparse_fx.acceptance(m)
            first = time.perf_counter()
            with torch.no_grad():
                m.generate(ids, **kwargs)
            first = time.perf_counter() - first
            seen.reset()
            spec_s, got = _timed(lambda: m.generate(ids, **kwargs), a.repeat)
            row = dict(plan=plan, context=n, batch=batch, gamma=gamma, new=a.new, dense_s=dense_s, lossless_s=spec_s,
                       speedup=dense_s / spec_s, first_call_s=first, equal=bool(torch.equal(got, want)),
                       rate=seen.rate, per_draft=seen.per_draft, tokens_per_round=seen.tokens_per_round,
                       gammas=dict(seen.gammas),
                       draft_ms=1e3 * seen.draft_seconds / max(1, sum(g * r for g, r in seen.gammas.items())),
                       verify_ms=1e3 * seen.verify_seconds / max(1, seen.rounds))
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def _timed(call, repeat: int) -> tuple[float, torch.Tensor]:
    """(median seconds of `repeat` calls after a warm-up call, the last output)."""
    times = []
    with torch.no_grad():
        result = call()
        for _ in range(repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = call()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def _parting(want: torch.Tensor, got: torch.Tensor, logits) -> dict:
    """Where lossless tokens first leave the dense ones, and how close the dense model's top two
    logits were there (in units of the bf16 spacing at the top logit)."""
    differ = (want != got).nonzero()
    if not len(differ):
        return {"equal": True, "parted_at": None}
    i = int(differ[0])
    top2 = logits[i][0].float().topk(2).values
    gap = float(top2[0] - top2[1])
    spacing = 2.0 ** (torch.frexp(top2[0].abs()).exponent.item() - 8)  # bf16: 8 significant bits
    return {"equal": False, "parted_at": i, "top2_gap": gap, "bf16_spacing": spacing, "gap_in_spacings": gap / spacing}


def summary(rows: list[dict]) -> list[dict]:
    """Per plan, context and gamma: the per-draft acceptance pooled over windows, tokens per round."""
    out = []
    keys = sorted({(r["plan"], r["context"], r["gamma"]) for r in rows})
    for plan, n, g in keys:
        cell = [r for r in rows if (r["plan"], r["context"], r["gamma"]) == (plan, n, g)]
        out.append(dict(plan=plan, context=n, gamma=g, windows=len(cell),
                        per_draft=statistics.mean(r["per_draft"] for r in cell),
                        rate=sum(r["accepted"] for r in cell) / max(1, sum(r["drafted"] for r in cell)),
                        tokens_per_round=statistics.mean(r["tokens_per_round"] for r in cell),
                        equal=sum(r["equal"] for r in cell)))
    return out


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# Lossless mode: acceptance on SmolLM2 ({meta['args']['dtype']}, {meta['gpu']})", "",
             f"`{meta['command']}` ({meta['date']})", "",
             "| plan | context | gamma | per-draft acceptance | drafts accepted | tokens / round | runs equal to dense |",
             "|---|---|---|---|---|---|---|"]
    for s in report["summary"]:
        lines.append(f"| {s['plan']} | {s['context']} | {s['gamma']} | {s['per_draft']:.3f} | {s['rate']:.3f} | "
                     f"{s['tokens_per_round']:.2f} | {s['equal']}/{s['windows']} |")
    if report.get("timed"):
        lines += ["", "End to end (compiled, CUDA graphs; warm medians; the dense baseline is the `dense` plan: the same "
                  "compiled static-cache decoding with dense attention):", "",
                  "| plan | context | batch | gamma | dense s | lossless s | speed-up | acceptance | tokens / round | "
                  "draft ms | verify ms | tokens equal |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for t in report["timed"]:
            lines.append(f"| {t['plan']} | {t['context']} | {t['batch']} | {t['gamma']} | {t['dense_s']:.3f} | "
                         f"{t['lossless_s']:.3f} | {t['speedup']:.2f}x | {t['rate']:.3f} | {t['tokens_per_round']:.2f} | "
                         f"{t['draft_ms']:.2f} | {t['verify_ms']:.2f} | {t['equal']} |")
    parted = [r for r in report["rows"] if not r["equal"]]
    lines += ["", f"Runs whose tokens left the dense model's: {len(parted)} of {len(report['rows'])}."]
    for r in parted:
        lines.append(f"- {r['plan']} gamma {r['gamma']} context {r['context']} window {r['window']}: token {r['parted_at']}, "
                     f"dense top-2 gap {r['top2_gap']:.4f} = {r['gap_in_spacings']:.2f} bf16 spacings")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
