"""The FX pass on a toy decoder: every call form, the dense fallbacks, strictness, graph shape."""

import copy

import pytest
import torch

import sparse_fx
from support import COVER, FORMS, PREFILL, ToyDecoder, options_for, run
from sparse_fx.api import sparse_state

OPS = torch.ops.sparse_fx




def compiled(model, plan, **options):
    options.setdefault("backend", "eager")
    return sparse_fx.compile(copy.deepcopy(model), plan, **options)




@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("plan", ["oracle", "hash", "prism-g2", "prism-g2-hash", "prism-g2-int2refine", "static-g2"])
def test_budget_covering_context_equals_dense_in_every_call_form(form, plan):
    dense = ToyDecoder(form=form)
    sparse = compiled(dense, plan, **options_for(plan, int2_group=8, **COVER))
    for a, b in zip(run(dense), run(sparse)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    report = sparse_fx.explain(sparse)
    assert report.sparse_layers == [0, 1, 2], str(report)
    expected_gqa = {"enable_gqa": "enable_gqa", "repeat_interleave": "repeat_interleave"}.get(form, "repeat_kv")
    assert {r.call_form.split("+")[1] for r in report} == {expected_gqa}


@pytest.mark.parametrize("mask", ["bool", "float_inf", "float_min", "bias"])
def test_mask_forms_are_honoured(mask):
    dense = ToyDecoder(mask=mask)
    sparse = compiled(dense, "oracle", **COVER)
    for a, b in zip(run(dense), run(sparse)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sparse_fx.explain(sparse).sparse_layers == [0, 1, 2]


def test_small_budget_runs_the_ops_it_reports():
    """One layer, small budget: the model's output is exactly score -> select -> gather-attention."""
    model = ToyDecoder(layers=1, scale=0.3)
    sparse = compiled(model, "oracle", budget=3, sink=2, local=2)
    outs = run(sparse, steps=1)
    # recompute the decode step by hand with the public ops on the cache the model just wrote
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, PREFILL + 1, 64, generator=g)[:, PREFILL:]
    attn = sparse.layers[0]
    q = attn.q(x).view(1, 1, 4, 16).transpose(1, 2)
    k, v = sparse.k0, sparse.v0
    mask = (torch.arange(64) <= PREFILL)[None, None, None, :]
    pos = torch.tensor([PREFILL])
    idx = OPS.select_topk(OPS.mass_scores(q, k, 0.3, mask, None), pos, 3, 2, 2, mask, None)
    att = OPS.sparse_decode_attention(q, k, v, idx, 0.3, mask)
    with torch.no_grad():
        expect = x + sparse.proj[0](att.transpose(1, 2).reshape(1, 1, 64))
    torch.testing.assert_close(outs[-1], expect)
    dense_out = run(model, steps=1)[-1]
    assert (outs[-1] - dense_out).abs().max() > 1e-3, "a 7-of-25 selection should differ from dense"


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(dropout=0.1), "dropout_p=0.1"),
        (dict(mask="causal"), "is_causal=True with one query"),
        (dict(mask="none"), "no attention mask"),
        (dict(mask="flat"), "unsupported mask form"),
    ],
)
def test_unsupported_forms_fall_back_to_dense_visibly(kwargs, reason):
    dense = ToyDecoder(**kwargs)
    sparse = compiled(dense, "hash", budget=4, sink=1, local=1)
    torch.manual_seed(0)  # dropout draws the same masks in both runs
    a = run(dense)
    torch.manual_seed(0)
    b = run(sparse)
    if "dropout" not in kwargs:
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)
    report = sparse_fx.explain(sparse)
    assert report.sparse_layers == []
    assert all(reason in r.reason for r in report), str(report)
    with pytest.raises(Exception, match="strict"):
        run(compiled(dense, "hash", budget=4, sink=1, local=1, strict=True))


def test_autograd_enabled_decode_stays_dense():
    model = compiled(ToyDecoder(), "oracle", budget=4)
    x = torch.randn(1, PREFILL, 64)
    model(x, torch.arange(PREFILL))
    model(torch.randn(1, 1, 64), torch.tensor([PREFILL]))  # grad mode on
    assert all("autograd" in r.reason for r in sparse_fx.explain(model))


def test_repeat_kv_is_never_materialised():
    """The rewritten decode graph reads the KV heads directly: no expand/reshape of the cache."""
    graphs = []
    model = compiled(ToyDecoder(), "hash", budget=4, sink=2, local=3)
    state = sparse_state(model)
    from sparse_fx.backend import sparse_backend

    inner = sparse_backend(state)

    def spy(gm, example_inputs):
        fn = inner(gm, example_inputs)
        graphs.append(gm)
        return fn

    f = torch.compile(model.forward.original, backend=spy, fullgraph=True)
    with torch.no_grad():
        f(torch.randn(1, PREFILL, 64), torch.arange(PREFILL))
        f(torch.randn(1, 1, 64), torch.tensor([PREFILL]))
    decode = graphs[-1]
    names = [n.target for n in decode.graph.nodes if n.op in ("call_method", "call_function")]
    assert "expand" not in names and torch._C._nn.scaled_dot_product_attention not in names
    assert names.count(OPS.sparse_decode_attention.default) == 3
    assert names.count(OPS.signature_write.default) == 3 and names.count(OPS.hash_select.default) == 3


@pytest.mark.parametrize("form", ["repeat_kv", "repeat_interleave"])
def test_a_layer_that_stays_dense_reads_the_kv_heads_without_the_repeat(form):
    """Dense layers of a decode graph (by the plan, or a cache shorter than min_context) attend by
    SDPA's enable_gqa over the KV heads, as dense as before: the repeat of the cache is gone."""
    from sparse_fx.api import _own_frame
    from sparse_fx.backend import sparse_backend
    from sparse_fx.rewrite import gqa_attention

    dense = ToyDecoder(form=form)
    for options in (dict(dense_layers=[0, 1, 2]), dict(min_context=1000)):
        model = compiled(dense, "hash", budget=4, **options)
        inner, graphs = sparse_backend(sparse_state(model)), []

        def spy(gm, example_inputs):
            graphs.append(gm)
            return inner(gm, example_inputs)

        # Its own code object per compile: the shared one's recompile budget belongs to later tests.
        f = torch.compile(_own_frame(model.forward.original), backend=spy, fullgraph=True)
        x = torch.randn(1, PREFILL + 1, 64, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            f(x[:, :PREFILL], torch.arange(PREFILL))
            got = f(x[:, PREFILL:], torch.tensor([PREFILL]))
            dense(x[:, :PREFILL], torch.arange(PREFILL))
            want = dense(x[:, PREFILL:], torch.tensor([PREFILL]))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        names = [n.target for n in graphs[-1].graph.nodes if n.op in ("call_method", "call_function")]
        assert names.count(gqa_attention) == 3, (options, names)
        assert not {"expand", "repeat_interleave", torch._C._nn.scaled_dot_product_attention} & set(names), names


def test_prism_pool_is_a_graph_edge_from_proposal_to_refined():
    graphs = []
    model = compiled(ToyDecoder(layers=4), "prism-g2", budget=3, sink=1, local=2, rho=2.0, int2_group=8)
    from sparse_fx.backend import sparse_backend

    inner = sparse_backend(sparse_state(model))
    f = torch.compile(model.forward.original, backend=lambda gm, ex: (graphs.append(gm), inner(gm, ex))[1], fullgraph=True)
    with torch.no_grad():
        f(torch.randn(1, PREFILL, 64), torch.arange(PREFILL))
        f(torch.randn(1, 1, 64), torch.tensor([PREFILL]))
    g = graphs[-1].graph
    int2 = [n for n in g.nodes if n.target == OPS.int2_scores.default]
    mass = [n for n in g.nodes if n.target == OPS.mass_select.default]
    assert len(int2) == 2 and len(mass) == 2  # layers 0, 2 propose; 1, 3 refine
    for refined, proposal in zip(mass, int2):
        pool = refined.args[4]  # positions: the proposal layer's pool slice of its nested selection's first list
        ranked = pool.args[0]
        assert pool.target.__name__ == "getitem" and ranked.target.__name__ == "getitem" and ranked.args[1] == 0
        assert ranked.args[0].target == OPS.select_nested.default and ranked.args[0].args[0] is proposal
    rows = sparse_fx.explain(model).rows
    assert [r.role for r in rows] == ["proposal", "refined", "proposal", "refined"]
    assert "from L0" in rows[1].budget and "pool 6" in rows[0].budget


def test_compile_rejects_bad_input():
    model = ToyDecoder()
    with pytest.raises(ValueError, match="valid plans"):
        sparse_fx.compile(model, "topk")
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        sparse_fx.compile(model, "hash", budget=0)
    with pytest.raises(ValueError, match="valid backends: inductor, eager"):
        sparse_fx.compile(model, "hash", backend="tvm")
    with pytest.raises(ValueError, match="valid modes"):
        sparse_fx.compile(model, "hash", mode="fast")
    with pytest.raises(ValueError, match=r"encoders only apply to plans that score with signatures .*not 'oracle'"):
        sparse_fx.compile(model, "oracle", encoders=object())
    with pytest.raises(ValueError, match="not 'prism-g4'"):
        sparse_fx.compile(model, "prism-g4", encoders=object())  # INT2 proposals: no signatures
    with pytest.raises(ValueError, match="does not divide head dim 16"):
        sparse_fx.compile(model, "prism-g4", int2_group=32)
    with pytest.raises(ValueError, match="training mode"):
        sparse_fx.compile(ToyDecoder().train(), "hash")
    with pytest.raises(ValueError, match="not compiled with sparse_fx"):
        sparse_fx.explain(model)


def test_training_mode_after_compile_is_an_error():
    model = compiled(ToyDecoder(), "hash")
    model.train()
    with pytest.raises(RuntimeError, match="training mode"):
        run(model)


def test_recompiling_with_another_plan_replaces_the_first():
    model = compiled(ToyDecoder(), "hash", budget=4, sink=2, local=3)
    sparse_fx.compile(model, "dense", backend="eager")
    dense = ToyDecoder()
    for a, b in zip(run(dense), run(model)):
        torch.testing.assert_close(a, b)
    assert sparse_fx.explain(model).plan.name == "dense"
