"""Compile time: remember Inductor's analysis of which tensors a Triton kernel reads and writes.

To functionalise and schedule a user-defined Triton kernel, torch lowers the kernel to Triton IR and
walks it at every call site: twice in AOTAutograd (collecting metadata, then capturing) and once when
building Inductor's IR. A 32-layer decode graph calls each of our kernels once a layer, so the same
analysis runs ~600 times on identical inputs. Its result depends only on the kernel and its
arguments' kinds: the kernel (a launch with options such as `num_warps` reaches it as a single-config
Autotuner that torch makes anew at every call site, so an Autotuner counts as the kernel it wraps and
its configs' values), each tensor's class and dtype (fake tensors and Inductor buffers are replaced by
2-element stand-ins), each symbolic size (replaced by 2) and each other argument's value. `install()`
memoises it on exactly that key; calls with anything else (descriptor metadata, unknown argument
kinds, configs with hooks) go through unchanged. Pure memoisation of a deterministic function of those
inputs: results are the same, only computed once. Only our own kernels (defined under `sparse_fx`) are
memoised; any other kernel's analysis runs as before. Ours are analysed without their
programmatic-dependent-launch wait (`PDL` 0), which the analysis cannot walk (inline assembly) and
which touches no memory. `bench/trace_as_gpu.py` counts the analyses a graph asks for and runs.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch

# torch's names for the analysis across 2.11-2.13: the newer returns reads and writes, the older
# the names of mutated arguments
ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
_SCALARS = (bool, int, float, str, type(None), torch.dtype)


def kernel_key(kernel):
    """The kernel's part of the memo key: the kernel itself, or for an Autotuner the kernel it wraps
    and every config's values (None where a config has hooks or values of a kind it does not know)."""
    from triton.runtime.autotuner import Autotuner

    if not isinstance(kernel, Autotuner):
        return kernel
    configs = []
    for config in kernel.configs:
        if getattr(config, "pre_hook", None) is not None or getattr(config, "ir_override", None) is not None:
            return None
        values = config.all_kwargs()
        if not all(isinstance(v, _SCALARS) for v in values.values()):
            return None
        configs.append(tuple(sorted(values.items())))
    return ("autotuned", kernel.fn, tuple(configs))


def argument_key(kernel, kwargs: dict, *rest):
    """The memo key of one analysis call, or None when an argument is of a kind it does not know."""
    if any(r not in (None, {}) for r in rest):
        return None
    kernel = kernel_key(kernel)
    if kernel is None:
        return None
    import sympy

    parts = []
    for name in sorted(kwargs):
        v = kwargs[name]
        if isinstance(v, torch.Tensor):  # the class too: torch tells tensors from other arguments by it
            parts.append((name, type(v).__name__, v.dtype))
        elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, sympy.Expr)):
            parts.append((name, "symbolic"))
        elif hasattr(v, "get_dtype") and hasattr(v, "get_size"):  # an Inductor buffer (TensorBox)
            parts.append((name, type(v).__name__, v.get_dtype()))
        elif isinstance(v, _SCALARS):
            parts.append((name, type(v).__name__, v))
        elif type(v).__name__ == "constexpr" and isinstance(getattr(v, "value", None), _SCALARS):
            parts.append((name, "constexpr", type(v.value).__name__, v.value))
        elif type(v).__module__.startswith("triton") and type(v).__name__ == "dtype":  # tl.bfloat16 and kin
            parts.append((name, "triton dtype", str(v)))
        else:
            return None
    return (kernel, tuple(parts))


def ours(kernel) -> bool:
    """Whether a kernel (a JITFunction, or an Autotuner around one) is defined in sparse_fx."""
    fn = getattr(kernel, "fn", None)
    fn = getattr(fn, "fn", fn)  # Autotuner -> JITFunction -> the Python function
    return str(getattr(fn, "__module__", "")).startswith("sparse_fx")


def memoised(analysis, only=ours):
    """`analysis` with a memo keyed by `argument_key` for the kernels `only` accepts; results are
    copied out, never shared. `wrapper.sparse_fx_memo` holds the memo, `wrapper.sparse_fx_hits`
    counts the calls it answered."""
    memo: dict = {}

    signature = inspect.signature(analysis)

    @functools.wraps(analysis)
    def wrapper(*args, **kw):
        try:
            bound = signature.bind(*args, **kw)
            values = list(bound.arguments.values())
            if only(values[0]) and values[1].get("PDL", 0):
                # the wait at entry of a kernel compiled for programmatic dependent launch is inline
                # assembly, which the analysis cannot walk; it touches no memory, so the kernel
                # without it reads and writes the same tensors
                values[1] = bound.arguments[list(bound.arguments)[1]] = {**values[1], "PDL": 0}
                args, kw = bound.args, bound.kwargs
            key = argument_key(*values) if only(values[0]) else None
            hash(key)
        except Exception:  # noqa: BLE001 - anything unexpected: torch's own path, unmemoised
            key = None
        if key is None:
            return analysis(*args, **kw)
        if key in memo:
            wrapper.sparse_fx_hits += 1
        else:
            memo[key] = analysis(*args, **kw)
        try:
            return copy.deepcopy(memo[key])
        except Exception:  # noqa: BLE001 - a result that cannot be copied is not memoised
            del memo[key]
            return analysis(*args, **kw)

    wrapper.sparse_fx_memo = memo
    wrapper.sparse_fx_hits = 0
    return wrapper


def install() -> None:
    """Wrap torch's kernel-access analysis (once per process; a torch without it is left alone)."""
    import sys

    try:
        from torch._higher_order_ops import triton_kernel_wrap
    except ImportError:
        return
    wrapped = {}
    # Inductor's IR may have bound the analysis at its import (some torch versions): patch it there if
    # it is loaded; one imported later binds the patched name
    for module in (triton_kernel_wrap, sys.modules.get("torch._inductor.ir")):
        if module is None:
            continue
        for name in ANALYSES:
            fn = getattr(module, name, None)
            if fn is None or hasattr(fn, "sparse_fx_memo"):
                continue
            if fn not in wrapped:
                wrapped[fn] = memoised(fn)
            setattr(module, name, wrapped[fn])
