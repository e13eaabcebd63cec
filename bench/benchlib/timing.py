"""GPU timing shared by the benches: CUDA-graph replays, torch.profiler per kernel, the
bandwidth ceilings the rooflines divide by, and torch.compile's phases.

torch and triton are imported inside the functions, so that importing this stays cheap.
"""

from __future__ import annotations

import functools

# torch.compile's phases (torch._dynamo.utils.compile_times' names) worth a column, in the order a
# compile runs them; the first spans all the others (Dynamo's tracing and the whole backend)
COMPILE_PHASES = (
    "_compile.compile_inner", "bytecode_tracing", "aot_collect_metadata", "_recursive_joint_graph_passes",
    "_recursive_post_grad_passes", "GraphLowering.run", "Scheduler.__init__", "Scheduler.codegen",
    "PyCodeCache.load_by_key_path", "async_compile.wait",
)


def compile_phases(since: dict | None = None) -> dict[str, float]:
    """Seconds this process has spent in each of COMPILE_PHASES (less `since`, an earlier reading)."""
    from torch._dynamo.utils import compilation_time_metrics as spent  # name -> [seconds per call]

    since = since or {}
    return {k: float(sum(spent[k])) - since.get(k, 0.0) for k in COMPILE_PHASES if k in spent}


def write_profile(profiler, path: str) -> None:
    """A cProfile's raw stats at `path` (`pstats` reads them) and a text summary beside them (`path`.txt),
    by own time and by cumulative time (a slow phase's callees are what it is made of)."""
    import pstats

    profiler.dump_stats(path)
    with open(path + ".txt", "w") as f:
        for order in ("tottime", "cumulative"):
            pstats.Stats(path, stream=f).sort_stats(order).print_stats(60)


def kernel_analysis():
    """torch's analysis of which tensors a user-defined Triton kernel reads and writes, as installed
    (our memo around it once `sparse_fx.lowering.kernels` is imported: `sparse_fx_memo`, `sparse_fx_hits`);
    None on a torch without it."""
    from torch._higher_order_ops import triton_kernel_wrap

    return next((getattr(triton_kernel_wrap, n) for n in ("identify_accessed_tensors", "identify_mutated_tensors")
                 if hasattr(triton_kernel_wrap, n)), None)


def time_graph(fn, target_ms: float = 40.0, windows: int = 5) -> float:
    """Median ms of one fn() call, from replays of a CUDA graph of it (launch gaps as in a
    captured decode step; warm-up and capture on a side stream first)."""
    import statistics

    import torch

    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    g.replay()
    e1.record()
    e1.synchronize()
    n = max(3, min(500, int(target_ms / max(e0.elapsed_time(e1), 1e-3))))
    times = []
    for _ in range(windows):
        e0.record()
        for _ in range(n):
            g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / n)
    return statistics.median(times)


@functools.lru_cache(maxsize=None)
def _stream_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stream(x_ptr, y_ptr, part_ptr, n, BLOCK: tl.constexpr, COPY: tl.constexpr):
        # a plain loop: at 8 programs of 8 warps an SM, 64 KB of loads are in flight per SM, more
        # than the bandwidth-latency product needs, so no software pipelining is wanted
        pid, progs = tl.program_id(0), tl.num_programs(0)
        acc = tl.zeros([BLOCK], tl.float32)
        start = pid * BLOCK
        while start < n:
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
            if COPY:
                tl.store(y_ptr + offs, x, mask=offs < n)
            acc += x.to(tl.float32)
            start += progs * BLOCK
        tl.store(part_ptr + pid, tl.sum(acc, axis=0))

    return stream


def stream(x, part, y=None, block: int = 4096):
    """Read x (and, given y, copy it there) with a grid-stride Triton kernel, one partial sum per
    program into `part` (its length is the grid): streaming by the SMs, as the decode kernels read.
    (Tensor.copy_ in a CUDA graph is a memcpy node, served at ~2.7 TB/s read + written on an H200,
    where this copy reaches ~3.65 and this read ~4.5; bench/NOTES.md.)"""
    _stream_kernel()[(part.numel(),)](x, x if y is None else y, part, x.numel(), BLOCK=block, COPY=y is not None,
                                      num_warps=8)


def bandwidth_gbps() -> dict[str, float]:
    """The ceilings the rooflines divide by, measured on a 2 GiB bf16 buffer after warming the
    clocks: `copy`, an SM copy counting bytes read + written (METHOD.md's reference), and `read`,
    a read-only stream (what a decode kernel, which reads nearly all it moves, can reach). GB/s."""
    import torch

    a = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    part = torch.empty(8 * torch.cuda.get_device_properties(a.device).multi_processor_count, device="cuda")
    out = {}
    for name, y in (("copy", b), ("read", None)):
        for _ in range(10):
            stream(a, part, y)
        ms = time_graph(lambda: stream(a, part, y), target_ms=200)
        out[name] = (1 if y is None else 2) * a.numel() * a.element_size() / ms / 1e6
    assert torch.equal(b, a), "the copy kernel is wrong"
    return out


def kernel_times(fn, reps: int = 5) -> dict[str, tuple[float, int]]:
    """Per kernel name: (device us per fn() call, launches per call), by torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return per_kernel(prof.key_averages(), reps)


def per_kernel(events, reps: int) -> dict[str, tuple[float, int]]:
    """Profiler events -> {kernel name: (device us per call, launches per call)}. Names are kept whole
    (Inductor's run to 60 characters and more, sharing long prefixes); events of one name, e.g. a
    kernel whose argument list differs, are added up, never overwritten."""
    out: dict[str, tuple[float, int]] = {}
    for e in events:
        if e.device_time_total > 0:
            name = e.key.split("(")[0]
            us, launches = out.get(name, (0.0, 0))
            out[name] = (us + e.device_time_total / reps, launches + e.count // reps)
    return out
