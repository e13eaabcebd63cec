"""The ops as a compiler sees them: every kernel configuration compiles for sm_90 without spills,
Inductor's analysis sees each kernel write only its outputs and scratch (never a graph input), and
under Inductor on the CPU the ops whose reference is exact give the reference bit for bit."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from support import gen

from sparse_fx.lowering import ops  # registers torch.ops.sparse_fx
from sparse_fx.lowering import reference as ref

NVIDIA_TOOLS = (pathlib.Path(__import__("triton").__file__).parent / "backends/nvidia/bin/ptxas").exists()
needs_tools = pytest.mark.skipif(not NVIDIA_TOOLS, reason="triton without the NVIDIA backend tools")
WRITABLE = {"out_ptr", "inner_ptr", "keys_ptr", "cum_ptr", "ckey_ptr", "tot_ptr", "scr_ptr", "pm_ptr", "pl_ptr", "pacc_ptr", "codes_ptr",
            "params_ptr"}  # outputs, the caches an op writes, and scratch it allocates


def _compile_check(*flags: str) -> str:
    """Run lowering/kernels/compile_check.py in a process without TRITON_INTERPRET (the kernels
    must be JITFunctions to compile)."""
    return _compile_checks(flags)[0]


# Every other scenario of compile_check, in a process of its own: its report's lines are those of
# the whole run (one line a launch, each scenario's launches in one part), in another order.
_PART = ("import sys; from sparse_fx.lowering.kernels import compile_check as cc; part, parts = map(int, sys.argv[1:3]); "
         "every = cc._scenarios; cc._scenarios = lambda: (s for i, s in enumerate(every()) if i % parts == part); "
         "sys.argv[1:] = sys.argv[3:]; cc.main()")


def _compile_checks(*runs: tuple, parts: int = 1) -> list[str]:
    """compile_check's reports for each tuple of flags in `runs`, the runs (and, with parts > 1,
    that many parts of each run, split by scenario) in processes started together: each is one
    core's work (--loops is a cuobjdump -sass per launch), so two cores take half the time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argvs = [[sys.executable, "-m", "sparse_fx.lowering.kernels.compile_check", *flags] if parts == 1 else
             [sys.executable, "-c", _PART, str(part), str(parts), *flags] for flags in runs for part in range(parts)]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in argvs]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, err[-4000:]
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ["".join(outs[i * parts:(i + 1) * parts]) for i in range(len(runs))]


# Stack frames (spilled registers) measured on paths off the Llama-shaped decode step: the fp32-query
# and head-dim-256 INT2 scans (904 and 112 bytes since the scan's body serves pools too, 2026-12-02;
# 5216 and 104 before), and the trim of a 16384-token budget (its list in registers, 16 slots a
# thread of 32 warps). A kernel may not spill more than this, and every other kernel not at all.
KNOWN_STACK = {("int2_scores fp32", "_int2_scores_kernel"): 904, ("int2 d256 g8 fp16", "_int2_scores_kernel"): 112,
               ("mass_select trimmed", "_trim_kernel"): 112}


@needs_tools
def test_gpu_code_paths_compile_for_sm90_without_spills():
    """The GPU-only paths (pipelined loops, tensor-core dots, popc) the interpreter never runs."""
    rows = re.findall(r"^(.+?)\s{2,}(_\w+)\s+regs\s+(\d+) local\s+(\d+) stack\s+(\d+) smem\s+(\d+)$", _compile_check(), re.M)
    assert len(rows) >= 30
    spills = [r for r in rows if int(r[3]) > 0 or int(r[4]) > KNOWN_STACK.get((r[0].strip(), r[1]), 0)]
    assert not spills, f"register spills: {spills}"


@needs_tools
def test_int2_operands_built_in_place_take_fewer_instructions_a_tile():
    """compile_check --loops counts each launch's longest loop in SASS; the INT2 scan's variant
    that builds MMA operand registers in place (3) must stay cheaper than the one that joins halves
    back into channel order (2), or it has lost its reason to exist."""
    (report,) = _compile_checks(("--loops",), parts=2)
    loops = dict(((s.strip(), k), int(n)) for s, k, n in re.findall(r"^(.+?)\s{2,}(_\w+)\s+loop\s+(\d+)", report, re.M))
    assert len(loops) >= 30, loops  # kernels without a loop count 0
    v2, v3 = loops[("int2_scores v2", "_int2_scores_kernel")], loops[("int2_scores v3", "_int2_scores_kernel")]
    assert v3 < 0.9 * v2, (v2, v3)


@needs_tools
def test_inductor_sees_each_kernel_write_only_outputs_and_scratch():
    """A graph input a kernel seems to write (through a helper call on the path to a store
    address) is functionalised as mutated: copied back, or CUDA graphs skip the step."""
    rows = re.findall(r"^(.+?)\s{2,}(_\w+)\s+writes ?(.*)$", _compile_checks(("--writes",), parts=2)[0], re.M)
    assert len(rows) >= 30
    for scenario, kernel, written in rows:
        extra = set(written.split()) - WRITABLE
        assert not extra, f"{scenario} / {kernel} is seen writing its inputs {sorted(extra)}"


def test_compile_caches_key_on_the_ops_source():
    """A compiled graph holds our ops as opaque calls, so the caches' key must change with their code."""
    import hashlib
    import pathlib

    root = pathlib.Path(ops.__file__).parent
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(root.rglob("*.py")))).hexdigest()[:16]
    assert f"sparse_fx.lowering-{digest}" in torch.compiler.config.cache_key_tag
    with torch.compiler.config.patch(cache_key_tag="a user's tag"):  # reset after import: the backend salts again
        ops.salt_compile_caches()
        assert torch.compiler.config.cache_key_tag == f"a user's tag+sparse_fx.lowering-{digest}"


def test_exact_ops_under_inductor_equal_the_reference_bit_for_bit():
    """INT2 codes, signatures and selections compiled by Inductor on the CPU equal the eager reference."""
    g = gen(3)
    B, H, L, D, T = 2, 2, 64, 64, 9
    k = torch.randn(B, H, T, D, generator=g) * 3
    k.view(B, H, T, 2, 32)[:, :, 1, :, :4] = torch.tensor([0.0, 1.5, 2.5, 3.0])  # exact half steps
    logits = torch.randn(B, H, T, 32, generator=g)
    pos = torch.arange(20, 20 + T)
    scores = (torch.randn(B, H, L, generator=g) * 2).round() / 2
    q_logits = torch.randn(B, 2 * H, 32, generator=g)
    mask = torch.rand(B, 1, 1, L, generator=g) > 0.2
    o = torch.ops.sparse_fx

    def step(codes, params, sig):
        o.int2_write(codes, params, k, pos)
        o.signature_write(sig, logits, pos)
        chosen = o.select_topk(scores, pos, 12, 2, 3, mask, None, None)
        hashed = o.hash_select(q_logits, sig, pos, 12, 2, 3, mask, None)
        return chosen, hashed, *o.select_nested(scores, pos, 12, 5, 2, 3, mask, None)

    def buffers():
        return (torch.zeros(B, H, L, D // 16, dtype=torch.int32), torch.zeros(B, H, L, 4, dtype=torch.float16),
                torch.zeros(B, H, L, 1, dtype=torch.int32))

    eager_bufs, compiled_bufs = buffers(), buffers()
    torch._dynamo.reset()
    want = step(*eager_bufs)
    got = torch.compile(step, backend="inductor", fullgraph=True)(*compiled_bufs)
    for a, b in zip(eager_bufs, compiled_bufs):
        assert torch.equal(a, b)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    c, prm = ref.int2_quantize(k, 32)
    assert torch.equal(compiled_bufs[0][:, :, pos], c) and torch.equal(compiled_bufs[1][:, :, pos], prm)


# ------------------------------------------------------------------ registration (schema, fake tensors, AOT)
OPS = torch.ops.sparse_fx


def _opcheck_cases():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 32, generator=g), torch.randn(1, 2, 20, 32, generator=g), torch.randn(1, 2, 20, 32, generator=g)
    mask = torch.rand(1, 1, 1, 20, generator=g) > 0.2
    idx = torch.tensor([[[0, 5, -1, 7], [1, 2, 3, 19]]], dtype=torch.int32)
    codes, params = ref.int2_quantize(k, 16)
    sig = OPS.pack_signs(torch.randn(1, 2, 20, 32, generator=g))
    pos = torch.tensor([19])
    return [
        (OPS.sparse_decode_attention.default, (q, k, v, idx, 0.3, mask)),
        (OPS.few_query_attention.default, (q.expand(1, 4, 3, 32).contiguous(), k, v, 0.3, mask.expand(1, 1, 3, 20))),
        (OPS.pack_signs.default, (torch.randn(3, 64, generator=g),)),
        (OPS.hamming_scores.default, (OPS.pack_signs(torch.randn(1, 4, 32, generator=g)), sig)),
        (OPS.signature_write.default, (sig.clone(), torch.randn(1, 2, 1, 32, generator=g), pos)),
        (OPS.int2_write.default, (codes.clone(), params.clone(), torch.randn(1, 2, 1, 32, generator=g), pos)),
        (OPS.int2_scores.default, (q, codes, params, pos)),
        (OPS.int2_scores.default, (q, codes, params, pos, idx)),
        (OPS.mass_scores.default, (q, k, 0.3, mask, idx.long())),
        (OPS.select_topk.default, (torch.randn(1, 2, 20, generator=g), pos, 4, 2, 3, mask, None, torch.tensor([1]))),
        (OPS.hash_select.default, (torch.randn(1, 4, 32, generator=g), sig, pos, 4, 2, 3, mask, None)),
        (OPS.mass_select.default, (q, k, 0.3, mask, idx.long(), pos, 2, 1, 1, None)),
        (OPS.select_nested.default, (torch.randn(1, 2, 20, generator=g), pos, 6, 3, 2, 3, mask, torch.tensor([1]))),
        (OPS.hash_select_nested.default, (torch.randn(1, 4, 32, generator=g), sig, pos, 6, 3, 2, 3, mask, None)),
    ]


@pytest.mark.parametrize("op, args", _opcheck_cases(), ids=lambda x: getattr(x, "__name__", "")[:40])
def test_opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
