"""Shipped Prism role tables: `prism-g4` on SmolLM2 takes its calibrated roles, nothing else does."""

import json

import pytest

import sparse_fx
from sparse_fx import role_tables
from sparse_fx.api import sparse_state
from sparse_fx.offline.harness import share_weights_copy
from sparse_fx.model_info import ModelInfo
from sparse_fx.plan import Plan

pytestmark = pytest.mark.model

TABLE = role_tables.TABLES / "smollm2-135m-instruct-prism-g4.json"


def uniform(num_layers: int, group: int) -> list[str]:
    return ["proposal" if i % group == 0 else "refined" for i in range(num_layers)]


def roles_of(model, plan, **options):
    """(the compiled model's layer roles, the compiled model)"""
    m = sparse_fx.compile(share_weights_copy(model), plan, backend="eager", **options)
    return sparse_state(m).roles, m


def test_the_default_prism_plan_takes_the_shipped_roles(smollm2):
    model, _ = smollm2
    table = json.loads(TABLE.read_text())
    roles, m = roles_of(model, "prism-g4")
    assert roles == table["roles"] != uniform(30, 4)
    report = sparse_fx.explain(m)
    assert report.plan.name == "prism-g4-calibrated"
    assert any("calibrated for this model" in n and TABLE.name in n for n in report.notes)


def test_signature_proposals_take_the_table_calibrated_for_them_too(smollm2):
    model, _ = smollm2
    table = json.loads(TABLE.read_text())
    assert "hash" in table["proposals"] and roles_of(model, "prism-g4-hash")[0] == table["roles"]


@pytest.mark.parametrize("plan, options", [("prism-g4", dict(roles="uniform")), ("prism-g4-uniform", {}), ("prism-g9", {}),
                                           ("static-g4", {})])
def test_other_plans_keep_their_own_roles(smollm2, plan, options):
    """roles='uniform', a group without a table and static reuse: uniform groups."""
    model, _ = smollm2
    group = Plan.parse(plan).options.group
    roles, _ = roles_of(model, plan, **options)
    assert roles == uniform(30, group)


def test_explicit_roles_win_over_the_table(smollm2):
    model, _ = smollm2
    mine = ["proposal", "refined"] * 15
    assert roles_of(model, "prism-g4", roles=mine)[0] == mine


def test_a_model_of_the_same_shapes_with_other_weights_gets_uniform_roles(smollm2, monkeypatch):
    model, _ = smollm2
    real = ModelInfo.fingerprint

    def other(self, m):
        fp = real(self, m)
        return {**fp, "weights": [w * 1.5 + 0.01 for w in fp["weights"]]}

    monkeypatch.setattr(ModelInfo, "fingerprint", other)
    plan = Plan.parse("prism-g4")
    assert role_tables.resolve(plan, model, ModelInfo.of(model)) is plan


def test_a_file_that_is_not_a_table_is_refused(smollm2, tmp_path, monkeypatch):
    (tmp_path / "x.json").write_text(json.dumps({"format": "sparse_fx.plan/1"}))
    monkeypatch.setattr(role_tables, "TABLES", tmp_path)
    model, _ = smollm2
    with pytest.raises(ValueError, match="not a role table"):
        role_tables.resolve(Plan.parse("prism-g4"), model, ModelInfo.of(model))
