"""The kernel launchers at a symbolic cache length (one decode graph serves every length) guard ranges
of the length, about one an octave, never its value: a new length reuses a graph.

Each launcher is traced as Inductor traces it inside a graph: meta tensors whose length is a symbol
of a ShapeEnv, the Triton launches recorded instead of run, the device answering as a 132-SM GPU. A
stream of growing cache lengths (as generate() sizes them, every 256 slots) then reuses the first
graph whose guards hold at its length, else opens one; the count of graphs is what a user whose
prompts grow from 2K to 160K pays in compiles.
"""

from __future__ import annotations

import sys

import pytest
import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from sparse_fx.lowering import kernels as K
from sparse_fx.lowering.kernels import common, gather_attention, int2, select, signatures

Hkv, G, D, BUDGET, SINK, LOCAL = 8, 4, 128, 4096, 128, 128  # the Llama-3.1-8B shape, the plans' defaults
LENGTHS = range(2048 + 256, 163840 + 1, 256)
MOST = 10  # graphs over 2.3K-160K: 6 octaves, and a few ranges where a launcher changes layout


@pytest.fixture(autouse=True)
def as_on_a_gpu(monkeypatch):
    for module in (common, select, int2, signatures, gather_attention, sys.modules[K.few_query_attention.__module__]):
        for name, value in dict(num_sms=lambda device: 132, pdl=lambda device: {}, on_kernel_device=lambda *t: True).items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, value)

    class Recorded:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: Recorded())


def _empty(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def verify(B, L):
    K.few_query_attention(_empty(B, Hkv * G, 5, D), _empty(B, Hkv, L, D), _empty(B, Hkv, L, D), None,
                          _empty(B, 1, 5, L, dtype=torch.bool))


def hash_draft(B, L):
    K.hash_select(_empty(B, Hkv * G, 32), _empty(B, Hkv, L, 1, dtype=torch.int32), _empty(B, dtype=torch.int64), BUDGET,
                  SINK, LOCAL, _empty(B, 1, 1, L, dtype=torch.bool), None)


def prism_proposal(B, L):
    scores = K.int2_scores(_empty(B, Hkv * G, 1, D), _empty(B, Hkv, L, D // 16, dtype=torch.int32),
                           _empty(B, Hkv, L, 16), _empty(B, dtype=torch.int64))
    K.select_topk(scores, _empty(B, dtype=torch.int64), 4 * BUDGET, SINK, LOCAL, _empty(B, 1, 1, L, dtype=torch.bool),
                  k_inner=BUDGET)


def guards(launch, B: int, L: int) -> tuple[list, sympy.Symbol]:
    """The guards a launch at symbolic length (hinted L) leaves, and the length's symbol."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    length = mode.from_tensor(_empty(L), symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])).shape[0]
    with mode:
        launch(B, length)
    (symbol,) = length.node.expr.free_symbols
    return [g.expr for g in env.guards], symbol


def graphs_over(launch, B: int) -> list[int]:
    """The lengths at which a stream of growing lengths opens a new graph."""
    graphs, opened = [], []
    for L in LENGTHS:
        if any(all(bool(g.xreplace({s: sympy.Integer(L)})) for g in gs) for gs, s in graphs):
            continue
        graphs.append(guards(launch, B, L))
        opened.append(L)
    return opened


@pytest.mark.parametrize("launch", [verify, hash_draft, prism_proposal])
@pytest.mark.parametrize("B", [1, 4])
def test_launchers_guard_octaves_of_the_cache_length_not_its_value(launch, B):
    opened = graphs_over(launch, B)
    assert len(opened) <= MOST, f"{launch.__name__} at batch {B} opens a graph at each of {opened}"


def test_the_symbolic_launch_of_the_verify_attention_reads_aligned_units(monkeypatch):
    """At a symbolic length that is a multiple of 16, the verify kernel takes the length and the mask's
    strides in 16-slot units (the guard is on the residue); its split count is a number, not a symbol."""
    seen = {}

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.setdefault("grid", grid)
                seen.setdefault("align", kwargs.get("ALIGN"))
            return launch

    monkeypatch.setattr(torch.library, "wrap_triton", lambda kernel: Recorded())
    found, symbol = guards(verify, 4, 139264)
    assert seen["align"] == 16 and all(isinstance(x, int) for x in seen["grid"]), seen
    assert any(str(g) == f"Eq(Mod({symbol}, 16), 0)" for g in found), found
