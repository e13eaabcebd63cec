"""The FX pass: rewrite decode-time SDPA into score -> select -> gather-attention.

Runs on the Dynamo graph inside our backend, before Inductor. For every attention site it
(1) inserts the side-cache write (key signatures or INT2 keys) right after the KV-cache write, in
prefill and decode graphs alike, for the new positions only; (2) in decode graphs (one query)
replaces the SDPA node by the plan's subgraph; (3) wires a Prism proposal layer's candidate pool
into the refined layers after it. Whatever it cannot prove it leaves dense, with the reason.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import measure
from .lowering import ops  # noqa: F401  (registers torch.ops.sparse_fx)
from .match import Site, find_sites, meta, op_name
from .runtime.encoders import apply_head_mlp
from .runtime.state import KVShape
from .state import GraphReport, Row, SparseState, side_cache_kind

OPS = torch.ops.sparse_fx
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rewrite(gm: fx.GraphModule, state: SparseState) -> GraphReport:
    """Rewrite `gm` in place for `state.plan`; return what was done to each attention."""
    sites = find_sites(gm)
    decode = bool(sites) and all(s.q_len == 1 for s in sites)
    ctx = _Edit(gm, state)
    rows = []
    for site in sites:
        rows.append(ctx.site(site, decode))
    if rows:
        ctx.remove_dead_repeats()
        gm.graph.lint()
        gm.recompile()
    report = GraphReport(kind="decode" if decode else "prefill", rows=rows)
    state.check_side_cache_coverage(report)
    return report


class _Edit:
    def __init__(self, gm: fx.GraphModule, state: SparseState):
        self.gm, self.g, self.state, self.plan = gm, gm.graph, state, state.plan
        self.attrs: dict[str, fx.Node] = {}
        self.proposals: dict[int, tuple[fx.Node, fx.Node]] = {}  # layer -> (pool, indices)
        self.last_proposal: int | None = None
        self.dead: list[fx.Node] = []

    # ----------------------------------------------------------------- decisions
    def site(self, site: Site, decode: bool) -> Row:
        row = self._site(site, decode)
        if row.role == "proposal" and row.action != "sparse":
            self.last_proposal = None
        return row

    def _site(self, site: Site, decode: bool) -> Row:
        role = self.state.role(site.layer)
        row = Row(layer=site.layer, call_form=site.call_form, role=role, graph="decode" if decode else "prefill")
        if role == "dense":
            return row.dense(self.state.dense_reason(site.layer))
        problem = self._problem(site, decode)
        if problem:
            return row.dense(problem)
        row.side_cache = self._write_side_cache(site, role, reset=not decode)
        if not decode:
            return row.dense("prefill (several queries): stays dense, fills the side cache")
        if role == "refined" and self.last_proposal is None:
            return row.dense("no earlier proposal layer is sparse in this graph")
        if site.layer in self.state.unfilled_layers():
            return row.dense("a compiled prefill graph does not fill this layer's side cache")
        row.budget = self.state.budget_text()
        out = self._sparse(site, role, row)
        site.node.replace_all_uses_with(out)
        self.g.erase_node(site.node)
        self.dead += [site.args["key"], site.args["value"]]
        row.side_cache_bytes = self.state.side_caches.nbytes(site.layer)
        return row.sparse()

    def _problem(self, site: Site, decode: bool) -> str | None:
        a = site.args
        q, k, v = meta(site.q), meta(site.k_base), meta(site.v_base)
        if isinstance(a["dropout_p"], fx.Node):
            return "dropout_p is a traced value, not a constant 0 (training-style attention is never rewritten)"
        if a["dropout_p"] != 0:
            return f"dropout_p={a['dropout_p']} (training-style attention is never rewritten)"
        if q is None or k is None or v is None or site.gqa == "mixed":
            return "keys and values are not plain [B, H, L, D] tensors behind the same head layout"
        if k.dim() != 4 or q.dim() != 4 or q.shape[1] % k.shape[1] or v.shape[:3] != k.shape[:3] or q.shape[3] != k.shape[3]:
            return f"unsupported head layout q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        if side_cache_kind(self.plan.method, self.state.role(site.layer)) == "int2" and (k.shape[3] % 16 or k.shape[3] % self.plan.int2_group):
            return f"head dim {k.shape[3]} does not split into INT2 groups of {self.plan.int2_group} (and words of 16)"
        if site.k_write is None or site.v_write is None:
            return "no KV-cache write (index_copy_ or indexed assignment) feeds this attention; use a StaticCache"
        if not decode:
            return None
        if site.sliced:
            return "attention reads a slice of the KV cache, not the cache"
        if torch.is_grad_enabled():
            return "autograd is enabled (sparse attention is inference-only: run under torch.no_grad())"
        if a["is_causal"]:
            return "is_causal=True with one query (SDPA aligns the causal mask top-left: it reads key 0 only)"
        mask = meta(site.mask)
        if site.mask is None:
            return "no attention mask: dense attention reads every cache slot, written or not"
        if mask is None:
            return "attention mask is not a tensor"
        B, Hq, L = q.shape[0], q.shape[1], k.shape[2]
        if not (
            mask.dim() == 4
            and mask.shape[0] in (1, B)
            and mask.shape[1] in (1, Hq)
            and mask.shape[2] == 1
            and mask.shape[3] == L
            and (mask.dtype == torch.bool or mask.is_floating_point())
        ):
            return f"unsupported mask form {mask.dtype} {tuple(mask.shape)} (need bool or float [B|1, 1|Hq, 1, L])"
        if q.device.type == "cuda":
            if q.dtype not in KERNEL_DTYPES:
                return f"dtype {q.dtype} has no Triton kernel (fp16, bf16, fp32)"
        return None

    # ----------------------------------------------------------------- side caches
    def _write_side_cache(self, site: Site, role: str, reset: bool) -> str:
        """Insert the side-cache write after the KV write; returns what it stores."""
        kind = side_cache_kind(self.plan.method, role)
        if kind is None:
            return "-"
        w = site.k_write
        kv = KVShape.of(meta(w.cache))
        with self.g.inserting_before(w.node.next):
            if kind == "signature":
                enc = self._encoders(site)
                k_logits = self._call(apply_head_mlp, w.new, *self._params(f"l{site.layer}_kenc", enc.key.params()))
                self._call(OPS.signature_write.default, self._signatures(site.layer, kv), k_logits, w.pos, reset)
            else:
                self._call(OPS.int2_write.default, *self._int2(site.layer, kv), w.new, w.pos, reset)
        return f"{kind} {self.state.side_caches.nbytes(site.layer) / 2**20:.2f} MiB"

    def _signatures(self, layer: int, kv: KVShape) -> fx.Node:
        return self._attr(f"l{layer}_signatures", self.state.side_caches.signature(layer, kv, self.plan.bits))

    def _int2(self, layer: int, kv: KVShape) -> list[fx.Node]:
        names = ("codes", "scale", "zero")
        tensors = self.state.side_caches.int2(layer, kv, self.plan.int2_group)
        return [self._attr(f"l{layer}_int2_{n}", t) for n, t in zip(names, tensors)]

    def _encoders(self, site: Site):
        q, k = meta(site.q), meta(site.k_base)
        return self.state.encoders.layer(site.layer, q.shape[1], k.shape[1], k.shape[3], k.device)

    # ----------------------------------------------------------------- sparse subgraphs
    def _sparse(self, site: Site, role: str, row: Row) -> fx.Node:
        p, a = self.plan, site.args
        pos, mask, q = site.k_write.pos, site.mask, site.q
        kv = KVShape.of(meta(site.k_base))
        with self.g.inserting_before(site.node):
            if p.method == "oracle":
                scores = self._call(OPS.mass_scores.default, q, site.k_base, a["scale"], mask)
                idx = self._select(scores, pos, p.budget, mask)
            elif p.method == "hash":
                enc = self._encoders(site)
                q_logits = self._call(apply_head_mlp, q, *self._params(f"l{site.layer}_qenc", enc.query.params()))
                q_sig = self._call(operator.getitem, self._call(OPS.pack_signs.default, q_logits), (slice(None), slice(None), 0))
                scores = self._call(OPS.hamming_scores.default, q_sig, self._signatures(site.layer, kv))
                idx = self._select(scores, pos, p.budget, mask)
            elif role == "proposal":
                pool, idx = self._propose(site, kv)
                self.proposals[site.layer] = (pool, idx)
                self.last_proposal = site.layer
                row.budget += f", pool {p.pool}"
            elif role == "refined":
                row.budget += f", from L{self.last_proposal}"
                idx = self._refine(site, *self.proposals[self.last_proposal])
            else:  # search: both paths, a per-layer flag in a device buffer picks (calibration)
                own_pool, own_idx = self._propose(site, kv)
                if self.last_proposal is None:
                    pool, idx = own_pool, own_idx
                else:
                    carried_pool, carried_idx = self.proposals[self.last_proposal]
                    flag = self._call(operator.getitem, self._attr("role_flags", self.state.role_flags(kv.device)), site.layer)
                    idx = self._call(torch.where, flag, own_idx, self._refine(site, carried_pool, carried_idx))
                    pool = self._call(torch.where, flag, own_pool, carried_pool)
                    own_idx = self._call(torch.where, flag, own_idx, carried_idx)
                self.proposals[site.layer] = (pool, own_idx)
                self.last_proposal = site.layer
                row.budget += f", pool {p.pool}"
            out = self._call(OPS.sparse_decode_attention.default, q, site.k_base, site.v_base, idx, a["scale"], mask)
            if self.state.measurements is not None:
                pool = self.proposals[self.last_proposal][0] if role in ("proposal", "refined", "search") else None
                self._call(measure.record, self.state.measurements.key, site.layer, q, site.k_base, site.v_base,
                           mask, idx, out, a["scale"], pool, p.window)
            return out

    def _propose(self, site: Site, kv: KVShape) -> tuple[fx.Node, fx.Node]:
        """INT2 scores over the whole cache -> (pool of the best `plan.pool`, its best `budget`)."""
        p, pos, mask = self.plan, site.k_write.pos, site.mask
        scores = self._call(OPS.int2_scores.default, site.q, *self._int2(site.layer, kv))
        ranked = self._select(scores, pos, p.pool, mask)
        pool = self._call(operator.getitem, ranked, (slice(None), slice(None), slice(p.window, None)))
        return pool, self._select(self._call(_scores_at, scores, pool), pos, p.budget, mask, pool)

    def _refine(self, site: Site, pool: fx.Node, proposal_idx: fx.Node) -> fx.Node:
        """Prism: re-score the proposal's pool with this layer's keys; static: reuse its choice."""
        p = self.plan
        if p.method == "static":
            return proposal_idx
        scores = self._call(OPS.mass_scores.default, site.q, site.k_base, site.args["scale"], site.mask, pool)
        return self._select(scores, site.k_write.pos, p.budget, site.mask, pool)

    def _select(self, scores, pos, k: int, mask, positions=None) -> fx.Node:
        p = self.plan
        return self._call(OPS.select_topk.default, scores, pos, k, p.sink, p.local, mask, positions)

    # ----------------------------------------------------------------- graph plumbing
    def _call(self, fn, *args) -> fx.Node:
        return self.g.call_function(fn, tuple(args))

    def _attr(self, name: str, tensor: torch.Tensor) -> fx.Node:
        """A get_attr node for a runtime tensor: registered as a buffer of the graph module with a
        Dynamo source, so AOTAutograd lifts it as a static buffer (CUDA graphs keep working)."""
        name = f"sparse_fx_{name}"
        if name not in self.attrs:
            self.gm.register_buffer(name, tensor)
            if hasattr(self.gm, "_param_name_to_source"):
                from torch._dynamo.source import ConstantSource

                self.gm._param_name_to_source[name] = ConstantSource(name)
            with self.g.inserting_before(next(iter(n for n in self.g.nodes if n.op != "placeholder"))):
                self.attrs[name] = self.g.get_attr(name)
        return self.attrs[name]

    def _params(self, prefix: str, params: list) -> list:
        return [None if t is None else self._attr(f"{prefix}{i}", t) for i, t in enumerate(params)]

    def remove_dead_repeats(self) -> None:
        """Erase the repeat_kv chains the sparse path no longer reads (never materialise them)."""
        removable = ("reshape", "view", "expand", "getitem", "unsqueeze", "repeat_interleave", "contiguous")
        stack = list(self.dead)
        while stack:
            n = stack.pop()
            if isinstance(n, fx.Node) and not n.users and n.op in ("call_method", "call_function") and op_name(n) in removable:
                inputs = list(n.all_input_nodes)
                self.g.erase_node(n)
                stack += inputs


def _scores_at(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """scores [B,Hkv,L] read at positions [B,Hkv,N] (-1 reads slot 0; select_topk ignores it)."""
    return torch.gather(scores, 2, positions.clamp(min=0).long())
