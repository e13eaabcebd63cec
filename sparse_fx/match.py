"""Find every scaled-dot-product attention in a Dynamo FX graph and what feeds it.

For each SDPA node: its arguments under any call form, the KV heads behind HF's repeat_kv (so the
sparse path never materialises the repeat), the KV-cache write that stores the new keys and values
(`index_copy_` as HF's StaticCache does, or an indexed assignment), the layer, and the query length.
Matching only reads the graph; `rewrite.py` decides and edits.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

SDPA_FORMS = {
    torch._C._nn.scaled_dot_product_attention: "F.sdpa",
    torch.ops.aten.scaled_dot_product_attention.default: "aten.sdpa",
    torch.ops.aten.scaled_dot_product_attention: "aten.sdpa",
}
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


@dataclass
class CacheWrite:
    """`cache[:, :, pos] = new` found in the graph (cache [B,H,L,D], pos [T], new [B,H,T,D])."""

    node: fx.Node
    cache: fx.Node
    pos: fx.Node
    new: fx.Node
    form: str


@dataclass
class Site:
    """One SDPA call and the graph around it."""

    node: fx.Node
    order: int
    form: str
    args: dict
    layer: int
    q_len: int | None  # None: symbolic (a prefill graph with dynamic length)
    k_base: fx.Node | None = None  # [B, Hkv, L, D]: the tensor the keys come from, repeat removed
    v_base: fx.Node | None = None
    gqa: str = "mha"
    sliced: bool = False  # attention reads a length slice of the cache, not all of it
    k_write: CacheWrite | None = None
    v_write: CacheWrite | None = None
    keys_from_cache: bool = False  # no write feeds the keys, but they are computed from a written cache

    @property
    def q(self) -> fx.Node:
        return self.args["query"]

    @property
    def mask(self):
        return self.args["attn_mask"]

    @property
    def call_form(self) -> str:
        return f"{self.form}+{self.gqa}"


def meta(node) -> torch.Tensor | None:
    """The fake tensor Dynamo (example_value) or make_fx (val) recorded for a node."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return name.split(".")[0]
    return ""


def find_sites(gm: fx.GraphModule) -> list[Site]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    writes = _cache_writes(gm.graph)
    sites = []
    for node in gm.graph.nodes:
        form = SDPA_FORMS.get(node.target) if node.op == "call_function" else None
        if form is None:
            continue
        args = _bind_sdpa(node)
        q = meta(args["query"])
        q_len = q.shape[2] if q is not None else None
        site = Site(
            node=node,
            order=order[node],
            form=form,
            args=args,
            layer=_layer_index(node, default=len(sites)),
            q_len=q_len if isinstance(q_len, int) else None,
        )
        site.k_base, gqa_k, k_sliced = _kv_heads(args["key"], q)
        site.v_base, gqa_v, v_sliced = _kv_heads(args["value"], q)
        site.sliced = k_sliced or v_sliced
        site.gqa = "enable_gqa" if args["enable_gqa"] and gqa_k == "mha" else gqa_k if gqa_k == gqa_v else "mixed"
        site.k_write = _last_write_before(writes.get(site.k_base), order, node)
        site.v_write = _last_write_before(writes.get(site.v_base), order, node)
        site.keys_from_cache = site.k_write is None and _reads_written_cache(site.k_base, writes)
        sites.append(site)
    return sites


def _bind_sdpa(node: fx.Node) -> dict:
    bound = dict(SDPA_DEFAULTS)
    bound.update(zip(SDPA_PARAMS, node.args))
    bound.update(node.kwargs)
    return bound


def _layer_index(node: fx.Node, default: int) -> int:
    """The first integer in the module path of the attention (`model.layers.7.self_attn` -> 7)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        m = re.search(r"(?:\.|\[)(\d+)(?:\]|\.|$)", str(path))
        if m:
            return int(m.group(1))
    return default


def _kv_heads(node, q: torch.Tensor | None) -> tuple[fx.Node | None, str, bool]:
    """See through HF repeat_kv / repeat_interleave and length slices to the [B, Hkv, L, D] tensor
    behind `node`. Returns (tensor, GQA form, whether a length slice was peeled)."""
    if not isinstance(node, fx.Node):
        return None, "mha", False
    node, sliced = _peel_length_slices(node)
    base, form = _unrepeat(node)
    base, sliced_below = _peel_length_slices(base)
    return base, form, sliced or sliced_below


def _unrepeat(node: fx.Node) -> tuple[fx.Node, str]:
    out = meta(node)
    name = op_name(node)
    if name in ("reshape", "view") and isinstance(node.args[0], fx.Node) and op_name(node.args[0]) == "expand":
        expanded = node.args[0]
        inner = expanded.args[0]
        if isinstance(inner, fx.Node) and _is_unsqueeze_dim2(inner):
            base = inner.args[0]
            b, e = meta(base), meta(expanded)
            if b is not None and e is not None and out is not None and b.dim() == 4 and e.dim() == 5:
                if e.shape[1] == b.shape[1] and out.shape[1] == e.shape[1] * e.shape[2] and out.shape[2:] == b.shape[2:]:
                    return base, "repeat_kv"
    if name == "repeat_interleave" and isinstance(node.args[0], fx.Node):
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        if dim == 1:
            return node.args[0], "repeat_interleave"
    return node, "mha"


def _peel_length_slices(node: fx.Node) -> tuple[fx.Node, bool]:
    """`x[:, :, a:b]` / `x[:, :, a:b, :]` -> x (HF slices the cache to the prompt in causal prefill)."""
    full = slice(None, None, None)
    sliced = False
    while node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], tuple):
        idx = node.args[1]
        if not (len(idx) in (3, 4) and idx[0] == full and idx[1] == full and isinstance(idx[2], slice)
                and idx[2].step is None and all(i == full for i in idx[3:])):
            break
        node, sliced = node.args[0], True
    return node, sliced


def _is_unsqueeze_dim2(node: fx.Node) -> bool:
    name = op_name(node)
    if name == "unsqueeze":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return dim == 2
    if name == "getitem" and node.target is operator.getitem and isinstance(node.args[1], tuple):
        idx = node.args[1]
        full = slice(None, None, None)
        return len(idx) >= 3 and idx[0] == full and idx[1] == full and idx[2] is None and all(
            i == full or i is Ellipsis for i in idx[3:]
        )
    return False


def _cache_writes(graph: fx.Graph) -> dict[fx.Node, list[CacheWrite]]:
    """Every `cache.index_copy_(2, pos, new)` or `cache[:, :, pos] = new`, by cache node."""
    found: dict[fx.Node, list[CacheWrite]] = {}
    for n in graph.nodes:
        w = None
        if op_name(n) == "index_copy_":
            a, kw = n.args, n.kwargs
            cache, dim = a[0], a[1] if len(a) > 1 else kw.get("dim")
            pos, new = a[2] if len(a) > 2 else kw.get("index"), a[3] if len(a) > 3 else kw.get("source")
            if dim in (2, -2) and isinstance(pos, fx.Node) and isinstance(new, fx.Node):
                w = CacheWrite(n, cache, pos, new, "index_copy_")
        elif n.op == "call_function" and n.target is operator.setitem and isinstance(n.args[1], tuple):
            cache, idx, new = n.args
            full = slice(None, None, None)
            if len(idx) == 3 and idx[0] == full and idx[1] == full and isinstance(idx[2], fx.Node) and isinstance(new, fx.Node):
                w = CacheWrite(n, cache, idx[2], new, "setitem")
        if w is not None and isinstance(w.cache, fx.Node):
            found.setdefault(w.cache, []).append(w)
    return found


def _last_write_before(writes: list[CacheWrite] | None, order: dict, node: fx.Node) -> CacheWrite | None:
    before = [w for w in writes or () if order[w.node] < order[node]]
    return before[-1] if before else None


def _reads_written_cache(node, writes: dict) -> bool:
    """Whether `node` is computed from a tensor that a cache write stores into (multi-head latent
    attention recomputes its keys from the compressed latents its cache holds)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        if n in writes:
            return True
        seen.add(n)
        stack += n.all_input_nodes
    return False
