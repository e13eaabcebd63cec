"""The FX pass: rewrite decode-time SDPA into the plan method's selection + gather-attention.

Runs on the Dynamo graph of a decode step (one query) inside our backend, before Inductor. For
every attention it finds (`match.find_sites`) it decides, generically, whether the layer can run
sparse; the plan's method (`sparse_fx.methods`) then writes the layer's side cache right after
the KV-cache write and emits the ops that choose the positions, and the SDPA node is replaced by
`sparse_decode_attention` over them. Whatever cannot be proven stays dense, with the reason; a
dense layer of plain layout reads the KV heads by SDPA's enable_gqa (Hugging Face's repeat removed).

A Hugging Face model's prefill never comes here (it runs the model's own attention, see
`forward.py`); another model's multi-token graph and lossless mode's verify step do, and keep
their attention dense (KV heads read as stored: `few_query_attention` for a verify step's few
queries, SDPA with enable_gqa for more) while the side caches of their new positions are written
in the graph.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import measure
from .compiled import CompiledState
from .explain import GraphReport, Row
from .graph import GraphEmitter, remove_dead, side_cache_inputs
from .lowering import ops  # noqa: F401  (registers torch.ops.sparse_fx)
from .lowering.reference import first_readable
from .match import Site, find_sites, meta
from .methods import Site as MethodSite
from .runtime.caches import KVShape

OPS = torch.ops.sparse_fx
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FEW_QUERIES = 16  # the most queries a dense attention runs through few_query_attention (a verify step: gamma + 1)


def rewrite(gm: fx.GraphModule, state: CompiledState) -> GraphReport:
    """Rewrite the decode graph `gm` in place for `state.plan`; return what was done to each attention."""
    side = side_cache_inputs(gm.graph)
    sites = find_sites(gm)
    decode = all(s.q_len == 1 for s in sites)  # no attention found: a decode graph that keeps none
    edit = _Edit(gm, state, side)
    rows = [edit.site(site) if decode else edit.prefill_site(site) for site in sites]
    if rows:
        remove_dead(gm.graph, edit.dead)
        gm.graph.lint()
        gm.recompile()
    shapes = [KVShape.hinted(meta(s.k_base)) for s in sites if meta(s.k_base) is not None and meta(s.k_base).dim() == 4]
    shape = max(shapes, key=lambda kv: kv.max_len, default=None)  # the full-attention cache, not a sliding window
    return GraphReport(rows=rows, shape=shape, decode=decode)


class _Edit:
    def __init__(self, gm: fx.GraphModule, state: CompiledState, side: dict[tuple[int, str], fx.Node]):
        self.state, self.plan, self.method = state, state.plan, state.method
        self.side = side  # the side caches given as graph inputs, by (layer, name)
        self.emit = GraphEmitter(gm)
        self.carry: dict = {}  # what a method hands from one layer to the next (a Prism pool)
        self.starts: dict[fx.Node, fx.Node] = {}  # each row's first real position, per mask
        self.dead: list[fx.Node] = []

    def site(self, site: Site) -> Row:
        state = self.state
        role = state.role(site.layer)
        row = Row(layer=site.layer, call_form=site.call_form, role=role)
        if role == "dense":
            return self._dense(site, row.dense(state.dense_reason(site.layer)))
        problem = _problem(site)
        if problem:
            return row.dense(problem)
        kv = KVShape.of(meta(site.k_base))
        problem = state.info.cache_problem(kv)
        if problem:
            return self._dense(site, row.dense(problem))
        short = state.short(kv)
        if short:
            return self._dense(site, row.dense(short, short=True))
        problem = self.method.site_problem(role, kv, self.plan)
        if problem:
            return self._dense(site, row.dense(problem))
        if site.layer in state.unfilled:
            return self._dense(site, row.dense("a compiled prefill graph does not write this layer's side cache"))
        side = self._write_side_cache(site, role, kv, row)
        a = site.args
        self.emit.at(site.node)
        view = MethodSite(layer=site.layer, role=role, q=site.q, k=site.k_base, v=site.v_base, mask=site.mask,
                          scale=a["scale"], pos=site.k_write.pos, start=self._start(site.mask, site.k_base, kv), kv=kv,
                          q_heads=meta(site.q).shape[1], side=side, carry=self.carry)
        chosen = self.method.select(self.emit, state.context, view)
        if chosen.indices is None:
            return self._dense(site, row.dense(chosen.dense_reason))
        row.budget = state.budget_text() + chosen.note
        out = self.emit.call(OPS.sparse_decode_attention.default, site.q, site.k_base, site.v_base, chosen.indices,
                             a["scale"], site.mask)
        if state.measurements is not None:
            self.emit.call(measure.record, state.measurements.key, site.layer, site.q, site.k_base, site.v_base,
                           site.mask, chosen.indices, out, a["scale"], chosen.pool, self.plan.window)
        self._replace(site, out)
        return row.sparse()

    def _dense(self, site: Site, row: Row) -> Row:
        """An attention that stays dense reads the KV heads as stored. With one query, through
        SDPA's enable_gqa, the repeat removed: Hugging Face repeats K and V before a masked SDPA (its
        form with a static cache), a copy of the cache every step that made dense decode 9.3x slower
        at 128K, batch 4 (`bench/results/decode-2026-11-29-128k.json`, "dense" against "dense-gqa").
        With a few (a verify step), through `few_query_attention`, which splits the keys across
        programs as SDPA's kernels do for one query only (`bench/results/verify-attention-*.json`)."""
        if _problem(site) is not None:
            return row
        a = site.args
        if _few_queries(site):
            self.emit.at(site.node)
            self._replace(site, self.emit.call(OPS.few_query_attention.default, site.q, site.k_base, site.v_base,
                                               a["scale"], site.mask))
        elif site.gqa in ("repeat_kv", "repeat_interleave"):
            self.emit.at(site.node)
            self._replace(site, self.emit.call(gqa_attention, site.q, site.k_base, site.v_base, site.mask, a["scale"]))
        return row

    def _replace(self, site: Site, out: fx.Node) -> None:
        # the same value as the attention's: its fake tensor too (AOTAutograd's cache refuses a method
        # call on a node without one, e.g. the transpose after the attention)
        for key in ("example_value", "val"):
            if key in site.node.meta:
                out.meta[key] = site.node.meta[key]
        site.node.replace_all_uses_with(out)
        self.emit.g.erase_node(site.node)
        self.dead += [site.args["key"], site.args["value"]]

    def prefill_site(self, site: Site) -> Row:
        """Several queries (another model's prefill, lossless mode's verify step): attention stays
        dense, reading the KV heads through enable_gqa as a dense decode does, and the side cache of
        the new positions is written in the graph."""
        return self._dense(site, self._prefill_row(site))

    def _prefill_row(self, site: Site) -> Row:
        role = self.state.role(site.layer)
        row = Row(layer=site.layer, call_form=site.call_form, role=role)
        if role == "dense":
            return row.dense(self.state.dense_reason(site.layer))
        k = meta(site.k_base)
        if site.k_write is None or k is None or k.dim() != 4:
            return row.dense("no KV-cache write feeds this attention: its side cache cannot be written")
        kv = KVShape.of(k)
        problem = self.state.info.cache_problem(kv)
        if problem:
            return row.dense(problem)
        short = self.state.short(kv)
        if short:
            return row.dense(short, short=True)
        problem = self.method.site_problem(role, kv, self.plan)
        if problem:
            return row.dense(problem)
        self._write_side_cache(site, role, kv, row)
        return row.dense("prefill (several queries): stays dense, writes the side cache")

    def _write_side_cache(self, site: Site, role: str, kv: KVShape, row: Row) -> dict:
        """Emit the method's side-cache write right after the KV-cache write; its graph tensors."""
        state = self.state
        specs = self.method.side_cache(role, kv, self.plan)
        if not specs:
            return {}
        if all((site.layer, name) in self.side for name in specs):
            side = {name: self.side[(site.layer, name)] for name in specs}
        else:  # a cache the graph itself initialises: its length is static, its side cache a buffer
            tensors = state.side_caches.layer(site.layer, kv, specs)
            side = {name: self.emit.tensor(f"l{site.layer}_{name}", t) for name, t in tensors.items()}
        # the side cache describes the keys as stored, read back after the KV write: the value that
        # fed the write may be recomputed by the compiler, rounding differently
        w = site.k_write
        emit = self.emit.at(w.node.next)
        stored = emit.call(torch.index_select, w.cache, 2, w.pos)
        self.method.write(emit, state.context, site.layer, kv, side, stored, w.pos)
        row.side_cache = f"{'+'.join(specs)} {state.side_caches.nbytes(site.layer) / 2**20:.2f} MiB"
        row.side_cache_bytes = state.side_caches.nbytes(site.layer)
        return side

    def _start(self, mask: fx.Node, k: fx.Node, kv: KVShape) -> fx.Node:
        """Each batch row's first readable position, computed once per mask: a left-padded row's
        sink starts there."""
        if mask not in self.starts:  # emitted before this attention, so every later one sees it
            length = self.emit.call(torch.ops.aten.sym_size.int, k, 2) if kv.symbolic else kv.max_len
            self.starts[mask] = self.emit.call(first_readable, mask, kv.batch, length)
        return self.starts[mask]


def gqa_attention(q, k, v, mask, scale):
    """Dense attention of q [B, Hq, T, D] over the KV heads k, v [B, Hkv, L, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _few_queries(site: Site) -> bool:
    """Whether a dense attention runs as few_query_attention: 2 to FEW_QUERIES queries, and on CUDA
    shapes its kernel takes (elsewhere the op is its reference, which the CPU tests exercise)."""
    q, k, v, mask = meta(site.q), meta(site.k_base), meta(site.v_base), meta(site.mask)
    if not 1 < q.shape[2] <= FEW_QUERIES:
        return False
    if q.device.type != "cuda":
        return True
    from .lowering.kernels import few_query_attention_supported

    return few_query_attention_supported(q, k, v, None, mask)


def _problem(site: Site) -> str | None:
    """Why this attention cannot run sparse, whatever the method (None: it can)."""
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
    if site.keys_from_cache:
        return ("the keys are recomputed from the KV cache every step, not stored in it (multi-head latent "
                "attention caches compressed latents): there are no stored keys to select among")
    if site.k_write is None or site.v_write is None:
        return "no KV-cache write (index_copy_ or indexed assignment) feeds this attention; use a StaticCache"
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
        and mask.shape[2] == q.shape[2]
        and mask.shape[3] == L
        and (mask.dtype == torch.bool or mask.is_floating_point())
    ):
        return f"unsupported mask form {mask.dtype} {tuple(mask.shape)} (need bool or float [B|1, 1|Hq, queries, L])"
    if q.device.type == "cuda" and q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype} has no Triton kernel (fp16, bf16, fp32)"
    return None
