"""Lossless mode (`speculate=`): sparse drafts, dense verification. Every test first shows that the
plan alone changes the tokens (at these small budgets), then that lossless mode gives exactly the
dense model's: greedy tokens equal plain dense greedy decoding in fp32, and sampled tokens have the
dense model's distribution."""

import math

import pytest
import torch

import sparse_fx
from support import SMALL, assert_side_caches_match_the_keys, options_for, tiny_model
from sparse_fx.api import sparse_state

# every plan in `make test-slow`; CI keeps one of each method and the INT2-refined Prism
PLANS = ["hash", "prism-g2-int2refine", "static-g2", *(pytest.param(p, marks=pytest.mark.slow) for p in ("oracle", "prism-g2", "prism-g2-hash"))]


def _generate(model, ids, n, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static", **kwargs)


def _pair(plan, gamma=4, batch="rows", **config):
    """(the plan alone, the plan in lossless mode) on two copies of one tiny model."""
    options = options_for(plan, **SMALL)
    lossy = sparse_fx.compile(tiny_model("llama", layers=4, **config), plan, backend="eager", **options)
    lossless = sparse_fx.compile(tiny_model("llama", layers=4, **config), plan, backend="eager", speculate=gamma,
                                 speculate_batch=batch, **options)
    return lossy, lossless


def _left_padded(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, 128, (n,), generator=g)
    return ids, (ids != 0).long()


@pytest.mark.parametrize("plan", PLANS)
def test_greedy_tokens_are_the_dense_models_where_the_plan_alone_changes_them(plan):
    dense = tiny_model("llama", layers=4)
    lossy, lossless = _pair(plan)
    ids = torch.randint(1, 128, (1, 70), generator=torch.Generator().manual_seed(5))
    want = _generate(dense, ids, 37)
    assert not torch.equal(_generate(lossy, ids, 37), want), "the plan alone already gives the dense tokens"
    assert torch.equal(_generate(lossless, ids, 37), want)
    seen = sparse_fx.acceptance(lossless)
    assert 0 < seen.accepted < seen.drafted and seen.emitted == 36  # the first token is the prefill's


@pytest.mark.parametrize("batch, gamma", [("rows", 3), ("min", "auto"), pytest.param("rows", "auto", marks=pytest.mark.slow),
                                          pytest.param("min", 3, marks=pytest.mark.slow)])
def test_a_left_padded_batch_gets_each_rows_dense_tokens_though_rows_accept_differently(batch, gamma):
    dense = tiny_model("llama", layers=4, pad_token_id=0)
    lossy, lossless = _pair("hash", gamma, batch, pad_token_id=0)
    ids, attn = _left_padded([66, 41, 58], seed=7)
    want = _generate(dense, ids, 29, attention_mask=attn, pad_token_id=0)
    assert not torch.equal(_generate(lossy, ids, 29, attention_mask=attn, pad_token_id=0), want)
    assert torch.equal(_generate(lossless, ids, 29, attention_mask=attn, pad_token_id=0), want)
    seen = sparse_fx.acceptance(lossless)
    assert seen.uneven > 0, "no round had rows accepting different numbers of drafts: the case is not exercised"
    if gamma == "auto":
        assert len(seen.gammas) >= 1 and set(seen.gammas) <= {1, 2, 4, 8}


def test_eos_inside_a_draft_stops_that_row_as_dense_generate_does():
    dense = tiny_model("llama", layers=4, pad_token_id=0)
    ids, attn = _left_padded([50, 61], seed=11)
    free = _generate(dense, ids, 30, attention_mask=attn, pad_token_id=0)
    row = free[0, ids.shape[1]:].tolist()
    eos = next(t for i, t in enumerate(row) if i >= 6 and t not in row[:i])  # a token row 0 first emits mid-way
    want = _generate(dense, ids, 30, attention_mask=attn, pad_token_id=0, eos_token_id=eos)
    assert (want[0, ids.shape[1]:] == 0).any(), "row 0 did not stop early"
    _, lossless = _pair("prism-g2", 4, pad_token_id=0)
    got = _generate(lossless, ids, 30, attention_mask=attn, pad_token_id=0, eos_token_id=eos)
    assert torch.equal(got, want)


@pytest.mark.parametrize("batch", ["rows", pytest.param("min", marks=pytest.mark.slow)])
def test_side_caches_equal_their_recomputation_after_200_steps_with_rejections(batch):
    _, lossless = _pair("prism-g2-hash", 4, batch)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    out = _generate(lossless, ids, 200, return_dict_in_generate=True)
    seen = sparse_fx.acceptance(lossless)
    assert seen.accepted < seen.drafted and out.sequences.shape[1] == 240
    cache = out.past_key_values
    assert_side_caches_match_the_keys(lossless, cache, int(cache.layers[0].cumulative_length))


def test_later_calls_compile_nothing_and_the_verify_graph_writes_the_side_caches():
    _, lossless = _pair("hash", 4, eos_token_id=None)
    g = torch.Generator().manual_seed(4)
    _generate(lossless, torch.randint(1, 128, (1, 60), generator=g), 20)
    state = sparse_state(lossless)
    graphs = len(state.reports)
    assert graphs == 2 and [r.decode for r in state.reports] == [True, False]  # a draft graph, a verify graph
    with torch._dynamo.config.patch(error_on_recompile=True):
        for n in (45, 70, 61):
            _generate(lossless, torch.randint(1, 128, (1, n), generator=g), 20)
    assert len(state.reports) == graphs
    verify = state.reports[-1]
    assert all(r.action == "dense" for r in verify.rows)
    assert "side cache" in " ".join(r.reason for r in verify.rows if r.role != "dense")


def test_the_verify_graph_reads_the_cache_through_few_query_attention(monkeypatch):
    """Each layer's verify attention is few_query_attention over the gamma + 1 queries (SDPA's kernels
    split the keys for one query only); on the CPU the op is its reference, which is counted here."""
    from sparse_fx.lowering import reference

    seen, real = [], reference.few_query_attention
    monkeypatch.setattr(reference, "few_query_attention", lambda q, *a: seen.append(tuple(q.shape)) or real(q, *a))
    _, lossless = _pair("hash", 3, eos_token_id=None)
    ids = torch.randint(1, 128, (2, 50), generator=torch.Generator().manual_seed(6))
    dense = sparse_fx.compile(tiny_model("llama", layers=4, eos_token_id=None), "dense", backend="eager")
    assert torch.equal(_generate(lossless, ids, 12), _generate(dense, ids, 12))
    assert seen and {shape[2] for shape in seen} == {4} and len(seen) % 4 == 0  # every layer, every round


def test_explain_shows_the_mode_and_bad_arguments_are_refused():
    _, lossless = _pair("hash", 2, eos_token_id=None)
    ids = torch.randint(1, 128, (1, 50), generator=torch.Generator().manual_seed(3))
    _generate(lossless, ids, 8)
    notes = " ".join(sparse_fx.explain(lossless).notes)
    assert "lossless" in notes and "gamma 2" in notes and "acceptance" in notes
    with pytest.raises(ValueError, match="beam search"):
        _generate(lossless, ids, 8, num_beams=2)
    with pytest.raises(ValueError, match="returning scores"):
        _generate(lossless, ids, 8, output_scores=True, return_dict_in_generate=True)
    with pytest.raises(ValueError, match="speculate=0"):
        sparse_fx.compile(tiny_model("llama"), "hash", speculate=0)
    with pytest.raises(ValueError, match="speculate_batch='each'"):
        sparse_fx.compile(tiny_model("llama"), "hash", speculate=2, speculate_batch="each")
    with pytest.raises(ValueError, match="local attention"):
        sparse_fx.compile(tiny_model("gemma2"), "hash", speculate=2)
    with pytest.raises(ValueError, match="speculate=<draft length>"):
        sparse_fx.acceptance(sparse_fx.compile(tiny_model("llama"), "hash", backend="eager"))
    sparse_fx.api.restore(lossless)
    assert "generate" not in lossless.__dict__


def test_processors_that_read_the_history_see_each_positions_own():
    """repetition_penalty and min_new_tokens depend on the tokens so far: applied per position."""
    dense = tiny_model("llama", layers=4)
    _, lossless = _pair("prism-g2", 4)
    ids = torch.randint(1, 128, (2, 45), generator=torch.Generator().manual_seed(8))
    opts = dict(repetition_penalty=1.3, min_new_tokens=12, eos_token_id=5)
    assert torch.equal(_generate(lossless, ids, 24, **opts), _generate(dense, ids, 24, **opts))


def _order_of_calls(monkeypatch, model, ids, n, **opts):
    """The lossless loop's model calls and its end-of-round reads, in order: "d" a draft step, "v" a
    verify step, "r" a round booked after its device-to-host read."""
    from sparse_fx import speculate

    seen = []
    call, count = speculate._Rounds._call, speculate._Rounds._count

    def _call(self, tokens, positions, verify):
        seen.append("v" if verify else "d")
        return call(self, tokens, positions, verify)

    def _count(self, *args, **kwargs):
        seen.append("r")
        return count(self, *args, **kwargs)

    monkeypatch.setattr(speculate._Rounds, "_call", _call)
    monkeypatch.setattr(speculate._Rounds, "_count", _count)
    _generate(model, ids, n, **opts)
    return "".join(seen)


def test_the_next_rounds_first_draft_is_launched_before_the_rounds_read(monkeypatch):
    """Greedy: a round after which more rounds are needed (the first three of 30 tokens at gamma 4 emit
    at most 15) launches the next round's first draft before its read, so the GPU drafts while the host
    books it, and the tokens stay the dense model's; the last round launches none. A processor that
    reads the history needs the round's tokens first: there the read comes before the next draft."""
    dense = tiny_model("llama", layers=4)
    _, lossless = _pair("hash", 4)
    ids = torch.randint(1, 128, (2, 45), generator=torch.Generator().manual_seed(3))
    order = _order_of_calls(monkeypatch, lossless, ids, 30)
    rounds = order.split("r")[:-1]
    assert len(rounds) >= 4 and all(r.endswith("vd") for r in rounds[:3]) and rounds[-1].endswith("v"), order
    assert torch.equal(_generate(lossless, ids, 30), _generate(dense, ids, 30))
    order = _order_of_calls(monkeypatch, lossless, ids, 30, repetition_penalty=1.3)
    assert "vd" not in order and order.count("vr") == order.count("r"), order


# ---------------------------------------------------------------- sampling: the dense distribution


def _exact_distributions(model, prompt, steps, warp):
    """[steps, V] marginal distributions of the next `steps` sampled tokens of the dense model
    (every continuation enumerated: a tiny vocabulary)."""
    V = model.config.vocab_size
    marg, paths, weight = [], prompt[None], torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(paths).logits[:, -1].float()
            p = torch.softmax(warp(paths, logits), -1).double() * weight[:, None]
            marg.append(p.sum(0))
            paths = torch.cat([paths.repeat_interleave(V, 0), torch.arange(V).repeat(len(paths))[:, None]], 1)
            weight = p.reshape(-1)
    return torch.stack(marg)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square (cells of expectation < 5 pooled)."""
    n = counts.sum()
    expect = probs * n
    small = expect < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    exp = torch.cat([expect[~small], expect[small].sum()[None]]) if small.any() else expect
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    df = len(obs) - 1
    # Wilson-Hilferty: the chi-square tail through a normal one
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_have_the_dense_models_distribution_and_the_plans_do_not():
    from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    kwargs = dict(vocab_size=12, eos_token_id=None)  # no row stops early: every row samples all steps
    dense = tiny_model("llama", layers=2, **kwargs)
    options = dict(budget=2, sink=1, local=1)
    lossy = sparse_fx.compile(tiny_model("llama", layers=2, **kwargs), "oracle", backend="eager", **options)
    lossless = sparse_fx.compile(tiny_model("llama", layers=2, **kwargs), "oracle", backend="eager", speculate=3, **options)
    prompt = torch.randint(1, 12, (48,), generator=torch.Generator().manual_seed(0))  # 0 pads
    warp = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(9)])
    steps, rows = 4, 3000
    exact = _exact_distributions(dense, prompt, steps, warp)

    def p_values(model, seed):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(prompt.expand(rows, -1), max_new_tokens=steps, do_sample=True, temperature=0.8, top_k=9,
                                 cache_implementation="static", pad_token_id=0)
        new = out[:, prompt.numel():]
        return [_chi_square_p(torch.bincount(new[:, t], minlength=12).double(), exact[t]) for t in range(steps)]

    ours = p_values(lossless, 1)
    assert min(ours) > 1e-3, ours
    assert sparse_fx.acceptance(lossless).accepted < sparse_fx.acceptance(lossless).drafted
    theirs = p_values(lossy, 1)
    assert min(theirs[1:]) < 1e-6, theirs  # the plan alone samples another distribution: the test can tell


def test_a_next_turn_continues_from_the_returned_cache_and_a_holed_one_is_refused():
    dense = tiny_model("llama", layers=4, eos_token_id=None)
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(6))
    want = _generate(dense, ids, 24)
    _, lossless = _pair("prism-g2", 3, "min", eos_token_id=None)
    from transformers import StaticCache

    roomy = StaticCache(config=lossless.config, max_cache_len=256)  # the caller's, with room for both turns
    second = _generate(lossless, ids, 24, return_dict_in_generate=True, past_key_values=roomy)
    assert torch.equal(second.sequences, want)
    third = _generate(lossless, want, 4, past_key_values=second.past_key_values)
    assert torch.equal(third, _generate(dense, ids, 28))
    _, holed = _pair("hash", 4, "rows", eos_token_id=None)
    out = _generate(holed, torch.randint(1, 128, (3, 40), generator=torch.Generator().manual_seed(9)), 30,
                    return_dict_in_generate=True)
    assert sparse_fx.acceptance(holed).uneven > 0
    with pytest.raises(ValueError, match="accepted different numbers"):
        _generate(holed, out.sequences, 4, past_key_values=out.past_key_values)
