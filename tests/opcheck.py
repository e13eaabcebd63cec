"""Shared tools of the op tests (tests/test_op_*.py): devices, fresh random inputs, SDPA masks of
every form, and poisoned allocations.

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (small shapes: the
interpreter is slow); with CUDA the same tests run on the GPU, plus the `gpu`-marked ones at real
shapes. Outputs and kernel scratch are poisoned (NaN / a sentinel) before the kernels write, so an
element a kernel forgets to write, or scratch it reads before writing, shows up.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from hypothesis import HealthCheck, settings  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
SENTINEL = -777_777_777
FAST = settings(deadline=None, max_examples=8, suppress_health_check=list(HealthCheck))
MORE = settings(deadline=None, max_examples=25 if CUDA else 12, suppress_health_check=list(HealthCheck))
MASK_KINDS = ["none", "bool", "bool-head", "inf", "min", "inf-head"]


@contextlib.contextmanager
def poisoned():
    """torch.empty / empty_like hand out NaN- or sentinel-filled memory while the kernels allocate."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype in (torch.int16, torch.int32, torch.int64):
            t.fill_(SENTINEL % 2**15 if t.dtype == torch.int16 else SENTINEL)
        elif t.dtype == torch.uint8:
            t.fill_(0xA5)
        return t

    torch.empty = lambda *a, **kw: fill(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: fill(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def make_mask(kind: str, B: int, Hq: int, L: int, g, dtype=torch.float32, now: int | None = None):
    """SDPA masks of every form the ops accept: None, bool [B,1,1,L], bool per head, additive with
    -inf, additive with finfo.min (Hugging Face's), per-head additive; small finite biases too."""
    if kind == "none":
        return None
    heads = Hq if kind.endswith("head") else 1
    keep = torch.rand(B, heads, 1, L, generator=g) > 0.25
    if now is not None:
        keep[..., now + 1 :] = False
    if kind.startswith("bool"):
        return keep.to(DEV)
    fill = float("-inf") if kind.startswith("inf") else torch.finfo(dtype).min
    m = torch.zeros(B, heads, 1, L).masked_fill(~keep, fill)
    m = m + 0.1 * torch.randn(B, heads, 1, L, generator=g) * keep
    return m.to(dtype).to(DEV)
