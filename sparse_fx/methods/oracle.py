"""The oracle: exact attention mass of every key (the quality ceiling, not a speed plan)."""

from __future__ import annotations

from . import OPS, Method, Selection, register


class Oracle(Method):
    name = "oracle"
    description = "exact attention-mass top-k over the full-precision keys (the quality ceiling)"

    def select(self, emit, state, site):
        scores = emit.call(OPS.mass_scores.default, site.q, site.k, site.scale, site.mask)
        return Selection(self.topk(emit, state, site, scores, state.plan.budget))


register(Oracle())
