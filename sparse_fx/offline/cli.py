"""Command line: `python -m sparse_fx <command>` (also installed as `sparse-fx`)."""

from __future__ import annotations

import argparse

from .. import methods
from .calibrate import OBJECTIVES


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sparse_fx", description="Sparse decode attention for Hugging Face decoders.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="pass-key retrieval on SmolLM2 (offline): dense vs sparse plans")
    demo.add_argument("--plans", default="dense,prism-g4,hash", help="comma-separated plans; the first is the reference")
    demo.add_argument("--context", type=int, default=3000, help="prompt length in tokens")
    demo.add_argument("--depth", type=float, default=0.5, help="where the pass key sits, 0..1")
    demo.add_argument("--budget", type=int, default=256, help="tokens chosen by score per step")
    demo.add_argument("--sink", type=int, default=64)
    demo.add_argument("--local", type=int, default=64)
    demo.add_argument("--backend", choices=("inductor", "eager"), default=None,
                      help="default: inductor on CUDA, eager on CPU (CPU Inductor compiles take minutes)")

    explain = sub.add_parser("explain", help="print what a plan does to SmolLM2's attention")
    explain.add_argument("plan", nargs="?", default="prism-g4")

    train = sub.add_parser("train-signatures", help="train HashAttention encoders on a model (frozen) and save them",
                           description="Options left unset take the defaults of sparse_fx.train_signatures.")
    train.add_argument("--model", default="smollm2", help="the model to train for (offline: smollm2)")
    train.add_argument("--out", required=True, help="directory to write encoders.safetensors + encoders.json")
    train.add_argument("--bits", type=int)
    train.add_argument("--context", type=int, help="tokens per training window (train at the deployed context)")
    train.add_argument("--windows", type=int, help="training windows from the train split")
    train.add_argument("--steps", type=int, help="Adam steps")
    train.add_argument("--seed", type=int)

    cal = sub.add_parser("calibrate", help="choose Prism proposal layers on calibration text; write the plan as JSON")
    cal.add_argument("--model", default="smollm2")
    cal.add_argument("--out", required=True, help="plan JSON to write (load with sparse_fx.compile(model, plan=PATH))")
    cal.add_argument("--method", choices=("prism", "static"), default="prism")
    cal.add_argument("--group", type=int, default=4, help="layers per proposal layer (4: 1 proposal + 3 refined)")
    cal.add_argument("--budget", type=int, default=256)
    cal.add_argument("--sink", type=int, default=64)
    cal.add_argument("--local", type=int, default=64)
    cal.add_argument("--rho", type=float, default=4.0)
    cal.add_argument("--proposal", choices=methods.get("prism").proposals, default="int2",
                     help="how proposal layers score every key: INT2 keys, or 32-bit signatures")
    cal.add_argument("--encoders", default=None,
                     help="trained signature encoders (a train-signatures --out directory) for --proposal hash")
    cal.add_argument("--context", type=int, default=2048)
    cal.add_argument("--windows", type=int, default=4)
    cal.add_argument("--steps", type=int, default=16, help="decode positions per window (the last ones)")
    cal.add_argument("--objective", choices=OBJECTIVES, default=OBJECTIVES[0],
                     help="mass: attention mass the pools keep, exact search (fast); ce: decode cross-entropy, greedy")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        run(plans=tuple(args.plans.split(",")), context=args.context, depth=args.depth, budget=args.budget,
            sink=args.sink, local=args.local, backend=args.backend)
    elif args.command == "train-signatures":
        from .models import load_model
        from .train import train_signatures

        model, tok = load_model(args.model)
        given = {k: getattr(args, k) for k in ("bits", "context", "windows", "steps", "seed") if getattr(args, k) is not None}
        enc = train_signatures(model, tokenizer=tok, **given)
        enc.save(args.out)
        print(f"saved {enc.bits}-bit encoders for {args.model} to {args.out} ({enc.metadata['train_seconds']:.0f} s)")
    elif args.command == "calibrate":
        from .calibrate import calibrate
        from .models import load_model

        model, tok = load_model(args.model)
        plan = calibrate(model, tokenizer=tok, group=args.group, method=args.method, context=args.context,
                         windows=args.windows, steps=args.steps, objective=args.objective, budget=args.budget, sink=args.sink,
                         local=args.local, rho=args.rho, proposal=args.proposal,
                         **({"encoders": args.encoders} if args.encoders else {}))
        plan.save(args.out)
        print(f"{plan.note}\nroles: {' '.join(r[0].upper() for r in plan.roles)}\nsaved {args.out}")
    elif args.command == "explain":
        from .. import compile, explain as explain_model
        from .models import load_model

        model, _ = load_model()
        print(explain_model(compile(model, args.plan, backend="eager")))


if __name__ == "__main__":
    main()
