"""Prism: proposal layers score every key with INT2 copies and keep a pool of rho * budget
candidates; the refined layers after them re-score only that pool with their own exact keys.
With `proposal="hash"` (plan name suffix `-hash`) proposal layers score with HashAttention's
32-bit signatures instead (4 bytes a key against INT2's 48 at head dim 128), beyond both papers.
With `refine="int2"` (suffix `-int2refine`) refined layers rank the pool by their own INT2 copies
of the keys (max over the group of <q, INT2 key>, as a proposal ranks its own budget) instead of
exact mass: at 128K the exact re-score of a 16K pool re-reads 4 MB of bf16 keys a KV head, the
step's largest cost; INT2 reads 48 bytes a key, and every sparse layer keeps INT2 copies.

Under a plan's mass < 1 (`reference.trim_to_mass`) refined layers trim their budget by the
exact attention mass over the pool (so `refine="int2"` refuses it); proposal layers keep the full budget. They have no exact mass:
Hamming similarity is no logit, and a softmax over INT2 scores was measured overconfident (twice
the exact top token's share; its cut kept 0.66 of the exact pool mass where the fixed budget keeps
0.77, and cost prism-g4 1.3-2.5 points of agreement, bench/NOTES.md). The pool itself is always
rho x budget: it is what later layers choose from, not what this one attends to.

`static` is the IndexCache-style ablation (refined layers reuse the proposal's choice as is), and
`for_search()` gives calibration's variant, where every sparse layer computes both paths and a
per-layer flag on the device picks one, so trying a role assignment writes a tensor, not a graph.
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass

import torch

from ..lowering.reference import INT2_CODES_PER_WORD
from ..runtime.caches import Spec
from . import OPS, Method, Selection, fail, register, require_choice, require_int
from .hash import (SignatureOptions, check_signature_options, lsh_notice, query_logits, signature_cache, signature_kind,
                   write_signatures)

SCALE_DTYPE = torch.float16  # INT2 scale/zero storage: 11 mantissa bits keep the round trip tight
LAYER_ROLES = ("dense", "proposal", "refined")
DEFAULT_GROUP = 4


@dataclass(frozen=True)
class PrismOptions(SignatureOptions):
    """group: sparse layers per proposal layer (uniform grouping); a proposal layer keeps a pool of
    round(rho x budget) candidates; int2_group: channels per INT2 scale/zero group; proposal: how
    proposal layers score every key, by INT2 copies of the keys (the paper) or by `hash` signatures
    (4 bytes a key; bits and encoders as for hash); refine: how refined layers rank the pool, by
    exact attention mass over their own keys (the paper) or by their own INT2 keys (`int2`: 48 bytes
    a pool key read instead of 256 at head dim 128, at the cost of INT2 side caches in every sparse
    layer and of the adaptive budget, which needs exact mass); roles (one per layer: proposal /
    refined / dense) overrides the uniform grouping, "uniform" asks for it, and None takes the roles
    calibrated for the model when sparse_fx ships them (`sparse_fx.role_tables`), else the uniform
    grouping."""

    group: int = DEFAULT_GROUP
    rho: float = 4.0
    int2_group: int = 32
    proposal: str = "int2"
    refine: str = "exact"
    roles: tuple[str, ...] | str | None = None

    def pool(self, budget: int) -> int:
        """Candidate pool size of a proposal layer."""
        return max(budget, round(self.rho * budget))


class Prism(Method):
    description = ("proposal layers score every key (INT2 copies, or signatures with proposal='hash') and build a "
                   "candidate pool that refined layers re-score (Prism)")
    name, name_option = "prism", ("g", "group")
    name_forms = ("prism-g<G>[-hash][-int2refine][-uniform] (e.g. prism-g4, prism-g9, prism-g4-hash, "
                  "prism-g4-int2refine, prism-g4-uniform)")
    options = PrismOptions
    shipped_roles = True
    proposals = ("int2", "hash")  # the `proposal` values it takes
    refines = ("exact", "int2")  # the `refine` values it takes
    takes_mass = True  # refined layers: exact mass over the pool (proposal layers keep the full budget)
    rescores = True  # refined layers re-score the pool (False: reuse the proposal's selection)
    search = False  # calibration: both paths everywhere, a device flag per layer picks

    def parse(self, text):
        uniform = text.endswith("-uniform")
        text = text.removesuffix("-uniform")
        int2refine = text.endswith("-int2refine")
        text = text.removesuffix("-int2refine")
        fields = super().parse(text.removesuffix("-hash"))
        if fields is None:
            return None
        return {**fields, **({"proposal": "hash"} if text.endswith("-hash") else {}),
                **({"refine": "int2"} if int2refine else {}), **({"roles": "uniform"} if uniform else {})}

    def plan_name(self, plan):
        o = plan.options
        return (f"{self.name}-g{o.group}" + ("-hash" if o.proposal == "hash" else "")
                + ("-int2refine" if o.refine == "int2" else "")
                + ("-learned" if o.encoders else "") + ("-calibrated" if isinstance(o.roles, tuple) else "")
                + ("-uniform" if o.roles == "uniform" else ""))

    def uses_encoders(self, plan):
        return plan.options.proposal == "hash"

    def cache_to_trace(self, plan):
        return plan.window + plan.options.pool(plan.budget) + 2

    def describe(self, ctx):
        p, o = ctx.plan, ctx.plan.options
        how = "INT2 proposals" if o.proposal != "hash" else f"proposals by {signature_kind(ctx)} {o.bits}-bit signatures"
        return f"{p.name} ({how}" + (", pools ranked by INT2 keys)" if o.refine == "int2" else ")")

    def notices(self, ctx):
        return lsh_notice(ctx, ctx.plan.name) if ctx.plan.options.proposal == "hash" else {}

    def validate(self, plan):
        o = plan.options
        check_signature_options(o)
        require_int("group", o.group, 1, " (sparse layers per proposal layer; 1: every layer proposes, no sharing)")
        require_int("int2_group", o.int2_group, 2, " (channels per INT2 scale)")
        if not isinstance(o.rho, numbers.Real) or isinstance(o.rho, bool) or not o.rho >= 1:
            fail(f"rho (pool size / budget) must be a number >= 1, got {o.rho!r}")
        require_choice("proposal", o.proposal, self.proposals, self.name, " (how proposal layers score every key)")
        require_choice("refine", o.refine, self.refines, self.name, " (how refined layers rank the pool)")
        if o.encoders is not None and o.proposal != "hash":
            fail(f"encoders apply to plans that score with signatures (hash, prism with proposal='hash'), not "
                 f"{self.name!r} with proposal={o.proposal!r}")
        if o.refine == "int2" and plan.mass < 1:
            fail(f"mass={plan.mass} needs refined layers ranking the pool by exact mass; refine='int2' ranks it by "
                 "INT2 scores, which are no attention mass (valid with mass < 1: refine='exact')")
        if o.roles is None or o.roles == "uniform":
            return
        if not isinstance(o.roles, (list, tuple)) or not all(isinstance(r, str) for r in o.roles):
            fail(f"roles must be a list of layer roles (strings) or \"uniform\", got {o.roles!r}")
        object.__setattr__(o, "roles", tuple(o.roles))
        bad = sorted(set(o.roles) - set(LAYER_ROLES))
        if bad:
            fail(f"unknown layer roles {bad}; valid roles: {', '.join(LAYER_ROLES)}")
        if next((r for r in o.roles if r != "dense"), None) == "refined":
            fail("the first sparse layer must be a proposal layer (a refined layer re-scores an earlier proposal's pool)")

    def for_search(self) -> Prism:
        """A variant of its own for one compiled model: it holds that model's role flags."""
        variant = type(self)()
        variant.search = True
        variant.flags = None  # [layers] bool: which search layers propose (True) or refine (False)
        return variant

    def set_roles(self, roles: list[str]) -> None:
        """Search mode: make `roles` (proposal / refined / dense per layer) take effect in place."""
        flags = torch.tensor([r == "proposal" for r in roles])
        if self.flags is None:
            self.flags = flags
        else:
            self.flags.copy_(flags)

    def _role_flags(self, roles: list[str], device: torch.device) -> torch.Tensor:
        if self.flags is None:
            self.flags = torch.tensor([r in ("proposal", "search") for r in roles])
        if self.flags.device != device:  # only before the first compile: graphs hold the tensor
            self.flags = self.flags.to(device)
        return self.flags

    def roles(self, plan, num_layers, dense):
        o = plan.options
        if isinstance(o.roles, tuple):
            if len(o.roles) != num_layers:
                raise ValueError(f"sparse_fx: plan {plan.name!r} has roles for {len(o.roles)} layers "
                                 f"but the model has {num_layers}")
            roles = ["dense" if i in dense else r for i, r in enumerate(o.roles)]
        else:  # groups of `group` consecutive sparse layers, each led by its proposal layer
            sparse = [i for i in range(num_layers) if i not in dense]
            roles = ["dense"] * num_layers
            for n, i in enumerate(sparse):
                roles[i] = "proposal" if n % o.group == 0 else "refined"
        out, seen = [], False  # a refined layer needs an earlier proposal: the first sparse layer proposes
        for r in roles:
            if r == "refined" and not seen:
                r = "proposal"
            seen |= r == "proposal"
            out.append(r)
        return ["dense" if r == "dense" else "search" for r in out] if self.search else out

    def check(self, info, plan):
        D = info.head_dim
        if D is not None and "int2" in (plan.options.proposal, plan.options.refine):
            problem = self._int2_problem(D, plan)
            if problem:
                raise ValueError(f"sparse_fx: {problem}")

    @staticmethod
    def _int2_problem(D: int, plan) -> str | None:
        if D % INT2_CODES_PER_WORD:
            return (f"INT2 keys pack {INT2_CODES_PER_WORD} channels per word; head dim {D} is not a multiple "
                    f"of {INT2_CODES_PER_WORD}")
        if D % plan.options.int2_group:
            valid = [g for g in range(2, D + 1) if D % g == 0]
            return f"int2_group={plan.options.int2_group} does not divide head dim {D}; valid: {valid}"
        return None

    # ---------------------------------------------------------------- side caches: INT2 keys and/or signatures
    @staticmethod
    def _scorers(role, plan) -> set[str]:
        """What a layer of this role scores its keys with: its proposal's kind, INT2 to refine by."""
        o = plan.options
        kinds = {o.proposal} if role in ("proposal", "search") else set()
        return kinds | ({"int2"} if role in ("refined", "search") and o.refine == "int2" else set())

    def side_cache(self, role, kv, plan):
        kinds = self._scorers(role, plan)
        out = signature_cache(plan) if "hash" in kinds else {}
        if "int2" in kinds:
            M = kv.head_dim // plan.options.int2_group
            out |= {"codes": Spec((kv.head_dim // INT2_CODES_PER_WORD,), torch.int32),
                    "params": Spec((2 * M,), SCALE_DTYPE)}
        return out

    def write(self, emit, ctx, layer, kv, side, new_keys, pos):
        if "signatures" in side:
            write_signatures(emit, ctx, layer, kv, side, new_keys, pos)
        if "codes" in side:
            emit.call(OPS.int2_write.default, side["codes"], side["params"], new_keys, pos)

    def break_even(self, plan):
        """Measured for prism-g4 and prism-g4-int2refine (the refined layers' ranking is what
        moves it); signature proposals and `static`, which drops the refined layers' re-score,
        take the same points unmeasured."""
        if plan.options.refine == "int2":
            return {8: 65536, 32: 32768, 128: 16384}
        return {8: 65536, 32: 32768, 128: 32768}

    def site_problem(self, role, kv, plan):
        return self._int2_problem(kv.head_dim, plan) if "int2" in self._scorers(role, plan) else None

    # ---------------------------------------------------------------- decode
    def select(self, emit, ctx, site):
        p = ctx.plan
        earlier = site.carry.get("proposal")  # (layer, pool, proposal's own selection) or None
        if site.role == "proposal":
            pool, idx = self._propose(emit, ctx, site)
            site.carry["proposal"] = (site.layer, pool, idx)
            return Selection(idx, note=f", pool {pool_size(p, site.kv)}" + (", full budget (no exact mass)" if p.mass < 1 else ""),
                             pool=pool)
        if site.role == "refined":
            if earlier is None:
                return Selection(dense_reason="no earlier proposal layer is sparse in this graph")
            layer, pool, idx = earlier
            note = f", from L{layer}" + self.mass_note(p)  # static refuses mass < 1
            return Selection(self._refine(emit, ctx, site, pool, idx), note=note, pool=pool)
        # search: both paths; the layer's flag in a device buffer picks one (see calibrate)
        own_pool, own_idx = self._propose(emit, ctx, site)
        if earlier is None:
            pool, idx = own_pool, own_idx
        else:
            _, carried_pool, carried_idx = earlier
            flag = emit.call(operator.getitem, emit.tensor("role_flags", self._role_flags(ctx.roles, site.kv.device)), site.layer)
            idx = emit.call(torch.where, flag, own_idx, self._refine(emit, ctx, site, carried_pool, carried_idx))
            pool = emit.call(torch.where, flag, own_pool, carried_pool)
            own_idx = emit.call(torch.where, flag, own_idx, carried_idx)
        site.carry["proposal"] = (site.layer, pool, own_idx)
        return Selection(idx, note=f", pool {pool_size(p, site.kv)}" + self.mass_note(p), pool=pool)

    def _propose(self, emit, ctx, site):
        """Scores over the filled cache -> (pool of the best `pool_size`, its best `budget`): INT2
        keys scored against the query, or signatures by Hamming similarity (the scan fused into
        the pool's selection, then the pool's own scores for the layer's budget)."""
        p = ctx.plan
        side, pool = site.side, pool_size(p, site.kv)
        window = (slice(None), slice(None), slice(p.window, None))
        # The pool and the layer's own budget (chosen within the pool) from one selection.
        if p.options.proposal == "hash":
            both = emit.call(OPS.hash_select_nested.default, query_logits(emit, ctx, site), side["signatures"], site.pos,
                             pool, p.budget, p.sink, p.local, site.mask, site.start)
        else:
            scores = emit.call(OPS.int2_scores.default, site.q, side["codes"], side["params"], site.pos)
            both = emit.call(OPS.select_nested.default, scores, site.pos, pool, p.budget, p.sink, p.local, site.mask,
                             site.start)
        ranked, idx = emit.call(operator.getitem, both, 0), emit.call(operator.getitem, both, 1)
        return emit.call(operator.getitem, ranked, window), idx

    def _refine(self, emit, ctx, site, pool, proposal_idx):
        """Re-score the proposal's pool with this layer's exact keys, or its INT2 keys (static:
        reuse its choice)."""
        if not self.rescores:
            return proposal_idx
        p, side = ctx.plan, site.side
        if p.options.refine == "int2":
            scores = emit.call(OPS.int2_scores.default, site.q, side["codes"], side["params"], site.pos, pool)
            return self.topk(emit, ctx, site, scores, p.budget, positions=pool)
        # the mass of the pool ranked as it is computed (mass_select), never written out
        return emit.call(OPS.mass_select.default, site.q, site.k, site.scale, site.mask, pool, site.pos, p.budget,
                         p.sink, p.local, site.start, p.mass)


def pool_size(plan, kv) -> int:
    """A proposal's pool: rho x budget candidates, at most the cache's candidates (all but the sink
    and local window), so that its cost follows the cache, not the plan. A number in the graph: a
    cache shorter than the pool with the window (under 2 x budget + window at rho 2) has its length
    fixed in its graph, a longer one shares the graph of every longer length."""
    pool, candidates = plan.options.pool(plan.budget), kv.max_len - plan.window
    return pool if pool <= candidates else int(candidates)


class Static(Prism):
    name, name_forms = "static", "static-g<G>[-hash] (e.g. static-g4)"
    description = "proposal layers' selections reused unchanged by the next layers (IndexCache-style ablation)"
    rescores = False
    refines = ("exact",)
    takes_mass = False  # its proposal layers keep the full budget and the others reuse their choice
    shipped_roles = False  # the ablation baseline keeps its uniform grouping unless given roles


register(Prism())
register(Static())
