"""The quality harness: sparse_fx plans against dense attention on a real model, offline.

Per plan x context x sparsity (`Settings`; `run` measures, `markdown` tabulates):
  probes     recall@k of each sparse layer's selection against the true attention top-k (mean and
             spread over layers and heads), attention mass kept, relative output error, Prism pool
             recall, tokens chosen by score (fewer than the budget under mass < 1); recorded by the
             library's probes (`compile(..., measure=True)`)
  teacher    next-token agreement (argmax equal) and cross-entropy delta vs dense: dense prefill of
             a held-out window, then `decode_tokens` sparse decode steps fed the true tokens
  passkey    retrieval accuracy at several depths (>= 10 trials per cell, fixed seeds); dense
             prefill of all but the last `passkey_offset` prompt tokens, which are decoded sparsely
             like the answer (default 1: every answer token comes from a sparse step; HashAttention's
             RULER protocol uses 32, which costs 32 more decode steps per trial and config)

Budget protocol (HashAttention): at sparsity s and context n a sparse step attends to n // s tokens
chosen by score plus the first `sink` and last `local` tokens.

Cost on a CPU is dense prefills, so each text window or pass-key prompt is prefilled once by the
plain model into a StaticCache whose contents are then copied into place for every plan x sparsity
(`sparse_fx.attach_cache` writes the side caches from it). One compiled model per config, reused
for every window and prompt: nothing recompiles.

    from sparse_fx.offline import harness
    from sparse_fx.offline.models import load_model
    model, tok = load_model()
    s = harness.Settings(plans=["dense", "hash"], contexts=[2048], sparsities=[16])
    results = harness.run(model, tok, s)
    print(harness.markdown(harness.describe(model, s, "mine", results)))

The command line over it is `python bench/quality_sweep.py` (outputs, plots, provenance header).
Uses only the public API plus `sparse_fx.offline.data` (held-out text, pass-key prompts).

Decoding token by token is the product's path but slow (about 90 s per 256 tokens of one plan at
4K on 2 CPU cores). `sparse_fx.offline.agreement` measures agreement, CE delta, tokens kept and
pass keys over many more tokens by teacher forcing in one pass, through the same selections and
this module's windows and keys; tests/offline/test_quality.py checks that the two give the same numbers.
"""

from __future__ import annotations

import copy
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import sparse_fx
from sparse_fx.offline.data import passkey_prompt, token_windows

MODEL = "SmolLM2-135M-Instruct"  # what `sparse_fx.offline.models.load_model()` loads; named in the tables


@dataclass
class Settings:
    """What to run; the CLI's options, also the test's entry point."""

    plans: list[str] = field(default_factory=lambda: ["dense", "oracle", "hash", "prism-g4", "static-g4"])
    contexts: list[int] = field(default_factory=lambda: [2048, 4096, 8192])
    sparsities: list[int] = field(default_factory=lambda: [16, 32])
    sink: int = 128
    local: int = 128
    recall_k: int = 32
    decode_tokens: int = 256
    windows: int = 1
    depths: list[int] = field(default_factory=lambda: [10, 30, 50, 70, 90])
    passkey_trials: int = 10
    passkey_offset: int = 1
    answer_tokens: int = 8
    seed: int = 0
    probe_passkey: bool = False  # passkey through the probing models (fewer traces, slower steps)
    prefill_threads: int | None = None  # torch threads for dense prefills (decode: the process's setting)


@dataclass
class Config:
    """One plan at one sparsity and context: its compiled model(s) and what they scored."""

    plan: str
    sparsity: int | None  # None: the plan is dense, sparsity does not apply
    budget: int | None
    model: torch.nn.Module  # compiled with measure=True: teacher forcing records the probes
    passkey_model: torch.nn.Module  # the same model, or one without probes (steps 2-5x cheaper)
    agree: float = 0.0
    ce_delta: float = 0.0
    ce_sparse: float = 0.0
    tokens: int = 0
    max_abs_logit_diff: float = 0.0
    passkey: dict = field(default_factory=dict)  # depth -> [{"key", "answer", "found"}] per trial

    @property
    def name(self) -> str:
        return self.plan if self.sparsity is None else f"{self.plan} 1/{self.sparsity}"


class Snapshot:
    """A StaticCache's state, restorable in place: the same tensors keep their addresses, so the
    compiled decode graphs never see a new cache and never recompile."""

    def __init__(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.lengths: list[int] = []

    def take(self, cache) -> None:
        if self.kv is None:
            self.kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        else:
            for (k, v), layer in zip(self.kv, cache.layers):
                k.copy_(layer.keys)
                v.copy_(layer.values)
        self.lengths = [int(layer.get_seq_length()) for layer in cache.layers]

    def restore(self, cache) -> None:
        for (k, v), n, layer in zip(self.kv, self.lengths, cache.layers):
            layer.keys.copy_(k)
            layer.values.copy_(v)
            layer.cumulative_length.fill_(n)


# ------------------------------------------------------------------------------------- configs
def share_weights_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of the module tree that shares the parameter and buffer tensors: each config
    gets a model of its own to compile (compile replaces `forward`) without 540 MB per copy."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def build_configs(model, n: int, s: Settings, device: torch.device) -> list[Config]:
    """Compile every plan x sparsity for context n. Dense plans run once (sparsity does not apply)."""
    configs = []
    for plan in s.plans:
        dense = sparse_fx.Plan.parse(plan).dense
        for sparsity in [None] if dense else s.sparsities:
            options = dict(sink=s.sink, local=s.local)
            if not dense:  # the sparse path at any length (min_context 0): the harness studies it
                options.update(budget=max(1, n // sparsity), min_context=0)
            probed = sparse_fx.compile(share_weights_copy(model), plan, measure=True, **options)
            sparse_fx.measurements(probed).recall_k = s.recall_k
            plain = probed
            if not (s.probe_passkey or dense):  # Inductor on CUDA; on CPU its compiles take minutes: eager
                backend = "eager" if device.type == "cpu" else None
                plain = sparse_fx.compile(share_weights_copy(model), plan, backend=backend, **options)
            configs.append(Config(plan, sparsity, options.get("budget"), probed, plain))
    return configs


def explain_summary(model, num_layers: int) -> dict:
    """What `sparse_fx.explain` says, compactly: which layers are sparse, why the others are not."""
    report = sparse_fx.explain(model)
    return {
        "plan": report.plan.to_dict(),
        "sparse_layers": len(report.sparse_layers),
        "num_layers": num_layers,
        "dense_layers": {r.layer: r.reason for r in report if r.action != "sparse"},
        "budget": next((r.budget for r in report if r.action == "sparse"), "-"),
        "side_cache_bytes": report.side_cache_bytes,
    }


class Progress:
    """A tqdm bar over estimated seconds of work, so that its ETA holds although an 8K step costs
    several 2K ones. Rates measured on a 2-core CPU (decode on 1 thread, prefill on 2)."""

    TRACE = 9.0  # Dynamo trace of the 30-layer decode graph (first decode step of a config)

    @staticmethod
    def prefill_cost(n: int, tokens: int) -> float:
        return tokens * (1.8e-3 + 3.1e-7 * n)

    @staticmethod
    def step_cost(n: int, probed: bool) -> float:
        return 1.3e-4 * n if probed else 0.1 + 1.4e-5 * n  # the probes compute dense attention in fp32

    def __init__(self, s: Settings, enabled: bool):
        from tqdm import tqdm

        n_sparse = sum(not sparse_fx.Plan.parse(p).dense for p in s.plans)
        configs, plain = len(s.plans) - n_sparse + n_sparse * len(s.sparsities), n_sparse * len(s.sparsities)
        pk_steps = len(s.depths) * s.passkey_trials * (s.passkey_offset + s.answer_tokens - 1)
        total = 0.0
        for n in s.contexts:
            total += (configs + (0 if s.probe_passkey else plain)) * self.TRACE
            total += s.windows * (self.prefill_cost(n, n) + configs * s.decode_tokens * self.step_cost(n, True))
            total += sum(self.prefill_cost(n, n * d // 100 + s.passkey_trials * n * (100 - d) // 100) for d in s.depths)
            total += pk_steps * (configs - plain) * self.step_cost(n, True)
            total += pk_steps * plain * self.step_cost(n, s.probe_passkey)
        self.bar = tqdm(total=round(total), disable=not enabled, dynamic_ncols=True, file=sys.stderr,
                        bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}")

    def prefilled(self, n: int, tokens: int) -> None:
        self.bar.update(self.prefill_cost(n, tokens))

    def stepped(self, n: int, steps: int, probed: bool) -> None:
        self.bar.update(steps * self.step_cost(n, probed))

    def traced(self, models: int) -> None:
        self.bar.update(models * self.TRACE)


# ------------------------------------------------------------------------------ measurements
def prefill(model, ids: torch.Tensor, cache, threads: int | None, **kwargs):
    """A forward of the plain (dense, uncompiled) model, on `threads` torch threads: prefill is
    compute-bound and gains from every core, while decode steps are many small ops that run best on
    one thread of a shared machine. Only uncompiled code runs here: the compiled decode graphs,
    whose guards include the thread count, never see the change (no recompiles)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads or old)
    try:
        return model(ids, past_key_values=cache, **kwargs)
    finally:
        torch.set_num_threads(old)


def decode(model, token: int, cache) -> torch.Tensor:
    """One decode step -> next-token logits [V]. The id goes in as a fresh [1, 1] tensor: a slice
    of a longer tensor has other strides, for which Dynamo would trace a second decode graph."""
    device = cache.layers[0].keys.device
    return model(torch.tensor([[token]], device=device), past_key_values=cache).logits[0, -1]


@torch.no_grad()
def teacher_force(model, configs: list[Config], cache, snap: Snapshot, window: torch.Tensor, s: Settings, bar) -> float:
    """One held-out window of n + 1 tokens: dense prefill of n - T, then T sparse steps fed the true
    tokens; each step's logits against the dense model's at the same position. Returns dense CE.

    The dense reference is one chunked forward of the last T tokens on top of the prefill (the
    same maths as a forward over the whole window, at the cost of T tokens); the dense plan's
    stepping is checked against it (`max_abs_logit_diff`)."""
    n, T = window.shape[1] - 1, s.decode_tokens
    P = n - T
    cache.reset()
    prefill(model, window[:, :P], cache, s.prefill_threads, logits_to_keep=1)
    snap.take(cache)
    ref = prefill(model, window[:, P:n], cache, s.prefill_threads).logits[0].float()  # predicts P+1 .. n
    bar.prefilled(n, n)
    targets = window[0, P + 1 : n + 1]
    tokens = window[0].tolist()
    ce_dense = F.cross_entropy(ref, targets, reduction="none")
    for c in configs:
        snap.restore(cache)
        sparse_fx.attach_cache(c.model, cache)
        logits = torch.stack([decode(c.model, tokens[t], cache) for t in range(P, n)]).float()
        c.agree += float((logits.argmax(-1) == ref.argmax(-1)).sum())
        ce = F.cross_entropy(logits, targets, reduction="none")
        c.ce_sparse += float(ce.sum())
        c.ce_delta += float((ce - ce_dense).sum())
        c.tokens += T
        if c.sparsity is None:
            c.max_abs_logit_diff = max(c.max_abs_logit_diff, float((logits - ref).abs().max()))
        bar.stepped(n, T, probed=True)
    return float(ce_dense.sum())


def passkey_key(seed: int, trial: int) -> int:
    """The 5-digit key of a trial: fixed by the seed, different per trial, the same at every depth
    and context (so cells differ only in where the key sits and how long the prompt is)."""
    return random.Random(seed * 1_000_003 + trial).randrange(10_000, 100_000)


@torch.no_grad()
def passkey_cell(model, tok, configs: list[Config], cache, snaps: tuple[Snapshot, Snapshot], n: int, depth: int,
                 s: Settings, device, bar) -> None:
    """All trials at one context and depth. The prompts differ only from the needle on, so their
    common prefix is prefilled once; each trial prefills its rest up to the last --passkey-offset
    tokens, which every config then decodes sparsely before --answer-tokens greedy tokens."""
    keys = [passkey_key(s.seed, t) for t in range(s.passkey_trials)]
    prompts = [passkey_prompt(tok, n, depth / 100, k).to(device) for k in keys]
    longest = max(p.shape[1] for p in prompts)
    if longest + s.answer_tokens - 1 > n:
        raise ValueError(f"passkey prompt of {longest} tokens + {s.answer_tokens} answer tokens exceeds context {n}")
    stops = [p.shape[1] - s.passkey_offset for p in prompts]
    shared = min(stops)
    for p in prompts[1:]:
        same = (p[0, :shared] == prompts[0][0, :shared]).long()
        shared = int(same.cumprod(0).sum())
    prefix, trial = snaps
    cache.reset()
    if shared:
        prefill(model, prompts[0][:, :shared], cache, s.prefill_threads, logits_to_keep=1)
    prefix.take(cache)
    bar.prefilled(n, shared)
    for key, ids, stop in zip(keys, prompts, stops):
        prefix.restore(cache)
        if stop > shared:
            prefill(model, ids[:, shared:stop], cache, s.prefill_threads, logits_to_keep=1)
        trial.take(cache)
        bar.prefilled(n, stop - shared)
        for c in configs:
            trial.restore(cache)
            m = c.passkey_model
            sparse_fx.attach_cache(m, cache)
            for t in ids[0, stop:].tolist():
                logits = decode(m, t, cache)
            answer = [int(logits.argmax())]
            for _ in range(s.answer_tokens - 1):
                answer.append(int(decode(m, answer[-1], cache).argmax()))
            text = tok.decode(answer, clean_up_tokenization_spaces=False)
            c.passkey.setdefault(depth, []).append({"key": key, "answer": text, "found": str(key) in text})
            bar.stepped(n, ids.shape[1] - stop + s.answer_tokens - 1, probed=m is c.model)


def run(model, tok, s: Settings, progress: bool = True, checkpoint=None) -> dict:
    """Every measurement of `s` on `model` (left as it is: configs compile copies that share its
    weights). Returns the results dict (`describe` adds what they are about); `checkpoint(rows, contexts)` is called
    after each context with the rows and per-context facts so far."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    num_layers = model.config.num_hidden_layers
    rows, contexts, compiled = [], {}, 0
    graphs = dynamo_graphs()
    bar = Progress(s, progress)
    start = time.perf_counter()
    for n in s.contexts:
        t0 = time.perf_counter()
        bar.bar.set_description(f"n={n} compile")
        configs = build_configs(model, n, s, device)
        compiled += len({id(m) for c in configs for m in (c.model, c.passkey_model)})
        cache = StaticCache(config=model.config, max_cache_len=n)
        snaps = Snapshot(), Snapshot()
        windows = token_windows(tok, "heldout", n + 1, s.windows, seed=s.seed).to(device)
        ce_dense = 0.0
        for w in range(s.windows):
            bar.bar.set_description(f"n={n} teacher forcing {w + 1}/{s.windows}")
            ce_dense += teacher_force(model, configs, cache, snaps[0], windows[w : w + 1], s, bar)
            if w == 0:
                bar.traced(len(configs))
        t_teacher = time.perf_counter() - t0
        for d in s.depths:
            bar.bar.set_description(f"n={n} passkey depth {d}%")
            passkey_cell(model, tok, configs, cache, snaps, n, d, s, device, bar)
            if d == s.depths[0]:
                bar.traced(sum(c.passkey_model is not c.model for c in configs))
        tokens = s.windows * s.decode_tokens
        for c in configs:
            probes = sparse_fx.measurements(c.model).summary()
            sparse_fx.measurements(c.model).reset()
            trials = [t for d in s.depths for t in c.passkey[d]]
            row = {
                "context": n, "plan": c.plan, "sparsity": c.sparsity, "budget": c.budget, "sink": s.sink, "local": s.local,
                "selected_tokens": None if c.budget is None else s.sink + s.local + c.budget,
                "explain": explain_summary(c.model, num_layers),
                "probes": probes,
                "teacher": {"agreement": c.agree / c.tokens, "ce_delta": c.ce_delta / c.tokens,
                            "ce_sparse": c.ce_sparse / c.tokens, "ce_dense": ce_dense / tokens, "tokens": c.tokens},
                "passkey": {"accuracy": sum(t["found"] for t in trials) / len(trials) if trials else None, "trials": len(trials),
                            "by_depth": {str(d): sum(t["found"] for t in c.passkey[d]) / len(c.passkey[d]) for d in s.depths},
                            "answers": {str(d): c.passkey[d] for d in s.depths}},
            }
            if c.sparsity is None:
                row["teacher"]["max_abs_logit_diff_vs_chunked_dense"] = c.max_abs_logit_diff
            if c.passkey_model is not c.model:
                row["explain_passkey_model"] = explain_summary(c.passkey_model, num_layers)
            rows.append(row)
        contexts[n] = {"teacher_seconds": t_teacher, "seconds": time.perf_counter() - t0,
                       "passkey_prompt_tokens": passkey_prompt(tok, n, 0.5, passkey_key(s.seed, 0)).shape[1]}
        del configs, cache, snaps
        if checkpoint:
            checkpoint(rows, contexts)
    bar.bar.close()
    return {"rows": rows, "contexts": contexts, "seconds": time.perf_counter() - start,
            "compiled_models": compiled, "dynamo_graphs": dynamo_graphs() - graphs}  # more graphs than models: recompiles


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ------------------------------------------------------------------------------------ outputs
def markdown(results: dict) -> str:
    """One table per context: rows plan x sparsity, columns the headline numbers; then passkey by depth."""
    s, rows = results["settings"], results["rows"]
    meta = results.get("meta", {})  # the bench writer's header (command, date, versions), when there is one
    versions = meta.get("versions", {})
    k = s["recall_k"]
    out = [
        f"# sparse_fx quality: {results['model']}, tag `{results['tag']}`",
        "",
        f"`{meta.get('command', '-')}`  ",
        f"{meta.get('date', '-')}, {results['machine']['summary']}, torch {versions.get('torch', '-')}, "
        f"transformers {versions.get('transformers', '-')}; {results['seconds'] / 60:.0f} min"
        + (f" (interrupted: contexts {', '.join(map(str, results['contexts']))} of {', '.join(map(str, s['contexts']))} done)."
           if results.get("incomplete") else "."),
        "",
        f"Budget: at sparsity s and context n each sparse step attends to **n // s chosen tokens + the first "
        f"{s['sink']} + the last {s['local']}**. Probes and teacher forcing: {s['windows']} held-out window(s) per "
        f"context, dense prefill then {s['decode_tokens']} sparse decode steps fed the true tokens. Passkey: "
        f"{s['passkey_trials']} trials x depths {', '.join(map(str, s['depths']))}%, the last {s['passkey_offset']} "
        f"prompt tokens and {s['answer_tokens']} greedy answer tokens decoded sparsely.",
        "",
        f"recall@{k}: share of the true top-{k} attention keys in the selection (mean over layers, heads, steps; "
        "± std over layers / over heads; min = worst layer). Output error: |sparse - dense| / |dense| of each "
        "attention output. Kept: tokens chosen by score per step and KV head (the budget's share used; fewer under a "
        "plan's -mass<p>), mean ± std over layers. CE Δ: cross-entropy of the true next token, sparse minus dense "
        "(nats/token).",
    ]
    for n in sorted({r["context"] for r in rows}):
        sub = [r for r in rows if r["context"] == n]
        ce = sub[0]["teacher"]["ce_dense"]
        out += ["", f"## context {n} (dense CE {ce:.3f} nats/token)", "",
                f"| plan | sparsity | budget | kept | recall@{k} | ± layers / heads | min layer | mass | output err "
                "| pool recall | agreement | CE Δ | passkey |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sub:
            p, t = r["probes"], r["teacher"]
            rec = p.get("recall")
            cells = [
                r["plan"], f"1/{r['sparsity']}" if r["sparsity"] else "-",
                f"{r['budget']}+{r['sink']}+{r['local']}" if r["budget"] else "all",
                f"{p['kept']['mean']:.0f} ± {p['kept']['std_over_layers']:.0f}" if "kept" in p else "-",
                f"{rec['mean']:.3f}" if rec else "-",
                f"{rec['std_over_layers']:.3f} / {rec['std_over_heads']:.3f}" if rec else "-",
                f"{rec['min_layer']:.3f}" if rec else "-",
                f"{p['mass']['mean']:.3f}" if "mass" in p else "-",
                f"{p['output_error']['mean']:.3f}" if "output_error" in p else "-",
                f"{p['pool_recall']['mean']:.3f}" if "pool_recall" in p else "-",
                f"{t['agreement']:.1%}", f"{t['ce_delta']:+.3f}", f"{r['passkey']['accuracy']:.0%}",
            ]
            out.append("| " + " | ".join(cells) + " |")
    depths = s["depths"]
    out += ["", f"## passkey accuracy by depth ({s['passkey_trials']} trials per cell)", "",
            "| context | plan | sparsity | " + " | ".join(f"{d}%" for d in depths) + " | all |",
            "|---|---|---|" + "---|" * (len(depths) + 1)]
    for r in rows:
        by = r["passkey"]["by_depth"]
        out.append(f"| {r['context']} | {r['plan']} | {'1/' + str(r['sparsity']) if r['sparsity'] else '-'} | "
                   + " | ".join(f"{by[str(d)]:.0%}" for d in depths) + f" | {r['passkey']['accuracy']:.0%} |")
    return "\n".join(out) + "\n"



def describe(model, s: Settings, tag: str, results: dict) -> dict:
    """`run`'s results with what they are about: model, tag, machine and threads, settings."""
    device = next(model.parameters()).device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    machine = {"node": platform.node(), "platform": platform.platform(), "device": str(device), "device_name": name,
               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "prefill_threads": s.prefill_threads or torch.get_num_threads()}
    machine["summary"] = (f"{name} ({device.type}, {machine['cpus']} CPUs; torch threads: {machine['torch_threads']} decode, "
                          f"{machine['prefill_threads']} prefill)")
    return {"model": MODEL, "tag": tag, "machine": machine, "settings": s.__dict__, **results}
