"""The oracle: exact attention mass of every key (the quality ceiling, not a speed plan)."""

from __future__ import annotations

from . import OPS, Method, Selection, register


class Oracle(Method):
    name = "oracle"
    description = "exact attention-mass top-k over the full-precision keys (the quality ceiling)"
    takes_mass = True  # its scores are the exact attention mass

    def select(self, emit, ctx, site):
        scores = emit.call(OPS.mass_scores.default, site.q, site.k, site.scale, site.mask)
        idx = self.topk(emit, ctx, site, scores, ctx.plan.budget, mass=True)
        return Selection(idx, note=self.mass_note(ctx.plan))


register(Oracle())
