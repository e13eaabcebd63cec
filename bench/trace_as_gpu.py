"""AOTAutograd's part of a GPU compile of a plan's decode graph, run on the CPU (no GPU needed).

A CPU compile cannot show what our graphs cost a GPU compile: on the CPU our ops run their references,
while on a GPU AOTAutograd traces their Triton path under fake tensors, functionalises every kernel
launch and asks torch's analysis which tensors each kernel reads and writes (memoised by
`lowering/kernels/access_memo.py`). Here the launchers are told they run on an H100 (a Triton target
for the analysis, 132 SMs, capability 9.0), Dynamo traces a narrow Llama (the 8B's head dim and GQA
ratio, `--layers` deep) on the CPU, our rewrite runs as in any compile, and Inductor's entry is
replaced by AOTAutograd alone (metadata collection, then the functionalised capture): timed, counted,
optionally profiled; nothing is compiled or run. Each repeat starts from empty Dynamo and analysis
caches, as a cold compile does.

    python bench/trace_as_gpu.py --plans dense hash prism-g4 --layers 16
    python bench/trace_as_gpu.py --plans prism-g4 --layers 16 --no-memo       # torch's analysis at every call site
    python bench/trace_as_gpu.py --plans prism-g4 --layers 16 --profile --out DIR
    python bench/trace_as_gpu.py --plans dense hash --layers 2 --repeat 1 --dump --out DIR  # the traced graphs' code
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import statistics
import time

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]

# the 8B's head dim (128) and GQA ratio (4) in a narrow model
NARROW = dict(vocab_size=1024, hidden_size=1024, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
SMS, CAPABILITY = 132, (9, 0)  # an H100's


class Traced(Exception):
    """Raised by the stand-in for Inductor once AOTAutograd is done: the graph is never run."""


@contextlib.contextmanager
def as_gpu():
    """Our launchers take their Triton path on CPU fake tensors, as on an H100; all undone after."""
    import importlib
    import pkgutil

    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    import sparse_fx.lowering.kernels as kernels

    class Driver:  # what torch's kernel analysis asks of Triton's active driver
        def get_current_target(self):
            return GPUTarget("cuda", CAPABILITY[0] * 10 + CAPABILITY[1], 32)

    patches = [(torch.cuda, "current_device", lambda: 0)]
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        for name, value in (("on_kernel_device", lambda *tensors: True), ("num_sms", lambda device: SMS),
                            ("_capability_of", lambda index: CAPABILITY), ("_sm_count", lambda index: SMS)):
            if hasattr(module, name):
                patches.append((module, name, value))
    # the ops choose kernels by `tensor.is_cuda`: the graph's fake tensors answer yes
    patches += [(cls, "is_cuda", property(lambda self: True)) for cls in (FakeTensor, FunctionalTensor)]
    saved = [(owner, name, name in vars(owner), vars(owner).get(name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    driver.set_active(Driver())
    try:
        yield
    finally:
        driver.reset_active() if driver._default is not None else setattr(driver, "_active", None)
        for owner, name, own, value in saved:
            if own:
                setattr(owner, name, value)
            else:
                delattr(owner, name)  # inherited before (a tensor class's is_cuda): inherited again


def trace_one(plan: str, layers: int, memo: bool, profile: str = "", dump: str = "") -> dict:
    """Dynamo, our rewrite and AOTAutograd of one plan's decode graph; the row."""
    import torch
    import torch._inductor.compile_fx as compile_fx
    from torch._functorch.aot_autograd import aot_module_simplified

    import sparse_fx
    import sparse_fx.lowering.kernels  # noqa: F401 - installs the memo, as a CUDA compile's first launch does
    from benchlib.llama import build_model, random_static_cache

    torch._dynamo.reset()
    analysis = benchlib.kernel_analysis()
    memoised = hasattr(analysis, "sparse_fx_memo")
    if memoised:
        analysis.sparse_fx_memo.clear()
        analysis.sparse_fx_hits = 0
    row = {"plan": plan, "layers": layers, "memo": memo and memoised}
    asked = []

    def count(*args, **kwargs):
        asked.append(1)
        return (analysis if memo else analysis.__wrapped__)(*args, **kwargs)

    def aot_only(gm, example_inputs, **_):
        graphs = []

        def keep(g, _inputs):
            graphs.append(g)
            return g.forward

        profiler = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        with torch.no_grad(), (profiler or contextlib.nullcontext()):
            aot_module_simplified(gm, list(example_inputs), fw_compiler=keep)
        row["aot_s"] = time.perf_counter() - t0
        if profiler:
            benchlib.write_profile(profiler, profile)
        nodes = graphs[0].graph.nodes
        if dump:
            with open(dump, "w") as f:
                f.write(graphs[0].print_readable(print_output=False))
        row.update(dynamo_nodes=len(gm.graph.nodes), aot_nodes=len(nodes),
                   kernel_launches=sum(1 for n in nodes if "triton_kernel_wrapper" in str(n.target)))
        raise Traced

    model = build_model(layers, "cpu", **NARROW)
    cache = random_static_cache(model, 1, 8192, 64, device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, 1))
    from torch._higher_order_ops import triton_kernel_wrap

    real_compile, real_analysis = compile_fx.compile_fx, getattr(triton_kernel_wrap, analysis.__name__)
    compile_fx.compile_fx = aot_only
    setattr(triton_kernel_wrap, analysis.__name__, count)
    t0 = time.perf_counter()
    try:
        with as_gpu(), torch.no_grad():
            if plan == "dense":
                forward = torch.compile(model.forward, backend=lambda gm, inputs: compile_fx.compile_fx(gm, inputs),
                                        fullgraph=True)
            else:
                sparse_fx.compile(model, plan, budget=1024, sink=128, local=128, min_context=0)
                sparse_fx.attach_cache(model, cache)
                forward = model.forward
            forward(ids, past_key_values=cache, use_cache=True)
        raise RuntimeError(f"{plan}: the model ran without reaching the compiler")
    except Exception as e:  # noqa: BLE001 - Dynamo wraps what the backend raises
        if not any(isinstance(x, Traced) for x in _chain(e)):
            raise
    finally:
        compile_fx.compile_fx = real_compile
        setattr(triton_kernel_wrap, analysis.__name__, real_analysis)
    row["to_traced_s"] = time.perf_counter() - t0
    row["analyses_asked"] = len(asked)
    row["analyses_run"] = len(asked) - (analysis.sparse_fx_hits if memo and memoised else 0)
    return row


def _chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def summary(rows: list[dict]) -> list[dict]:
    """One row a plan: the median of its repeats' times, its counts (the same in every repeat)."""
    out = []
    for plan in dict.fromkeys(r["plan"] for r in rows):
        runs = [r for r in rows if r["plan"] == plan]
        out.append({**runs[0], "aot_s": statistics.median(r["aot_s"] for r in runs),
                    "to_traced_s": statistics.median(r["to_traced_s"] for r in runs),
                    "aot_s_runs": [r["aot_s"] for r in runs], "repeats": len(runs)})
    return out


def table(rows: list[dict], meta: dict) -> str:
    dense = next((r["aot_s"] for r in rows if r["plan"] == "dense"), None)
    out = [f"AOTAutograd of the decode graph traced as on an H100, on the CPU ({meta['machine']}, torch "
           f"{meta['versions']['torch']}), `{meta['command']}`; seconds, median of {rows[0]['repeats']} fresh traces",
           "", "| plan | layers | kernel analysis memo | AOTAutograd s | vs dense | Dynamo + rewrite + AOT s | "
           "graph nodes (Dynamo) | after AOT | kernel launches | analyses asked | run |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['aot_s'] / dense:.2f}x" if dense else "-"
        out.append(f"| {r['plan']} | {r['layers']} | {'on' if r['memo'] else 'off'} | {r['aot_s']:.2f} | {ratio} | "
                   f"{r['to_traced_s']:.2f} | {r['dynamo_nodes']} | {r['aot_nodes']} | {r['kernel_launches']} | "
                   f"{r['analyses_asked']} | {r['analyses_run']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plans", nargs="+", default=["dense", "hash", "prism-g4"])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="fresh traces a plan (the median is reported)")
    p.add_argument("--no-memo", action="store_true", help="torch's kernel analysis at every call site (our memo off)")
    p.add_argument("--profile", action="store_true", help="cProfile each plan's first AOTAutograd: PROF files and "
                   "text summaries in the output folder")
    p.add_argument("--dump", action="store_true", help="write each plan's traced graph (its readable code) to the "
                   "output folder")
    p.add_argument("--stem", default="", help="results file name (default: aot-trace-<date>)")
    benchlib.add_out(p)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("TRITON_INTERPRET", None)  # the interpreter would launch the kernels, not trace them
    rows = []
    for plan in a.plans:
        for i in range(a.repeat):
            prof = os.path.join(a.out, f"aot-trace-{plan}-{a.layers}layers.prof") if a.profile and not i else ""
            dump = os.path.join(a.out, f"aot-trace-{plan}-{a.layers}layers.graph.py") if a.dump and not i else ""
            rows.append(trace_one(plan, a.layers, not a.no_memo, prof, dump))
            print(json.dumps(rows[-1]), flush=True)
    meta = benchlib.header(a)
    rows = summary(rows)
    stem = a.stem or f"aot-trace-{time.strftime('%Y-%m-%d-%H%M')}"
    benchlib.save(a.out, stem, {"meta": meta, "rows": rows}, markdown=table(rows, meta), keep_others=True)
    print(table(rows, meta))


if __name__ == "__main__":
    main()
