"""Compile every kernel configuration the launchers use for an NVIDIA target, without a GPU.

The interpreter runs the kernels' logic on CPU, but not the GPU-only code paths (pipelined `for`
loops, bf16 tensor-core dots) and not the compiler. triton ships ptxas, so the launchers are called
here with CPU tensors while `wrap_triton` is patched to record each launch instead of running it;
each recorded launch is then compiled for sm_90 with the same constexprs and options. Run it in a
process *without* TRITON_INTERPRET (the kernels must be JITFunctions):

    python -m sparse_fx.lowering.kernels.compile_check           # registers / spills / smem per launch
    python -m sparse_fx.lowering.kernels.compile_check --loops   # SASS instructions of each launch's longest loop
    python -m sparse_fx.lowering.kernels.compile_check --writes  # what Inductor would see each launch write
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_TY = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
    torch.int32: "i32", torch.int64: "i64", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}


@contextlib.contextmanager
def recording():
    """Within the block, wrap_triton(kernel)[grid](...) records (kernel, grid, args, kwargs)."""
    launches = []

    def fake_wrap(kernel):
        class _Grid:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.append((kernel, grid, args, kwargs))

        return _Grid()

    real = torch.library.wrap_triton
    torch.library.wrap_triton = fake_wrap
    try:
        yield launches
    finally:
        torch.library.wrap_triton = real


def _signature(kernel, args, kwargs):
    names = [p.name for p in kernel.params]
    constexpr = {p.name for p in kernel.params if p.is_constexpr}
    values = dict(zip(names, args))
    options = {}
    for key, v in kwargs.items():
        if key in names:
            values[key] = v
        else:
            options[key] = v
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = values[name]
        if name in constexpr:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + _TY[v.dtype]
            if v.data_ptr() % 16 == 0:  # as the launcher specialises 16-byte aligned pointers
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, int):
            if v == 1:  # triton specialises integer arguments equal to 1
                sig[name], consts[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v is None:
            sig[name], consts[name] = "constexpr", None
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot type argument {name}={v!r}")
    return sig, consts, attrs, options


def compile_launch(kernel, args, kwargs, arch: int = 90):
    sig, consts, attrs, options = _signature(kernel, args, kwargs)
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _scenarios():
    """Launcher calls covering every constexpr path the ops take at real shapes (CPU tensors)."""
    from .. import kernels as K

    B, Hkv, G, L, D = 1, 8, 4, 8192, 128
    bf = torch.bfloat16
    q = torch.zeros(B, Hkv * G, 1, D, dtype=bf)
    k = torch.zeros(B, Hkv, L, D, dtype=bf)
    pos = torch.tensor([L - 1])
    mask_f = torch.zeros(B, 1, 1, L, dtype=bf)
    mask_b = torch.ones(B, Hkv * G, 1, L, dtype=torch.bool)
    idx = torch.zeros(B, Hkv, 4352, dtype=torch.int32)
    pool = torch.zeros(B, Hkv, 4096, dtype=torch.int64)
    yield "pack_signs", lambda: K.pack_signs(torch.zeros(B, Hkv * G, 1, 32, dtype=bf))
    yield "signature_write", lambda: K.signature_write(torch.zeros(B, Hkv, L, 1, dtype=torch.int32),
                                                     torch.zeros(B, Hkv, 16, 32, dtype=bf), pos[:1].expand(16))
    yield "hamming_scores", lambda: K.hamming_scores(torch.zeros(B, Hkv * G, 1, dtype=torch.int32),
                                                   torch.zeros(B, Hkv, L, 1, dtype=torch.int32))
    codes = torch.zeros(B, Hkv, L, D // 16, dtype=torch.int32)
    prm = torch.zeros(B, Hkv, L, 2 * (D // 32), dtype=torch.float16)
    yield "int2_write", lambda: K.int2_write(codes, prm, torch.zeros(B, Hkv, 1, D, dtype=bf), pos)
    yield "int2_scores v2", lambda: K.int2_scores(q, codes, prm, pos, variant=2)
    yield "int2_scores v3", lambda: K.int2_scores(q, codes, prm, pos, variant=3)
    yield "int2_scores fp32", lambda: K.int2_scores(q.float(), codes, prm)
    ranked = torch.zeros(B, Hkv, 256 + 16384, dtype=torch.int32)  # a refined layer's pool: a view of the proposal's list
    yield "int2_scores pool", lambda: K.int2_scores(q, codes, prm, pos, ranked[..., 256:])
    yield "int2_scores pool ahead", lambda: K.int2_scores(q, codes, prm, pos, ranked[..., 256:], ahead=True)
    yield "int2_scores pool ahead 256", lambda: K.int2_scores(q, codes, prm, pos, ranked[..., 256:], ahead=True,
                                                               block_l=256)
    yield "mass_scores pool", lambda: K.mass_scores(q, k, None, mask_f, pool)
    yield "mass_scores oracle", lambda: K.mass_scores(q, k, None, mask_b)
    yield "mass_select pool", lambda: K.mass_select(q, k, None, mask_f, pool, pos, 1024, 128, 128)
    pool16 = torch.zeros(B, Hkv, 16384, dtype=torch.int32)
    yield "mass_select 16K", lambda: K.mass_select(q, k, None, mask_b[:, :1], pool16, pos, 4096, 128, 128)
    yield "mass_select 16K trim", lambda: K.mass_select(q, k, None, mask_b, pool16, pos, 4096, 128, 128,
                                                        torch.zeros(B, dtype=torch.int32), mass=0.95)
    pool64k = torch.zeros(B, Hkv, 65536, dtype=torch.int64)  # beyond one program a row: the passes, then the trim kernel
    yield "mass_select trimmed", lambda: K.mass_select(q, k, None, mask_f, pool64k, pos, 16384, 128, 128, mass=0.9)
    yield "select_topk uint8", lambda: K.select_topk(torch.zeros(B, Hkv, L, dtype=torch.uint8), pos, 256, 128, 128, mask_b)
    yield "select_topk int16 pool", lambda: K.select_topk(torch.zeros(B, Hkv, 4096, dtype=torch.int16), pos, 1024, 128, 128,
                                                        mask_b, pool)
    yield "select_topk float", lambda: K.select_topk(torch.zeros(B, Hkv, L, dtype=torch.float32), pos, 256, 128, 128, mask_f,
                                                   None, torch.zeros(B, dtype=torch.int32))
    yield "select_nested float", lambda: K.select_topk(torch.zeros(B, Hkv, L, dtype=torch.float32), pos, 1024, 128, 128,
                                                     mask_b, None, None, k_inner=256)
    long = 131072  # a proposal at 128K: pool 16384, its budget 4096 (the inner list by one program a row, or the passes)
    pos_long, mask_long = torch.tensor([long - 1]), torch.ones(B, 1, 1, long, dtype=torch.bool)
    yield "select_nested 128K row", lambda: K.select_topk(torch.zeros(B, Hkv, long), pos_long, 16384, 128, 128, mask_long,
                                                        k_inner=4096, row=True)
    yield "select_nested 128K passes", lambda: K.select_topk(torch.zeros(B, Hkv, long), pos_long, 16384, 128, 128,
                                                           mask_long, k_inner=4096, row=False)
    qlog = torch.zeros(B, Hkv * G, 32, dtype=bf)
    sig = torch.zeros(B, Hkv, L, 1, dtype=torch.int32)
    yield "hash_select", lambda: K.hash_select(qlog, sig, pos, 4096, 128, 128, mask_b[:, :1])
    yield "hash_select nested", lambda: K.hash_select(qlog, sig, pos, 4096, 128, 128, mask_b[:, :1], k_inner=1024)
    yield "hash_select nested passes", lambda: K.hash_select(qlog, sig, pos, 4096, 128, 128, mask_b[:, :1], k_inner=1024,
                                                           row=False)
    yield "hash_select nested 128K", lambda: K.hash_select(qlog, torch.zeros(B, Hkv, long, 1, dtype=torch.int32), pos_long,
                                                         16384, 128, 128, mask_long, k_inner=4096, row=True)
    yield "hash_select wide g8 w2", lambda: K.hash_select(torch.zeros(B, 16, 64, dtype=bf), torch.zeros(B, 2, L, 2, dtype=torch.int32),
                                                        pos, 512, 128, 128, mask_f, torch.zeros(B, dtype=torch.int32))
    yield "select_topk pool", lambda: K.select_topk(torch.zeros(B, Hkv, 4096, dtype=torch.float32), pos, 1024, 128, 128,
                                                  mask_b, pool)
    yield "attention bf16 split", lambda: K.sparse_decode_attention(q, k, k, idx, None, mask_f)
    yield "attention bf16 one split", lambda: K.sparse_decode_attention(q.expand(64, -1, -1, -1), k.expand(64, -1, -1, -1),
                                                                      k.expand(64, -1, -1, -1),
                                                                      idx[..., :64].expand(64, -1, -1), None, mask_b[:1])
    yield "attention fp32 d64", lambda: K.sparse_decode_attention(q[..., :64].float(), k[..., :64].float(),
                                                                k[..., :64].float(), idx)
    # other model shapes: D=256 fp16 with 8 query heads per KV head; SmolLM2-like D=64, G=3
    h16 = torch.zeros(1, 2, 1024, 256, dtype=torch.float16)
    q16 = torch.zeros(1, 16, 1, 256, dtype=torch.float16)
    yield "attention fp16 d256 g8", lambda: K.sparse_decode_attention(q16, h16, h16, idx[:, :2], None, mask_b[:, :16, :, :1024])
    yield "mass fp16 d256 g8", lambda: K.mass_scores(q16, h16, None, None, pool[:, :2])
    q3 = torch.zeros(1, 9, 1, 64, dtype=bf)
    k3 = torch.zeros(1, 3, 8192, 64, dtype=bf)
    c3 = torch.zeros(1, 3, 8192, 4, dtype=torch.int32)
    p3 = torch.zeros(1, 3, 8192, 4, dtype=torch.float16)
    yield "int2 d64 g3", lambda: (K.int2_write(c3, p3, k3[:, :, :1], pos), K.int2_scores(q3, c3, p3))
    yield "int2 d256 g8 fp16", lambda: K.int2_scores(q16, torch.zeros(1, 2, 1024, 16, dtype=torch.int32),
                                                   torch.zeros(1, 2, 1024, 16, dtype=torch.float16))
    yield "attention d64 g3 float mask", lambda: K.sparse_decode_attention(q3, k3, k3, idx[:, :3], None, mask_f)
    # a verify step's dense attention: gamma + 1 queries (the query tile at its largest: 64 rows of 128-dim heads, 64 of 256)
    verify = torch.ones(B, 1, 16, L, dtype=torch.bool)
    qt = torch.zeros(B, Hkv * G, 16, D, dtype=bf)
    yield "few_query bf16 t5 split", lambda: K.few_query_attention(qt[:, :, :5], k, k, None, verify[:, :, :5])
    yield "few_query bf16 t16 one split", lambda: K.few_query_attention(qt.expand(64, -1, -1, -1), k.expand(64, -1, -1, -1),
                                                                      k.expand(64, -1, -1, -1), None, verify)
    yield "few_query fp32 t3 float mask", lambda: K.few_query_attention(qt[:, :, :3].float(), k.float(), k.float(), None,
                                                                      verify[:, :, :3].float())
    yield "few_query fp32 t8", lambda: K.few_query_attention(qt[:, :, :8].float(), k.float(), k.float(), None, verify[:, :, :8])
    yield "few_query fp16 d256 g8 t8", lambda: K.few_query_attention(torch.zeros(1, 16, 8, 256, dtype=torch.float16), h16, h16,
                                                                   None, torch.ones(1, 16, 8, 1024, dtype=torch.bool))
    yield "few_query d64 g3 t16", lambda: K.few_query_attention(torch.zeros(1, 9, 16, 64, dtype=bf), k3, k3, None, None)
    yield "hamming g3 w2", lambda: K.hamming_scores(torch.zeros(1, 9, 2, dtype=torch.int32), torch.zeros(1, 3, 8192, 2, dtype=torch.int32))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """The output of the cuobjdump that ships with triton, run with `flag` on a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> dict:
    """Registers and local (spill) bytes of a cubin."""
    found = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", _cuobjdump(cubin, "-res-usage")))
    return {k: int(v) for k, v in found.items()}


def longest_loop(cubin: bytes) -> tuple[int, dict]:
    """(instructions, opcode counts) of the longest backward branch's body in a cubin's SASS: the
    steady state of an issue-bound kernel, to compare variants without a GPU."""
    import collections

    ins = [(int(a, 16), op, rest) for a, op, rest in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);", _cuobjdump(cubin, "-sass"))]
    best = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return len(best), dict(collections.Counter(best).most_common(6))


def _launches():
    """(scenario, kernel, args, kwargs) of every launch the scenarios record."""
    for name, call in _scenarios():
        with recording() as launches:
            call()
        for kernel, _grid, args, kwargs in launches:
            yield name, kernel, args, kwargs


def compile_all(arch: int = 90):
    """[(scenario, kernel name, registers, local bytes, stack bytes, shared bytes)] for every
    recorded launch (registers spilled go to the stack frame or to local memory)."""
    rows = []
    for name, kernel, args, kwargs in _launches():
        c = compile_launch(kernel, args, kwargs, arch)
        use = resource_usage(c.asm["cubin"])
        rows.append((name, kernel.fn.__name__, use.get("REG", -1), use.get("LOCAL", -1), use.get("STACK", -1),
                     c.metadata.shared))
    return rows


def loop_counts(arch: int = 90):
    """[(scenario, kernel name, instructions of its longest loop, their commonest opcodes)]."""
    return [(name, kernel.fn.__name__, *longest_loop(compile_launch(kernel, args, kwargs, arch).asm["cubin"]))
            for name, kernel, args, kwargs in _launches()]


def written_arguments(arch: int = 90):
    """[(scenario, kernel name, sorted names of the arguments Inductor's analysis says it writes)]:
    what torch.compile would functionalise as mutated. A graph input (a mask, the cache position,
    a pool view) in that list would be copied back, or make CUDA graphs skip the step."""
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors
    from triton.runtime import driver

    class _Target:  # the analysis asks the active driver for a target; there is no GPU here
        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

    previous = driver._active
    driver.set_active(_Target())
    rows = []
    try:
        for name, kernel, args, kwargs in _launches():
            names = [p.name for p in kernel.params]
            bound = dict(zip(names, args))
            bound.update({k: v for k, v in kwargs.items() if k in names})
            access = identify_accessed_tensors(kernel, bound, {})
            rows.append((name, kernel.fn.__name__, sorted(d.name for d in access.read_writes.writes)))
    finally:
        driver._active = previous
    return rows


def main() -> None:
    import sys

    if "--writes" in sys.argv:
        for name, kernel, written in written_arguments():
            print(f"{name:28s} {kernel:28s} writes {' '.join(written)}")
        return
    if "--loops" in sys.argv:
        for name, kernel, n, ops in loop_counts():
            print(f"{name:28s} {kernel:28s} loop {n:5d}  {' '.join(f'{k}:{v}' for k, v in ops.items())}")
        return
    for row in compile_all():
        print("{:28s} {:28s} regs {:4d} local {:5d} stack {:5d} smem {:7d}".format(*row))


if __name__ == "__main__":
    main()
