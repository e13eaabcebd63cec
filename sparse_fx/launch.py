"""Programmatic dependent launch for our kernels inside Inductor's generated code.

A kernel compiled with `PDL` >= 1 (lowering/kernels/common.py) waits at entry for the kernel
before it, so it may be launched with CUDA's programmatic-serialization attribute: dispatched while
that kernel drains. Eager launches pass Triton's `launch_pdl`; Inductor has no such option for
user-defined kernels (its own `triton.enable_pdl` covers only the kernels it generates), so this
sets the attribute on the launchers it builds for kernels whose compiled constants carry PDL >= 1,
and only those: a kernel without the wait at entry must never be launched early.
"""

from __future__ import annotations

import functools


@functools.cache
def install() -> bool:
    """Patch Inductor's launcher factory once; False where this torch has no hook for it (the
    kernels then run correctly without the attribute: their wait at entry is a no-op)."""
    try:
        from torch._inductor.runtime.triton_heuristics import TritonCompileResult
    except ImportError:
        return False
    make_launcher = getattr(TritonCompileResult, "make_launcher", None)
    if make_launcher is None:
        return False

    @functools.wraps(make_launcher)
    def with_pdl(self):
        constants = (getattr(self, "compile_meta", None) or {}).get("constants") or {}
        if constants.get("PDL", 0) >= 1:
            set_launch_pdl(self.kernel)
        return make_launcher(self)

    TritonCompileResult.make_launcher = with_pdl
    return True


def set_launch_pdl(binary) -> bool:
    """Mark a compiled Triton kernel for programmatic dependent launch (its launcher reads the flag
    from its metadata when it is built); False where its metadata has no such field."""
    metadata = getattr(binary, "metadata", None)
    if not hasattr(metadata, "launch_pdl") or not hasattr(metadata, "_replace"):
        return False
    if not metadata.launch_pdl:
        binary.metadata = metadata._replace(launch_pdl=True)
        if getattr(binary, "_run", None) is not None:  # a launcher already built: build it again
            from triton.runtime.driver import driver

            binary._run = driver.active.launcher_cls(binary.src, binary.metadata)
    return True
