"""Plans: names, options, validation, layer roles, JSON files."""

import pytest

from sparse_fx import Plan


@pytest.mark.parametrize(
    "name, method, group",
    [("dense", "dense", 4), ("oracle", "oracle", 4), ("hash", "hash", 4), ("prism-g4", "prism", 4),
     ("prism-g9", "prism", 9), ("static-g4", "static", 4), ("Prism", "prism", 4)],
)
def test_parse_names(name, method, group):
    p = Plan.parse(name)
    assert (p.method, p.group) == (method, group)
    assert Plan.parse(p.name) == p


def test_options_override_and_pool():
    p = Plan.parse("prism-g4", budget=512, rho=2.5, sink=4, local=16)
    assert (p.budget, p.pool, p.window) == (512, 1280, 20)


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("sparse", {}, "unknown plan 'sparse'; valid plans: dense, oracle, hash, hash-b<bits>"),
        ("prism-4", {}, "unknown plan"),
        ("hash", {"budget": 0}, "budget must be > 0"),
        ("hash", {"budget": -5}, "budget must be > 0"),
        ("hash", {"budget": 1.5}, "budget must be an int"),
        ("hash", {"local": 0}, "local must be an int >= 1"),
        ("hash", {"bits": 48}, "multiple of 32"),
        ("prism-g0", {}, "group must be >= 1"),
        ("prism-g4", {"rho": 0.5}, "rho"),
        ("hash", {"budgte": 3}, r"unknown plan option\(s\) \['budgte'\]; valid options: group, budget"),
        ("hash", {"roles": ("proposal",)}, "explicit roles need a prism or static plan"),
        ("prism-g4", {"roles": ("refined", "proposal")}, "first sparse layer must be a proposal"),
        ("prism-g4", {"roles": ("proposal", "bogus")}, "unknown layer roles"),
    ],
)
def test_bad_plans_raise_naming_valid_choices(name, options, match):
    with pytest.raises(ValueError, match=match):
        Plan.parse(name, **options)


def test_uniform_roles_and_dense_layers():
    assert Plan.parse("prism-g1").layer_roles(3) == ["proposal"] * 3  # per-layer INT2 selection, no sharing
    assert Plan.parse("prism-g4").layer_roles(6) == ["proposal", "refined", "refined", "refined", "proposal", "refined"]
    assert Plan.parse("hash", dense_layers=(0, 2)).layer_roles(3) == ["dense", "sparse", "dense"]
    # a dense proposal layer orphans its refined layers: the first of them proposes instead
    assert Plan.parse("static-g3", dense_layers=(0,)).layer_roles(4) == ["dense", "proposal", "refined", "proposal"]
    with pytest.raises(ValueError, match="dense_layers holds layer 9"):
        Plan.parse("hash", dense_layers=(9,)).layer_roles(4)


def test_json_round_trip_and_layer_count_check(tmp_path):
    p = Plan.parse("prism-g4", budget=256, roles=("proposal", "refined", "proposal", "refined", "dense"))
    path = tmp_path / "plan.json"
    p.save(path)
    assert Plan.load(path) == p
    assert Plan.parse(str(path)) == p
    with pytest.raises(ValueError, match="roles for 5 layers but the model has 30"):
        Plan.load(path).layer_roles(30)


@pytest.mark.parametrize("text, match", [("{", "not valid JSON"), ('{"method": "hash"}', "not a sparse_fx plan file"),
                                         ('{"format": "sparse_fx.plan/1", "method": "hash", "wat": 1}', "unknown keys")])
def test_bad_plan_files(tmp_path, text, match):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Plan.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")


def test_hash_widths_and_encoder_paths():
    assert Plan.parse("hash-b128").bits == 128 and Plan.parse("hash-b128").name == "hash-b128"
    p = Plan.parse("hash", encoders="enc/")
    assert p.name == "hash-learned" and p.encoders == "enc/"
    with pytest.raises(ValueError, match="multiple of 32"):
        Plan.parse("hash-b48")
    with pytest.raises(ValueError, match="encoders apply to the hash plan"):
        Plan.parse("prism-g4", encoders="enc/")
