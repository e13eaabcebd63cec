"""bench's library: what the scripts share. A script imports it as `benchlib` (a script's own folder,
bench/, is sys.path[0] when it runs); no script imports another script.

    p = argparse.ArgumentParser(...)
    benchlib.add_out(p)                                   # --out DIR, default bench/results, created
    a = p.parse_args()
    data = {"meta": benchlib.header(a), "rows": rows}    # every JSON carries its header as "meta"
    benchlib.save(a.out, "decode-2026-11-30", data, markdown=table, plot=lambda path: draw(rows, path))

  benchlib            (results.py, timing.py) results on disk: add_out, header, where, save, load,
                      source_hash, set_kernel_constant; plots: pyplot, axes, tradeoff, savefig; GPU
                      timing: time_graph, kernel_times, per_kernel, bandwidth_gbps, stream, compile_phases,
                      kernel_analysis, write_profile
  benchlib.layers     random decode layers for the kernel benches (Layers, OPS, DENSE_BACKENDS,
                      fastest) and the bytes a step must read (step_floor_bytes, int2_key_bytes)
  benchlib.llama      the Llama-3.1-8B-shaped model of the end-to-end benches (LLAMA_8B, build_model,
                      random_static_cache, sdpa_gqa_attention) and a decode step's time (time_decode)

`import benchlib` imports nothing heavy, so that a script's `--help` stays fast; `benchlib.layers`
and `benchlib.llama` import torch (and the ops), and a script imports them after parsing its flags.
"""

from .results import (BENCH, RESULTS, ROOT, add_out, axes, header, load, pyplot, save, savefig, set_kernel_constant,
                      source_hash, tradeoff, where)
from .timing import (COMPILE_PHASES, bandwidth_gbps, compile_phases, kernel_analysis, kernel_times, per_kernel,
                     stream, time_graph, write_profile)

__all__ = [
    "BENCH", "RESULTS", "ROOT", "add_out", "axes", "header", "load", "pyplot", "save", "savefig", "set_kernel_constant",
    "source_hash", "tradeoff", "where",
    "COMPILE_PHASES", "bandwidth_gbps", "compile_phases", "kernel_analysis", "kernel_times", "per_kernel", "stream",
    "time_graph", "write_profile",
]
