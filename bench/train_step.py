#!/usr/bin/env python
"""Seconds per step of `train_signatures` at SmolLM2-135M's shapes (30 layers, 9 query / 3 KV heads,
head dim 64, windows of 8192 tokens), on the CPU and on CUDA when present, for several splits of a
step's query-key pairs. The step's cost does not depend on the values, so the windows are random.

    python bench/train_step.py                   # CPU and, if present, CUDA
    bash bench/gpu.sh python3 bench/train_step.py --devices cuda --end-to-end config.json --out $OUT
--end-to-end also times `train_signatures` with its defaults (its windows and context, random tokens) on a
randomly initialised model built from a Hugging Face config.json (SmolLM2-135M's: the time does not
depend on the weights), where the first device is. Writes <out>/train-step-<devices>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sparse_fx.offline.train import WINDOWS, TrainConfig, Window, train_on_windows

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]


def windows(device: str, n: int = 2, layers: int = 30, hq: int = 9, hkv: int = 3, T: int = 8192, S: int = 1024, D: int = 64):
    g = torch.Generator().manual_seed(0)
    c = TrainConfig()
    out = []
    for _ in range(n):
        pos = torch.sort(torch.randint(T // 8, T, (S,), generator=g)).values
        ranked = torch.randint(0, T // 8, (layers, hq, S, 64), generator=g).int()  # recall's truth: unused here
        labels = torch.randint(c.sink, T // 8 - c.local, (layers, hkv, S, c.top), generator=g).int()  # candidates of every query
        out.append(Window(torch.randn(layers, hkv, T, D, generator=g).half().to(device),
                          torch.randn(layers, hq, S, D, generator=g).to(device), ranked.to(device), labels.to(device),
                          pos.to(device)))
    return out


def seconds_per_step(data, cfg: TrainConfig, device: str, repeats: int) -> list[float]:
    """Each repeat times a run of `steps` and one of 2 * `steps`: the difference over `steps` is the
    step alone, without the set-up of a run (initialising ~8M weights on the CPU, ~0.1 s)."""

    def run(steps: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        train_on_windows(data, TrainConfig(**{**cfg.__dict__, "steps": steps}), progress=False)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run(3)  # warm-up
    return [(run(2 * cfg.steps) - run(cfg.steps)) / cfg.steps for _ in range(repeats)]


def train_signatures_seconds(config_json: str, device: str) -> dict:
    """Wall time of `sparse_fx.train_signatures` with its defaults on a random model of this config."""
    import sparse_fx
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(Path(config_json).resolve().parent))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device, dtype).eval()
    ids = torch.randint(0, config.vocab_size, (WINDOWS, TrainConfig().context), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    enc = sparse_fx.train_signatures(model, ids, progress=False)
    if device == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t
    history = enc.metadata["loss_history"]
    return {"device": device, "dtype": str(dtype), "model_type": config.model_type, "total_s": total,
            "loss_first": history[0], "loss_last": history[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--splits", default="64x1024,128x512,256x256", help="queries x keys per step")
    ap.add_argument("--steps", type=int, default=10, help="timed runs take this many steps and twice as many")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--end-to-end", default=None, metavar="CONFIG_JSON")
    benchlib.add_out(ap)
    a = ap.parse_args()
    meta = benchlib.header(a)
    rows, end_to_end = [], None
    for device in a.devices.split(","):
        data = windows(device)
        for split in a.splits.split(","):
            q, k = (int(x) for x in split.split("x"))
            runs = seconds_per_step(data, TrainConfig(steps=a.steps, batch_queries=q, batch_keys=k), device, a.repeats)
            rows.append({"device": device, "queries": q, "keys": k, "s_per_step_median": statistics.median(runs),
                         "runs": runs, "default_1000_steps_s": statistics.median(runs) * 1000})
            print(json.dumps(rows[-1]), flush=True)
    if a.end_to_end:
        end_to_end = train_signatures_seconds(a.end_to_end, a.devices.split(",")[0])
        print(json.dumps(end_to_end), flush=True)
    report = {"meta": meta, "threads": torch.get_num_threads(), "rows": rows, "end_to_end": end_to_end}
    benchlib.save(a.out, "train-step-" + "-".join(sorted({r["device"] for r in rows})), report)
    print("\n| device | queries x keys | s/step | 1000 steps |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['device']} | {r['queries']} x {r['keys']} | {r['s_per_step_median']:.4f} | {r['default_1000_steps_s']:.0f} s |")
    if end_to_end:
        print(f"\ntrain_signatures with its defaults on {end_to_end['device']} ({end_to_end['dtype']}): "
              f"{end_to_end['total_s']:.0f} s")


if __name__ == "__main__":
    main()
