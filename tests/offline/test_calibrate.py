"""Prism calibration: search mode equals fixed roles, greedy result shape, JSON round trip."""

import copy
import itertools
import math
import subprocess
import sys

import pytest
import torch
from transformers import StaticCache

import sparse_fx
from support import tiny_model
from sparse_fx.api import sparse_state

OPTIONS = dict(budget=4, sink=2, local=3, rho=2.0, int2_group=8)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=6)


@pytest.mark.parametrize("plan", ["prism-g3", "static-g3", "prism-g3-hash"])
def test_search_mode_with_roles_set_equals_the_plan_with_those_roles(model, plan):
    roles = ("proposal", "refined", "proposal", "refined", "refined", "proposal")
    fixed = sparse_fx.compile(copy.deepcopy(model), plan, backend="eager", roles=roles, **OPTIONS)
    search = sparse_fx.compile(copy.deepcopy(model), plan, backend="eager", _search=True, **OPTIONS)
    sparse_state(search).method.set_roles(list(roles))
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    ca, cb = StaticCache(config=model.config, max_cache_len=48), StaticCache(config=model.config, max_cache_len=48)
    with torch.no_grad():
        fixed(ids[:, :30], past_key_values=ca)
        search(ids[:, :30], past_key_values=cb)
        for t in range(30, 40):
            torch.testing.assert_close(fixed(ids[:, t : t + 1], past_key_values=ca).logits,
                                       search(ids[:, t : t + 1], past_key_values=cb).logits)


@pytest.mark.parametrize("group, proposal, objective", [(2, "int2", "mass"), (4, "int2", "mass"), (2, "int2", "ce"),
                                                        (2, "hash", "ce"), (2, "hash", "mass")])
def test_calibration_returns_a_valid_role_assignment(model, group, proposal, objective, tmp_path):
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("eager")
    settings = plain.generation_config.disable_compile
    plan = sparse_fx.calibrate(plain, ids, group=group, steps=6, progress=False, proposal=proposal, objective=objective,
                               **OPTIONS)
    assert not {"forward", "_prepare_static_cache"} & set(plain.__dict__), "calibrate must leave the model as it was"
    assert plain.config._attn_implementation == "eager" and plain.generation_config.disable_compile == settings
    assert len(plan.options.roles) == 6 and plan.options.roles[0] == "proposal"
    assert plan.options.roles.count("proposal") == math.ceil(6 / group) and set(plan.options.roles) <= {"proposal", "refined"}
    suffix = "-hash" if proposal == "hash" else ""
    assert "calibrated on 2 windows" in plan.note and plan.name == f"prism-g{group}{suffix}-calibrated"
    plan.save(tmp_path / "p.json")
    assert sparse_fx.Plan.load(tmp_path / "p.json") == plan
    compiled = sparse_fx.compile(copy.deepcopy(model), str(tmp_path / "p.json"), backend="eager")
    cache = StaticCache(config=model.config, max_cache_len=48)
    with torch.no_grad():
        compiled(ids[:, :30], past_key_values=cache)
        compiled(ids[:, 30:31], past_key_values=cache)
    assert [r.role for r in sparse_fx.explain(compiled)] == list(plan.options.roles)


def test_plan_for_another_layer_count_is_a_clear_error(model, tmp_path):
    sparse_fx.Plan.parse("prism-g2", roles=("proposal", "refined") * 2, int2_group=8).save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="roles for 4 layers but the model has 6"):
        sparse_fx.compile(copy.deepcopy(model), str(tmp_path / "p.json"))


@pytest.mark.parametrize("seed", range(20))
def test_mass_objective_finds_the_best_contiguous_groups(seed):
    """The dynamic programme against every way of choosing the leads (the first layer always leads)."""
    from sparse_fx.offline.calibrate import _best_leads, _value

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    groups = int(torch.randint(1, n + 1, (1,), generator=g))
    share = torch.rand(n, n, generator=g, dtype=torch.float64).triu()
    best = max(([0, *rest] for rest in itertools.combinations(range(1, n), groups - 1)), key=lambda leads: _value(share, leads))
    leads = _best_leads(share, groups)
    assert len(leads) == groups and leads[0] == 0 and leads == sorted(set(leads))
    assert math.isclose(_value(share, leads), _value(share, best), rel_tol=1e-12)


def test_mass_objective_scores_as_the_decode_ops_do():
    """Its per-step attention mass and INT2 proposal scores are the references' (mass_scores,
    int2_scores) for a query at that step, over that step's causal prefix."""
    from sparse_fx.offline.calibrate import attention_mass, decode_candidates, int2_score
    from sparse_fx.lowering import reference as ref

    g = torch.Generator().manual_seed(3)
    S, Hq, Hkv, T, D = 5, 4, 2, 50, 16
    q, k = torch.randn(S, Hq, D, generator=g), torch.randn(Hkv, T, D, generator=g)
    plan = sparse_fx.Plan.parse("prism-g2", budget=4, sink=3, local=4, int2_group=8)
    allowed = decode_candidates(T, S, plan, "cpu")
    mass, score = attention_mass(q, k, allowed), int2_score(q, k, 8)
    codes, params = ref.int2_quantize(k[None], 8)
    for s in range(S):
        now = T - S + s
        mask = (torch.arange(T) <= now)[None, None, None]
        want = ref.mass_scores(q[s][None, :, None], k[None], None, mask)[0]
        torch.testing.assert_close(mass[s], want * allowed[s], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(score[s], ref.int2_scores(q[s][None, :, None], codes, params)[0], rtol=1e-5, atol=1e-5)
        assert allowed[s, 0].sum() == now - plan.local + 1 - plan.sink


@pytest.mark.parametrize("trained", [False, True])
def test_mass_objective_scores_signature_proposals_as_the_decode_ops_do(trained):
    """Its signature proposal score is 2 x the Hamming similarity the served op sums over a KV head's
    query heads (reference.hamming_scores of the packed signs), less G x bits: the same order."""
    from sparse_fx.offline.calibrate import signature_score
    from sparse_fx.lowering import reference as ref
    from sparse_fx.runtime.encoders import Encoders, HeadMLP, LayerEncoders, SignatureEncoders

    g = torch.Generator().manual_seed(4)
    S, Hq, Hkv, T, D, bits = 5, 6, 2, 40, 16, 64
    q, k = torch.randn(S, Hq, D, generator=g), torch.randn(Hkv, T, D, generator=g)
    learned = None
    if trained:
        def mlp(heads):
            return HeadMLP([torch.randn(heads, D, 24, generator=g), torch.randn(heads, 24, bits, generator=g)],
                           [torch.randn(heads, 24, generator=g), None])
        learned = SignatureEncoders([LayerEncoders(query=mlp(Hq), key=mlp(Hkv))], bits=bits, fingerprint={}, metadata={})
    enc = Encoders(bits, 0, learned).layer(0, Hq, Hkv, D, torch.device("cpu"))
    score = signature_score(q, k, enc)
    k_sig = ref.pack_signs(apply(k[None], enc.key))
    for s in range(S):
        q_sig = ref.pack_signs(apply(q[s][None, :, None], enc.query))[:, :, 0]
        sim = ref.hamming_scores(q_sig, k_sig)[0].double()
        torch.testing.assert_close(score[s].double(), 2 * sim - (Hq // Hkv) * bits, rtol=0, atol=0)


def apply(x, mlp):
    from sparse_fx.runtime.encoders import apply_head_mlp

    return apply_head_mlp(x, *mlp.params())


def test_calibrate_rejects_bad_input(model):
    with pytest.raises(ValueError, match="valid: mass, ce"):
        sparse_fx.calibrate(model, torch.ones(1, 40, dtype=torch.long), objective="loss")
    with pytest.raises(ValueError, match="fewer candidates than a pool"):
        sparse_fx.calibrate(model, torch.ones(1, 40, dtype=torch.long), budget=16, sink=2, local=3, int2_group=8)
    with pytest.raises(ValueError, match="valid: prism, static"):
        sparse_fx.calibrate(model, torch.ones(1, 40, dtype=torch.long), method="hash")
    with pytest.raises(ValueError, match="nothing to prefill"):
        sparse_fx.calibrate(model, torch.ones(1, 10, dtype=torch.long), steps=16)
    with pytest.raises(ValueError, match="tokenizer="):
        sparse_fx.calibrate(model)


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "sparse_fx", "calibrate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--group" in out.stdout and "--proposal" in out.stdout and "--encoders" in out.stdout
