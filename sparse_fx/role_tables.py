"""Prism layer roles calibrated ahead of time for known models, shipped in `sparse_fx/roles/`.

Which layers propose matters more than INT2 (bench/NOTES.md, "Where the pools lose"): on SmolLM2
the calibrated roles keep 97.6% of the oracle's agreement at 2K-8K where the uniform grouping keeps
95-96%, and every pass key dense finds. So `compile(model, "prism-g<G>")` with no explicit roles
takes the table made for this model, G and proposal kind when one ships here, matched as trained
encoders are (shapes and a sample of the weights); otherwise the uniform grouping. `roles="uniform"`
(or the name suffix -uniform, e.g. prism-g4-uniform) asks for the uniform grouping; explicit roles
or a plan file win over any table. A table is a calibrated plan's roles, the proposal kinds they
were calibrated for, and the model's fingerprint (`table_of`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from . import methods
from .plan import Plan
from .runtime.encoders import same_weights

FORMAT = "sparse_fx.roles/1"
TABLES = Path(__file__).parent / "roles"
SHAPES = ("model_type", "num_layers", "q_heads", "kv_heads", "head_dim")


def table_of(plan: Plan, fingerprint: dict, made_by: str) -> dict:
    """A shippable table from a calibrated plan (`sparse_fx.calibrate`) and its model's fingerprint."""
    if not methods.get(plan.method).shipped_roles or not isinstance(plan.options.roles, tuple):
        raise ValueError(f"sparse_fx: a role table needs a calibrated plan with layer roles, not {plan.name!r}")
    o = plan.options
    return {"format": FORMAT, "group": o.group, "proposals": [o.proposal], "roles": list(o.roles),
            "fingerprint": fingerprint, "made_by": made_by, "note": plan.note}


def resolve(plan: Plan, model, info) -> Plan:
    """`plan` with the shipped roles of this model if it asks for the default roles and a table matches."""
    if not methods.get(plan.method).shipped_roles or plan.options.roles is not None:
        return plan
    o = plan.options
    shapes = {k: getattr(info, k) for k in SHAPES}
    candidates = [(path, t) for path, t in _tables() if t["group"] == o.group and o.proposal in t["proposals"]
                  and {k: t["fingerprint"].get(k) for k in SHAPES} == shapes]
    if not candidates:
        return plan
    sample = info.fingerprint(model)["weights"]  # only for models shaped like a table's
    for path, t in candidates:
        if same_weights(t["fingerprint"]["weights"], sample):
            note = (f"roles: calibrated for this model (sparse_fx/roles/{path.name}: {t['made_by']}); "
                    f"{plan.replace(roles='uniform').name} or roles='uniform' for the uniform grouping")
            return dataclasses.replace(plan.replace(roles=tuple(t["roles"])), note="; ".join(n for n in (plan.note, note) if n))
    return plan


def _tables() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(TABLES.glob("*.json")):
        t = json.loads(path.read_text())
        if t.get("format") != FORMAT:
            raise ValueError(f"sparse_fx: {path} is not a role table (expected \"format\": \"{FORMAT}\")")
        out.append((path, t))
    return out
