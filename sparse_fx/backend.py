"""The torch.compile backend: rewrite the decode graph, then hand it to Inductor (or run it)."""

from __future__ import annotations

import functools

import torch

from . import launch
from .compiled import CompiledState
from .rewrite import rewrite

FUSION_PAIR_WINDOW = 8  # Inductor's max_fusion_buffer_group_pairwise_attempts for our compiles (torch's: 64)
# Inductor's static CUDA launcher for its own kernels in our graphs (ours use Triton's launcher either
# way). Off since a SIGSEGV under CUDA-graph recording on torch 2.11 (2026-11-29), seen while the
# graphs also read freed memory (fixed since); with it off, loading a cached graph builds a Triton
# launcher per kernel: ~10 s of a 32-layer restart. `bench/compile_time.py --static-launcher` A/Bs it.
STATIC_LAUNCHER = False


def sparse_backend(state: CompiledState):
    """A torch.compile backend bound to one compiled model's state."""

    def sparse_fx_backend(gm: torch.fx.GraphModule, example_inputs):
        report = rewrite(gm, state)
        state.record(report)
        if state.strict and report.decode:
            _check_strict(state, report)
        if state.backend == "eager":
            return gm.forward
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        from .lowering.ops import salt_compile_caches

        salt_compile_caches()
        launch.install()  # our kernels compiled with PDL get the launch attribute (sparse_fx/launch.py)
        on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
        mode = state.mode or ("reduce-overhead" if on_cuda else "default")
        import torch._inductor.config as inductor_config

        patches = dict(list_mode_options(mode))  # scoped to this compile: global config stays as it was
        if hasattr(inductor_config, "max_fusion_buffer_group_pairwise_attempts"):
            # The fusion search tries each node against the next N nodes that read the same buffer.
            # Every layer's glue reads the cache position, so that buffer's group grows with depth
            # (51 nodes at 4 layers) and at torch's 64 its pairs dominate the search; the nodes that
            # can fuse through it are one layer's own, a few apart in the group (bench/compile_time.py
            # counts the nodes left after fusion: the same either way).
            patches["max_fusion_buffer_group_pairwise_attempts"] = FUSION_PAIR_WINDOW
        if hasattr(inductor_config, "use_static_cuda_launcher"):
            patches["use_static_cuda_launcher"] = STATIC_LAUNCHER
        if hasattr(inductor_config, "unsafe_marked_cacheable_functions"):
            patches["unsafe_marked_cacheable_functions"] = {**inductor_config.unsafe_marked_cacheable_functions,
                                                           **_cacheable_functions(gm)}
        return compile_fx(gm, example_inputs, config_patches=patches)

    return sparse_fx_backend


def _cacheable_functions(gm: torch.fx.GraphModule) -> dict[str, str]:
    """The Python functions of ours the rewrite calls in the graph (apply_head_mlp, gqa_attention,
    first_readable), each keyed by the hash of this package's source: AOTAutograd's cache refuses a
    graph that calls a function it does not know, so a restarted process traced the whole graph again.
    They are pure functions of their tensors; measure.record, a hook with side effects, is not marked."""
    from . import measure

    names = {f"{n.target.__module__}.{n.target.__name__}" for n in gm.graph.nodes
             if n.op == "call_function" and callable(n.target) and n.target is not measure.record
             and getattr(n.target, "__module__", "").startswith("sparse_fx.")}
    return dict.fromkeys(sorted(names), _package_source_hash())


@functools.lru_cache(maxsize=None)
def _package_source_hash() -> str:
    """The digest of every .py file of sparse_fx (its lowering and runtime included, wherever they lie)."""
    from . import lowering, runtime
    from .lowering.ops import source_digest

    return source_digest(*(p for pkg in (__import__("sparse_fx"), lowering, runtime) for p in pkg.__path__))


def _check_strict(state: CompiledState, report) -> None:
    seen = {r.layer for r in report.rows}
    missed = [f"layer {r.layer}: {r.reason}" for r in report.rows
              if r.action == "dense" and r.role != "dense" and not r.short]  # short: the plan wants dense there
    missed += [f"layer {i}: no scaled_dot_product_attention call in the traced graph"
               for i, role in enumerate(state.roles) if role != "dense" and i not in seen]
    if missed:
        raise RuntimeError(f"sparse_fx (strict): {len(missed)} attention(s) the plan wants sparse stay dense: "
                           + "; ".join(missed))
