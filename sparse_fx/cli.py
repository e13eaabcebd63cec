"""Command line: `python -m sparse_fx <command>` (also installed as `sparse-fx`)."""

from __future__ import annotations

import argparse


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

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        run(plans=tuple(args.plans.split(",")), context=args.context, depth=args.depth, budget=args.budget,
            sink=args.sink, local=args.local, backend=args.backend)
    elif args.command == "explain":
        from . import compile, explain as explain_model
        from .models import load_model

        model, _ = load_model()
        print(explain_model(compile(model, args.plan, backend="eager")))


if __name__ == "__main__":
    main()
