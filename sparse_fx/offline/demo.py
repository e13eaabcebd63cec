"""`make demo`: pass-key retrieval on SmolLM2 offline, dense vs sparse plans, side by side."""

from __future__ import annotations

import copy
import time

import torch
from transformers import StaticCache

from ..api import compile, explain
from .data import passkey_prompt
from .models import load_model


def greedy(model, ids: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor, float]:
    """Prefill, then `steps` greedy decode steps: (tokens, logits [steps, V], decode seconds)."""
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 1)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits[:, -1]
        tokens, all_logits = [], [logits]
        start = None
        for i in range(steps):
            tokens.append(int(logits.argmax(-1)))
            if i == 1:  # time from the second decode step: the first one compiles
                start = time.perf_counter()
            logits = model(torch.tensor([[tokens[-1]]], device=ids.device), past_key_values=cache).logits[:, -1]
            all_logits.append(logits)
        seconds = time.perf_counter() - start
    return tokens, torch.cat(all_logits[:-1]), seconds / max(steps - 1, 1) * steps


def teacher_forced(model, ids: torch.Tensor, continuation: list[int]) -> torch.Tensor:
    """Next-token logits [len(continuation), V] when the model is fed `continuation` after `ids`."""
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + len(continuation) + 1)
    with torch.no_grad():
        out = [model(ids, past_key_values=cache).logits[:, -1]]
        for t in continuation[:-1]:
            out.append(model(torch.tensor([[t]], device=ids.device), past_key_values=cache).logits[:, -1])
    return torch.cat(out)


def run(
    plans=("dense", "prism-g4", "hash"),
    context: int = 3000,
    depth: float = 0.5,
    key: int = 71432,
    steps: int = 24,
    backend: str | None = None,
    budget: int = 256,
    sink: int = 64,
    local: int = 64,
) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = backend or ("inductor" if device == "cuda" else "eager")
    print(f"loading SmolLM2-135M-Instruct (offline) on {device} ...", flush=True)
    base, tok = load_model(device=device)
    ids = passkey_prompt(tok, context, depth, key).to(device)
    print(f"prompt: {ids.shape[1]} tokens, pass key {key} hidden at {depth:.0%} depth; "
          f"sparse plans keep {sink} sink + {local} local + {budget} chosen tokens; backend {backend}\n")
    results, dense_tokens, dense_logits = {}, None, None
    for name in plans:
        model = copy.deepcopy(base)
        if name != "dense":
            compile(model, name, backend=backend, budget=budget, sink=sink, local=local)
        tokens, logits, seconds = greedy(model, ids, steps)
        answer = tok.decode(tokens).strip().split("\n")[0]
        row = {"answer": answer, "found": str(key) in answer, "decode_tok_s": steps / seconds}
        if name == "dense":
            dense_tokens, dense_logits = tokens, logits
        else:
            forced = teacher_forced(model, ids, dense_tokens)
            row["agreement"] = float((forced.argmax(-1) == dense_logits.argmax(-1)).float().mean())
            print(explain(model) if name == plans[1] else f"{name}: {len(explain(model).sparse_layers)}/30 layers sparse")
            print()
        results[name] = row
    print(f"{'plan':<10} {'found':<6} {'decode tok/s':>12} {'agree w/ dense':>15}  answer")
    for name, r in results.items():
        agree = f"{r['agreement']:.1%}" if "agreement" in r else "-"
        print(f"{name:<10} {str(r['found']):<6} {r['decode_tok_s']:>12.1f} {agree:>15}  {r['answer']!r}")
    if device == "cpu":
        print("\n(CPU, backend eager: decode speed here is the model's MLPs and Python; the speed-ups are on the GPU, see bench/)")
    return results
