#!/usr/bin/env python
"""Launch-knob sweep of the decode-step kernels on one GPU, checked against the reference first.

For each kernel (hash_select, select_topk over float scores and nested (the inner list by one
program a row and by the passes), mass_select at mass 1 and 0.95, int2_scores,
sparse_decode_attention)
and each shape (context x batch; Hq=32, Hkv=8, D=128, bf16, budget 4096 + 128 + 128, pool 4 x
4096) it times every configuration of its launch knobs by CUDA-graph replay over 4 distinct layers
(so replays do not find the last layer's data in L2), and reports the best with its bytes and the
fraction of the measured copy bandwidth. With --baseline DIR (a copy of an older `lowering`
package, e.g. `git archive <rev> lowering`), the older kernels run in the same process for an A/B.

    python bench/kernel_tuning.py --out DIR                    # H200: about 6 minutes
    python bench/kernel_tuning.py --contexts 32768 --batches 1 --quick
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
import time

import benchlib  # bench/benchlib/: a script's own folder is sys.path[0]

HQ, HKV, D, SINK, LOCAL, BUDGET, RHO = 32, 8, 128, 128, 128, 4096, 4


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="two configurations per kernel")
    p.add_argument("--baseline", default=None, help="folder holding an older lowering package to time beside")
    p.add_argument("--only", nargs="+", default=None, choices=["hash", "select", "mass", "int2", "pool", "attention"],
                   help="sweep only these kernels (int2: the proposal's scan; pool: a refined layer's INT2 pool scan)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, TRITON_INTERPRET=1, tiny shapes, one configuration a sweep, no timing: the script's paths "
                   "(written only with an explicit --out)")
    benchlib.add_out(p)
    return p.parse_args()


ARGS = parse_args()
DEV = "cpu" if ARGS.smoke else "cuda"
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    HQ, HKV, D, SINK, LOCAL, BUDGET = 4, 2, 64, 8, 8, 64
    ARGS.contexts, ARGS.batches, ARGS.layers, ARGS.quick = [2048], [1], 1, True
    benchlib.time_graph = lambda fn, **_: (fn(), 1.0)[1]  # run once, time nothing
    benchlib.kernel_times = lambda fn, reps=5: {}
    benchlib.bandwidth_gbps = lambda: dict(copy=1.0, read=1.0)
    if not any(a == "--out" or a.startswith("--out=") for a in sys.argv[1:]):
        benchlib.save = lambda *_, **__: []  # untimed numbers stay out of bench/results unless asked for

import torch  # noqa: E402
from benchlib.layers import Layers, fastest  # noqa: E402

from sparse_fx.lowering import reference as ref  # noqa: E402
from sparse_fx.lowering.kernels import gather_attention as A  # noqa: E402
from sparse_fx.lowering.kernels import int2 as I  # noqa: E402
from sparse_fx.lowering.kernels import select as S  # noqa: E402

T0 = time.perf_counter()


def configs(space: dict) -> list[dict]:
    keys = list(space)
    out = [dict(zip(keys, vals)) for vals in itertools.product(*space.values())]
    return out[:1] if ARGS.smoke else out[:2] if ARGS.quick else out


def sweep(name: str, space: dict, make, nbytes: float, copy: float, rows: list, shape: dict) -> dict:
    """Time make(**cfg) for every configuration; record each and return the best."""
    best = None
    for cfg in configs(space):
        try:
            ms = benchlib.time_graph(make(**cfg))
        except Exception as e:  # noqa: BLE001 - a configuration the compiler rejects is skipped, noted
            rows.append(dict(kernel=name, **shape, config=cfg, error=f"{type(e).__name__}: {str(e)[:160]}"))
            continue
        rec = dict(kernel=name, **shape, config=cfg, ms=ms, bytes=nbytes, gbps=nbytes / ms / 1e6,
                   copy_fraction=nbytes / ms / 1e6 / copy)
        rows.append(rec)
        if best is None or ms < best["ms"]:
            best = rec
    print(f"  {name:<22} best {best['ms'] * 1e3:8.1f} us  {best['gbps']:6.0f} GB/s ({100 * best['copy_fraction']:3.0f}%)  "
          f"{best['config']}", flush=True)
    return best


def rows_at(row_chunk=None, row_warps=None, **knobs) -> dict:
    """The one-program-a-row selection's chunk and width, set for the next launches (its defaults
    are module constants, read at launch), and the other knobs to pass on."""
    S.ROW_CHUNK = row_chunk or ROW_DEFAULTS[0]
    S.ROW_WARPS = row_warps or ROW_DEFAULTS[1]
    return knobs


ROW_DEFAULTS = (S.ROW_CHUNK, S.ROW_WARPS)
ROW_SPACE = dict(row=[True], row_chunk=[2048, 4096], row_warps=[16, 32])


def check_correctness() -> list[str]:
    """GPU kernels against the reference on fresh random inputs (ties, masks, left padding)."""
    out = []
    g = torch.Generator(DEV).manual_seed(1)
    B, L, G = 2, 2000 if ARGS.smoke else 20000, 4
    start = torch.tensor([0, 333], device=DEV, dtype=torch.int32)
    mask = torch.rand(B, 1, 1, L, device=DEV, generator=g) > 0.1
    mask[1, :, :, :333] = False
    pos = torch.tensor([L - 5], device=DEV)
    ql = torch.randn(B, HKV * G, 32, device=DEV, generator=g, dtype=torch.bfloat16)
    ks = torch.randint(-(2**31), 2**31 - 1, (B, HKV, L, 1), device=DEV, generator=g, dtype=torch.int64).to(torch.int32)
    for k in (64, 4096):
        a = S.hash_select(ql, ks, pos, k, SINK, LOCAL, mask, start)
        b = ref.hash_select(ql, ks, pos, k, SINK, LOCAL, mask, start)
        out.append(f"hash_select k={k}: {'exact' if torch.equal(a, b) else 'MISMATCH ' + str(int((a != b).sum()))}")
    sc = (torch.randn(B, HKV, L, device=DEV, generator=g) * 8).round() / 8
    a = S.select_topk(sc, pos, 1024, SINK, LOCAL, mask, None, start)
    b = ref.select_topk(sc, pos, 1024, SINK, LOCAL, mask, None, start)
    out.append(f"select_topk float ties: {'exact' if torch.equal(a, b) else 'MISMATCH ' + str(int((a != b).sum()))}")
    pool = b[:, :, SINK + LOCAL:].contiguous()
    ps = torch.randn(B, HKV, pool.shape[-1], device=DEV, generator=g)
    a = S.select_topk(ps, pos, 256, SINK, LOCAL, mask, pool, start)
    b2 = ref.select_topk(ps, pos, 256, SINK, LOCAL, mask, pool, start)
    out.append(f"select_topk pool: {'exact' if torch.equal(a, b2) else 'MISMATCH ' + str(int((a != b2).sum()))}")
    kq = torch.randn(B, HKV, L, D, device=DEV, generator=g, dtype=torch.bfloat16)
    qm = torch.randn(B, HKV * G, 1, D, device=DEV, generator=g, dtype=torch.bfloat16) * 3
    for mass in (1.0, 0.9):
        r = ref.mass_select(qm, kq, None, mask, pool, pos, 256, SINK, LOCAL, start, mass)
        a = S.mass_select(qm, kq, None, mask, pool, pos, 256, SINK, LOCAL, start, mass=mass)
        out.append(f"mass_select mass={mass}: {'exact' if torch.equal(a, r) else 'MISMATCH ' + str(int((a != r).sum()))}")
    b3 = ref.select_nested(sc, pos, 1024, 300, SINK, LOCAL, mask, start)
    for rows in (True, False):
        a = S.select_topk(sc, pos, 1024, SINK, LOCAL, mask, None, start, k_inner=300, row=rows)
        same = torch.equal(a[0], b3[0]) and torch.equal(a[1], b3[1])
        out.append(f"select_nested float ties, row={rows}: {'exact' if same else 'MISMATCH'}")
        a = S.hash_select(ql, ks, pos, 2048, SINK, LOCAL, mask, start, k_inner=512, row=rows)
        b4 = ref.hash_select_nested(ql, ks, pos, 2048, 512, SINK, LOCAL, mask, start)
        same = torch.equal(a[0], b4[0]) and torch.equal(a[1], b4[1])
        out.append(f"hash_select_nested, row={rows}: {'exact' if same else 'MISMATCH'}")
    q = torch.randn(B, HKV * G, 1, D, device=DEV, generator=g, dtype=torch.bfloat16)
    k = torch.randn(B, HKV, L, D, device=DEV, generator=g, dtype=torch.bfloat16)
    v = torch.randn(B, HKV, L, D, device=DEV, generator=g, dtype=torch.bfloat16)
    codes, prm = ref.int2_quantize(k, 32)
    a = I.int2_scores(q, codes, prm, pos)
    r = ref.int2_scores(q, codes, prm, pos)
    fin = torch.isfinite(r)
    same = torch.equal(fin, torch.isfinite(a))
    err = ((a - r)[fin].norm() / r[fin].norm()).item()
    out.append(f"int2_scores: rel err {err:.1e}, -inf after pos {'ok' if same else 'WRONG'}")
    idx = b
    a = A.sparse_decode_attention(q, k, v, idx, None, mask)
    r = ref.sparse_decode_attention(q.double(), k.double(), v.double(), idx, None, mask)
    out.append(f"attention: rel err {((a.double() - r).norm() / r.norm()).item():.1e}")
    return out


def main() -> None:
    res = dict(meta=benchlib.header(ARGS), rows=[], best=[])
    stem = f"kernel-tuning-{res['meta']['date'][:10]}"
    res["checks"] = check_correctness()
    for line in res["checks"]:
        print("check", line, flush=True)
    res["bandwidth_gbps"] = bw = benchlib.bandwidth_gbps()
    res["copy_gbps"] = copy = bw["copy"]
    print(f"# {res['meta']['gpu']} {res['meta']['versions']} copy {copy:.0f} GB/s (SM copy, read + written), read {bw['read']:.0f} GB/s",
          flush=True)
    old = None
    if ARGS.baseline:
        sys.path.insert(0, ARGS.baseline)
        old = importlib.import_module("oldlowering.kernels")
    for L, B in itertools.product(ARGS.contexts, ARGS.batches):
        nl = ARGS.layers
        st = Layers(B, L, nl, torch.device(DEV), HQ, HKV, D, q_logits=True)
        shape = dict(context=L, batch=B)
        R = B * HKV
        print(f"L={L} B={B}", flush=True)
        best = dict(shape)
        kv = 2 * R * L * D * 2
        dense = st.dense_times(benchlib.time_graph, cpu=ARGS.smoke)
        for name, ms in dense.items():
            print(f"  dense sdpa {name:<13} {ms * 1e3:8.1f} us  {kv / ms / 1e6:6.0f} GB/s", flush=True)
        backend, ms = fastest(dense)  # the row's dense
        best["dense_sdpa"] = dict(ms=ms, backend=backend, by_backend_ms=dense, bytes=kv, gbps=kv / ms / 1e6,
                                  copy_fraction=kv / ms / 1e6 / copy)

        def per_layer(fn):
            return lambda: [fn(i) for i in range(nl)]

        def want(kernel: str) -> bool:
            return ARGS.only is None or kernel in ARGS.only

        def record(name: str, found: dict) -> None:
            best[name] = {**found, "ms": found["ms"] / nl}  # per layer (the row keeps the NL-layer time)

        profile = {}
        if want("hash"):
            hash_bytes = R * L * (4 + 1 + 1 + 1)  # signatures, mask row, keys written and read
            space = dict(block=[1024, 2048], warps=[4, 8], waves=[4, 16], level_bits=[4, 8], cap=[16, 64])
            record("hash_select", sweep("hash_select", space, lambda **c: per_layer(
                lambda i: S.hash_select(st.qlog[i], st.sig[i], st.pos, BUDGET, SINK, LOCAL, st.mask, None, **c)),
                hash_bytes * nl, copy, res["rows"], shape))
            if old is not None:  # at the older package's own launch defaults
                best["hash_select_old"] = dict(ms=benchlib.time_graph(per_layer(
                    lambda i: old.hash_select(st.qlog[i], st.sig[i], st.pos, BUDGET, SINK, LOCAL, st.mask, None))) / nl)
            cfg = best["hash_select"]["config"]
            profile["hash_select"] = benchlib.kernel_times(lambda: S.hash_select(st.qlog[0], st.sig[0], st.pos, BUDGET, SINK, LOCAL,
                                                                        st.mask, None, **cfg))
        pool_n = RHO * BUDGET
        if want("select") or want("mass") or want("int2") or want("pool"):
            scores = [I.int2_scores(st.q[i], *st.int2[i], st.pos) for i in range(nl)]
        if want("select") or want("mass"):
            pools = [S.select_topk(scores[i], st.pos, pool_n, SINK, LOCAL, st.mask)[:, :, SINK + LOCAL:].contiguous()
                     for i in range(nl)]
        if want("select"):
            sel_bytes = R * L * (4 + 1 + 2 + 2 + 2)
            space = dict(block=[2048, 4096], warps=[4, 8], waves=[4, 16], level_bits=[4, 8], cap=[16, 64])
            record("select_pool", sweep("select_topk 128K->pool", space, lambda **c: per_layer(
                lambda i: S.select_topk(scores[i], st.pos, pool_n, SINK, LOCAL, st.mask, None, None, **c)),
                sel_bytes * nl, copy, res["rows"], shape))
            outer = dict(block=[2048, 4096], warps=[4], waves=[4], level_bits=[8], cap=[16])  # the pool's own passes
            for how, sp in (("row", {**outer, **ROW_SPACE}), ("passes", {**space, "row": [False]})):  # the inner list
                record(f"select_nested_{how}", sweep(f"select_nested {how}", sp, lambda **c: per_layer(
                    lambda i, c=rows_at(**c): S.select_topk(scores[i], st.pos, pool_n, SINK, LOCAL, st.mask, None, None,
                                                            k_inner=BUDGET, **c)),
                    (sel_bytes + R * BUDGET * 4) * nl, copy, res["rows"], shape))
            rows_at()
            if old is not None:
                best["select_nested_old"] = dict(ms=benchlib.time_graph(per_layer(lambda i: old.select_topk(
                    scores[i], st.pos, pool_n, SINK, LOCAL, st.mask, k_inner=BUDGET))) / nl)
            if old is not None:
                best["select_pool_old"] = dict(ms=benchlib.time_graph(per_layer(
                    lambda i: old.select_topk(scores[i], st.pos, pool_n, SINK, LOCAL, st.mask))) / nl)
            pscores = [torch.gather(scores[i], 2, pools[i].clamp(min=0).long()) for i in range(nl)]
            record("select_in_pool", sweep("select_topk in pool", dict(block=[1024, 4096], warps=[4], waves=[4, 8],
                                                                       level_bits=[4, 8], cap=[16, 64]),
                                           lambda **c: per_layer(lambda i: S.select_topk(
                                               pscores[i], st.pos, BUDGET, SINK, LOCAL, st.mask, pools[i], None, **c)),
                                           R * pool_n * (4 + 4 + 1 + 6) * nl, copy, res["rows"], shape))
            cfg, cfg_in = best["select_pool"]["config"], best["select_in_pool"]["config"]
            profile["select_pool"] = benchlib.kernel_times(lambda: S.select_topk(scores[0], st.pos, pool_n, SINK, LOCAL, st.mask,
                                                                        None, None, **cfg))
            profile["select_in_pool"] = benchlib.kernel_times(lambda: S.select_topk(pscores[0], st.pos, BUDGET, SINK, LOCAL, st.mask,
                                                                           pools[0], None, **cfg_in))
        if want("mass"):
            for mass in (1.0, 0.95):  # a refined layer's selection: the pool's mass, its top budget, trimmed
                record(f"mass_select_{mass}", sweep(f"mass_select {mass}", dict(
                    block=[1024, 4096], warps=[4, 8], waves=[4, 8], level_bits=[8], cap=[16, 64]),
                    lambda **c: per_layer(lambda i: S.mass_select(st.q[i], st.k[i], None, st.mask, pools[i], st.pos, BUDGET,
                                                                  SINK, LOCAL, None, mass=mass, **c)),
                    R * pool_n * (4 + 2 * D + 8 * (HQ // HKV) + 4) * nl, copy, res["rows"], shape))
            cfg = best["mass_select_1.0"]["config"]
            profile["mass_select"] = benchlib.kernel_times(lambda: S.mass_select(
                st.q[0], st.k[0], None, st.mask, pools[0], st.pos, BUDGET, SINK, LOCAL, None, **cfg))
            if old is not None:
                best["mass_select_old"] = dict(ms=benchlib.time_graph(per_layer(lambda i: old.mass_select(
                    st.q[i], st.k[i], None, st.mask, pools[i], st.pos, BUDGET, SINK, LOCAL, None))) / nl)
        if want("int2"):
            int2_bytes = R * L * (D // 4 + 4 * (D // 32) + 4)
            space = dict(block_l=[64, 128], warps=[4, 8], stages=[2, 3], variant=[2, 3])
            record("int2_scores", sweep("int2_scores", space, lambda **c: per_layer(
                lambda i: I.int2_scores(st.q[i], *st.int2[i], st.pos, **c)), int2_bytes * nl, copy, res["rows"], shape))
            if old is not None:
                # the older lowering's separate scale and zero tensors (before the one params record)
                split = [(c, *(t.contiguous() for t in ref.int2_split(prm))) for c, prm in st.int2]
                best["int2_scores_old"] = dict(ms=benchlib.time_graph(per_layer(lambda i: old.int2_scores(st.q[i], *split[i]))) / nl)
        if want("pool"):  # a refined layer's scan of its pool (the proposal's list past the window, a view, as handed on)
            ipools = [S.select_topk(scores[i], st.pos, pool_n, SINK, LOCAL, st.mask)[:, :, SINK + LOCAL:] for i in range(nl)]
            space = dict(block_l=[64, 128, 256], ahead=[False, True], waves=[1, 2, 4, 8], stages=[2, 3])
            record("int2_pool", sweep("int2_scores pool", space, lambda **c: per_layer(
                lambda i: I.int2_scores(st.q[i], *st.int2[i], st.pos, ipools[i], **c)),
                R * pool_n * (4 + D // 4 + 4 * (D // 32) + 4) * nl, copy, res["rows"], shape))
            profile["int2_pool"] = benchlib.kernel_times(lambda: I.int2_scores(st.q[0], *st.int2[0], st.pos, ipools[0],
                                                                            **best["int2_pool"]["config"]))
        if want("attention"):
            idx = [S.hash_select(st.qlog[i], st.sig[i], st.pos, BUDGET, SINK, LOCAL, st.mask) for i in range(nl)]
            att_bytes = R * (BUDGET + SINK + LOCAL) * (2 * D * 2 + 4)
            space = dict(block_n=[32, 64, 128], warps=[4, 8], stages=[2, 3], waves=[2, 4, 8, 16], max_splits=[64])
            record("attention", sweep("sparse_decode_attention", space, lambda **c: per_layer(
                lambda i: A.sparse_decode_attention(st.q[i], st.k[i], st.v[i], idx[i], None, st.mask, **c)),
                att_bytes * nl, copy, res["rows"], shape))
            best["attention_default"] = dict(ms=benchlib.time_graph(per_layer(  # the launch defaults of this package
                lambda i: A.sparse_decode_attention(st.q[i], st.k[i], st.v[i], idx[i], None, st.mask))) / nl)
            if old is not None:
                best["attention_old"] = dict(ms=benchlib.time_graph(per_layer(
                    lambda i: old.sparse_decode_attention(st.q[i], st.k[i], st.v[i], idx[i], None, st.mask))) / nl)
            cfg = best["attention"]["config"]
            profile["attention"] = benchlib.kernel_times(lambda: A.sparse_decode_attention(st.q[0], st.k[0], st.v[0], idx[0], None,
                                                                                  st.mask, **cfg))
        best["profile"] = profile
        for name, times in profile.items():
            print(f"  profile {name}: " + ", ".join(f"{k.split('(')[0][:28]} {v}" for k, v in times.items()), flush=True)
        res["best"].append(best)
        st = None  # free this shape before the next is allocated
        torch.cuda.empty_cache()
        benchlib.save(ARGS.out, stem, res)  # a run stopped at its time limit keeps its shapes
    res["wall_s"] = time.perf_counter() - T0
    benchlib.save(ARGS.out, stem, res)
    print(f"\n{'ctx':>7} {'B':>3} {'dense':>8} {'hash_sel':>9} {'old':>7} {'int2':>8} {'old':>7} {'i2pool':>7} {'selpool':>8} {'old':>7} "
          f"{'n.row':>7} {'n.pass':>7} {'old':>7} {'inpool':>7} {'mass':>7} {'old':>7} {'mass.95':>7} {'attn':>7} "
          f"{'a.dflt':>7} {'old':>7}   (us per layer)")
    for b in res["best"]:
        def us(key):
            return f"{b[key]['ms'] * 1e3:.1f}" if key in b else "-"
        print(f"{b['context']:>7} {b['batch']:>3} {us('dense_sdpa'):>8} {us('hash_select'):>9} {us('hash_select_old'):>7} "
              f"{us('int2_scores'):>8} {us('int2_scores_old'):>7} {us('int2_pool'):>7} {us('select_pool'):>8} {us('select_pool_old'):>7} "
              f"{us('select_nested_row'):>7} {us('select_nested_passes'):>7} {us('select_nested_old'):>7} "
              f"{us('select_in_pool'):>7} {us('mass_select_1.0'):>7} "
              f"{us('mass_select_old'):>7} {us('mass_select_0.95'):>7} {us('attention'):>7} "
              f"{us('attention_default'):>7} {us('attention_old'):>7}")
    print(f"wall {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
