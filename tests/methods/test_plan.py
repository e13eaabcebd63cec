"""Plans: names, options, validation, JSON files. Every bad argument or file is a ValueError that
names it and the valid choices."""

import dataclasses
import json

import pytest

from sparse_fx import Plan


@pytest.mark.parametrize(
    "name, method, group",
    [("dense", "dense", 4), ("oracle", "oracle", 4), ("hash", "hash", 4), ("prism-g4", "prism", 4),
     ("prism-g9", "prism", 9), ("static-g4", "static", 4), ("Prism", "prism", 4), ("prism-g4-hash", "prism", 4),
     ("static-g2-hash", "static", 2), ("prism-g4-int2refine", "prism", 4), ("prism-g2-hash-int2refine-uniform", "prism", 2)],
)
def test_parse_names(name, method, group):
    p = Plan.parse(name)
    assert (p.method, getattr(p.options, "group", 4)) == (method, group)
    assert Plan.parse(p.name) == p


def test_options_override_and_pool():
    p = Plan.parse("prism-g4", budget=512, rho=2.5, sink=4, local=16)
    assert (p.budget, p.options.pool(p.budget), p.window) == (512, 1280, 20)


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("sparse", {}, "unknown plan 'sparse'; valid plans: dense, oracle, hash, hash-b<bits>"),
        ("prism-4", {}, "unknown plan"),
        ("hash", {"budget": 0}, "budget must be an int >= 1"),
        ("hash", {"budget": -5}, "budget must be an int >= 1"),
        ("hash", {"budget": 1.5}, "budget must be an int"),
        ("hash", {"local": 0}, "local must be an int >= 1"),
        ("hash", {"bits": 48}, "multiple of 32"),
        ("hash", {"seed": "x"}, r"seed must be an int, got 'x' \(str\)"),
        ("hash", {"seed": True}, "seed must be an int"),
        ("prism-g4", {"rho": "4"}, r"rho \(pool size / budget\) must be a number >= 1, got '4'"),
        ("prism-g0", {}, "group must be an int >= 1"),
        ("prism-g4", {"rho": 0.5}, "rho"),
        ("hash", {"dense_layers": [-1]}, r"dense_layers entries must be an int >= 0 .*negative.*got -1"),
        ("hash", {"dense_layers": 1}, "dense_layers must be a list of layer indices, got 1"),
        ("hash", {"dense_layers": ["0"]}, "dense_layers entries must be an int"),
        ("hash", {"budgte": 3}, r"unknown plan option\(s\) \['budgte'\] for 'hash'; valid options: budget, .*hash's own: bits"),
        ("hash", {"roles": ("proposal",)}, r"\['roles'\] for 'hash' \(roles: an option of prism, static\)"),
        ("prism-g4", {"roles": "proposal"}, "roles must be a list of layer roles"),
        ("prism-g4", {"roles": ("refined", "proposal")}, "first sparse layer must be a proposal"),
        ("prism-g4", {"roles": ("proposal", "bogus")}, "unknown layer roles"),
        ("hash", {"encoders": 3}, "encoders must be a directory path"),
        ("prism-g4", {"proposal": "int4"}, r"proposal='int4' is not one 'prism' takes; valid: int2, hash"),
        ("hash", {"proposal": "hash"}, r"\['proposal'\] for 'hash' \(proposal: an option of prism, static\)"),
        ("hash-hash", {}, "unknown plan"),
        ("hash", {"min_context": -1}, r'min_context must be an int >= 0 \(the static cache length .*\) or "auto", got -1'),
        ("prism-g4", {"min_context": "fast"}, r"min_context must be an int >= 0 .*got 'fast' \(str\)"),
        ("hash", {"min_context": 1.5}, "min_context must be an int"),
    ],
)
def test_bad_plans_raise_naming_valid_choices(name, options, match):
    with pytest.raises(ValueError, match=match):
        Plan.parse(name, **options)


def test_json_round_trip(tmp_path):
    p = Plan.parse("prism-g4", budget=256, roles=("proposal", "refined", "proposal", "refined", "dense"))
    path = tmp_path / "plan.json"
    p.save(path)
    assert Plan.load(path) == p
    assert Plan.parse(str(path)) == p
    assert p.min_context == "auto" and Plan.parse(str(path), min_context=4096).min_context == 4096
    Plan.parse("hash", min_context=0).save(path)
    assert Plan.load(path).min_context == 0


@pytest.mark.parametrize("text, match", [
    ("{", "not valid JSON"),
    ('{"method": "hash"}', "not a sparse_fx plan file"),
    ('{"format": "sparse_fx.plan/1", "method": "hash", "wat": 1}', r"unknown plan option\(s\) \['wat'\].*in plan file"),
    ('{"format": "sparse_fx.plan/1", "method": "hash", "dense_layers": 1}', r"dense_layers must be a list.*in plan file"),
    ('{"format": "sparse_fx.plan/1", "method": "nope"}', r"unknown method 'nope'.*in plan file"),
])
def test_bad_plan_files(tmp_path, text, match):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        Plan.load(path)


def test_missing_plan_file_and_a_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="is a directory"):
        Plan.load(tmp_path)
    (tmp_path / "d.json").mkdir()
    with pytest.raises(ValueError, match="is a directory"):
        Plan.parse(str(tmp_path / "d.json"))


def test_hash_widths_and_encoder_paths():
    assert Plan.parse("hash-b128").options.bits == 128 and Plan.parse("hash-b128").name == "hash-b128"
    p = Plan.parse("hash", encoders="enc/")
    assert p.name == "hash-learned" and p.options.encoders == "enc/"
    with pytest.raises(ValueError, match="multiple of 32"):
        Plan.parse("hash-b48")
    with pytest.raises(ValueError, match=r"encoders apply to plans that score with signatures .*not 'prism' with proposal='int2'"):
        Plan.parse("prism-g4", encoders="enc/")


def test_signature_proposals_by_name_or_option_and_in_files(tmp_path):
    by_name, by_option = Plan.parse("prism-g4-hash"), Plan.parse("prism-g4", proposal="hash")
    assert by_name == by_option and by_name.options.proposal == "hash" and by_name.name == "prism-g4-hash"
    assert Plan.parse("prism-g4").options.proposal == "int2"
    p = Plan.parse("prism-g2-hash", encoders="enc/", roles=("proposal", "refined"))
    assert p.name == "prism-g2-hash-learned-calibrated"
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == p


def test_refined_layers_rank_by_int2_keys_by_name_or_option_and_in_files(tmp_path):
    by_name, by_option = Plan.parse("prism-g4-int2refine"), Plan.parse("prism-g4", refine="int2")
    assert by_name == by_option and by_name.options.refine == "int2" and Plan.parse("prism-g4").options.refine == "exact"
    p = Plan.parse("prism-g2-hash-int2refine", roles=("proposal", "refined"))
    assert p.name == "prism-g2-hash-int2refine-calibrated" and (p.options.proposal, p.options.refine) == ("hash", "int2")
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == p
    with pytest.raises(ValueError, match=r"refine='int8' is not one 'prism' takes; valid: exact, int2"):
        Plan.parse("prism-g4", refine="int8")
    with pytest.raises(ValueError, match=r"refine='int2' is not one 'static' takes; valid: exact"):
        Plan.parse("static-g4", refine="int2")
    with pytest.raises(ValueError, match=r"refine='int2' ranks it by INT2 scores.*valid with mass < 1: refine='exact'"):
        Plan.parse("prism-g4-int2refine-mass0.9")


@pytest.mark.parametrize("name, method, mass", [
    ("prism-g4-mass0.95", "prism", 0.95), ("oracle-mass0.9", "oracle", 0.9), ("prism-g2-hash-mass0.5", "prism", 0.5),
    ("oracle-mass1e-05", "oracle", 1e-5), ("oracle-mass1", "oracle", 1.0),
])
def test_mass_in_names_round_trips(name, method, mass, tmp_path):
    p = Plan.parse(name)
    assert (p.method, p.mass) == (method, mass)
    assert Plan.parse(p.name) == p and p.name == (name if mass < 1 else method)
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == p and Plan.parse(str(tmp_path / "p.json"), mass=0.5).mass == 0.5
    assert Plan.parse("prism-g4", mass=0.95).name == "prism-g4-mass0.95" and Plan.parse("prism-g4", mass=1).mass == 1.0


@pytest.mark.parametrize("mass", [0, -0.1, 1.5, "x", True, float("nan"), float("inf"), None])
def test_bad_mass_is_rejected_naming_the_valid_range(mass):
    with pytest.raises(ValueError, match=r"mass \(share of the candidates' attention mass to keep\) must be a number "
                                         r"in \(0, 1\], got "):
        Plan.parse("prism-g4", mass=mass)


@pytest.mark.parametrize("name, options, match", [
    ("hash", {"mass": 0.9}, r"mass=0.9 needs a method that estimates attention mass; 'hash' does not "
                            r"\(valid with mass < 1: oracle, prism\)"),
    ("dense-mass0.5", {}, "'dense' does not"),
    ("static-g2-hash-mass0.5", {}, r"mass=0.5 needs a method that estimates attention mass; 'static' does not"),
    ("static-g2-mass0.5", {}, r"'static' does not \(valid with mass < 1: oracle, prism\)"),
    ("oracle-massx", {}, r"unknown plan 'oracle-massx'; .*any of them \+ -mass<p> \(0 < p <= 1"),
    ("oracle-mass2", {}, r"must be a number in \(0, 1\], got 2.0"),
    ("oracle-mass1..5", {}, "-mass1..5 is not a number"),
])
def test_mass_on_a_method_without_an_estimate_and_bad_mass_names(name, options, match):
    with pytest.raises(ValueError, match=match):
        Plan.parse(name, **options)


WRONG_VALUES = [5, -3, 1.5, True, "x", "", [], [1, "a"], {}, {"a": 1}, None]


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Plan)])
def test_every_field_of_a_plan_file_with_a_wrong_value_is_a_value_error_naming_file_and_field(field, tmp_path):
    """Each plan field set to values of every JSON type: the file loads or raises a ValueError that
    names the file and the field (never a TypeError or AttributeError from inside); so does
    Plan.parse with the value as an option."""
    path = tmp_path / "plan.json"
    for value in WRONG_VALUES:
        path.write_text(json.dumps(Plan.parse("prism-g4", roles=("proposal", "refined")).to_dict() | {field: value}))
        try:
            Plan.load(path)
        except ValueError as e:
            assert str(path) in str(e) and field in str(e), (value, str(e))
        if field not in ("method", "note"):
            try:
                Plan.parse("prism-g4", **{field: value})
            except ValueError as e:
                assert field in str(e), (value, str(e))


def test_roles_of_the_wrong_type_are_named():
    with pytest.raises(ValueError, match="roles must be a list of layer roles"):
        Plan.parse("prism-g4", roles=5)
