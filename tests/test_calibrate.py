"""Prism calibration: search mode equals fixed roles, greedy result shape, JSON round trip."""

import copy
import math
import subprocess
import sys

import pytest
import torch
from transformers import StaticCache

import sparse_fx
from families import tiny_model
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


@pytest.mark.parametrize("group, proposal", [(2, "int2"), (4, "int2"), (2, "hash")])
def test_calibration_returns_a_valid_role_assignment(model, group, proposal, tmp_path):
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    plain = copy.deepcopy(model)
    plain.set_attn_implementation("eager")
    settings = plain.generation_config.disable_compile
    plan = sparse_fx.calibrate(plain, ids, group=group, steps=6, progress=False, proposal=proposal, **OPTIONS)
    assert not {"forward", "_prepare_static_cache"} & set(plain.__dict__), "calibrate must leave the model as it was"
    assert plain.config._attn_implementation == "eager" and plain.generation_config.disable_compile == settings
    assert len(plan.roles) == 6 and plan.roles[0] == "proposal"
    assert plan.roles.count("proposal") == math.ceil(6 / group) and set(plan.roles) <= {"proposal", "refined"}
    suffix = "-hash" if proposal == "hash" else ""
    assert "calibrated on 2 windows" in plan.note and plan.name == f"prism-g{group}{suffix}-calibrated"
    plan.save(tmp_path / "p.json")
    assert sparse_fx.Plan.load(tmp_path / "p.json") == plan
    compiled = sparse_fx.compile(copy.deepcopy(model), str(tmp_path / "p.json"), backend="eager")
    cache = StaticCache(config=model.config, max_cache_len=48)
    with torch.no_grad():
        compiled(ids[:, :30], past_key_values=cache)
        compiled(ids[:, 30:31], past_key_values=cache)
    assert [r.role for r in sparse_fx.explain(compiled)] == list(plan.roles)


def test_plan_for_another_layer_count_is_a_clear_error(model, tmp_path):
    sparse_fx.Plan.parse("prism-g2", roles=("proposal", "refined") * 2, int2_group=8).save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="roles for 4 layers but the model has 6"):
        sparse_fx.compile(copy.deepcopy(model), str(tmp_path / "p.json"))


def test_calibrate_rejects_bad_input(model):
    with pytest.raises(ValueError, match="valid: prism, static"):
        sparse_fx.calibrate(model, torch.ones(1, 40, dtype=torch.long), method="hash")
    with pytest.raises(ValueError, match="nothing to prefill"):
        sparse_fx.calibrate(model, torch.ones(1, 10, dtype=torch.long), steps=16)
    with pytest.raises(ValueError, match="tokenizer="):
        sparse_fx.calibrate(model)


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "sparse_fx", "calibrate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--group" in out.stdout and "--proposal" in out.stdout and "--encoders" in out.stdout
