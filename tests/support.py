"""Helpers shared by the test modules (test modules never import each other)."""

from __future__ import annotations

import dataclasses

from sparse_fx import Plan, methods


def options_for(plan: str, **options) -> dict:
    """`options` without those the plan's method does not take (a method owns its options), so one
    set of small-shape options serves a parametrised list of plans."""
    method = methods.get(Plan.parse(plan).method)
    takes = {*Plan.__dataclass_fields__, *(f.name for f in dataclasses.fields(method.options))}
    return {k: v for k, v in options.items() if k in takes or k not in _plan_options()}


def _plan_options() -> set[str]:
    """Every plan option of any method (anything else, e.g. backend, passes through)."""
    return {*Plan.__dataclass_fields__, *(f.name for m in methods.registered() for f in dataclasses.fields(m.options))}
