"""The oracle: exact attention mass of every key (the quality ceiling, not a speed plan)."""

from __future__ import annotations

from . import OPS, Method, Selection, register


class Oracle(Method):
    name = "oracle"
    description = "exact attention-mass top-k over the full-precision keys (the quality ceiling)"
    takes_mass = True  # its scores are the exact attention mass

    def select(self, emit, state, site):
        scores = emit.call(OPS.mass_scores.default, site.q, site.k, site.scale, site.mask)
        idx = self.topk(emit, state, site, scores, state.plan.budget, mass=True)
        return Selection(idx, note=self.mass_note(state.plan))


register(Oracle())
