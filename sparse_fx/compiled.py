"""The state one compiled model carries: its plan and method, the role of each layer, the side
caches and encoders, the reports of its decode graphs, and the eager side-cache fill."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .explain import GraphReport
from .graph import EagerEmitter
from .measure import Measurements
from .methods import Context, Method
from .model_info import ModelInfo
from .plan import Plan
from .runtime.caches import KVShape, Shard, SideCaches
from .runtime.encoders import Encoders, LayerEncoders


def static_layers(cache) -> list | None:
    """The layers of a Hugging Face static cache (None for anything else, e.g. a DynamicCache)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(layer, "cumulative_length") and hasattr(layer, "max_cache_len") for layer in layers):
        return None
    return layers


def filled(layer) -> int:
    """Tokens a static cache layer holds (a device-to-host read: prefill and cache switches only)."""
    return int(layer.cumulative_length) if getattr(layer, "is_initialized", False) else 0


@dataclass
class CompiledState:
    """Per-model state shared by every graph our backend compiles for that model."""

    plan: Plan
    info: ModelInfo
    method: Method
    encoders: Encoders
    backend: str = "inductor"
    mode: str | None = None
    strict: bool = False
    measurements: Measurements | None = None
    attention_note: str = ""  # e.g. the attention implementation compile() switched from
    speculation: object = None  # lossless mode's settings (speculate.Speculation), None without it
    side_caches: SideCaches = field(default_factory=SideCaches)
    reports: list[GraphReport] = field(default_factory=list)
    warned: set[str] = field(default_factory=set)
    unfilled: set[int] = field(default_factory=set)  # layers a compiled prefill graph cannot write
    _graph_inputs: tuple | None = field(default=None, repr=False)  # graph_side_caches' last answer

    def __post_init__(self) -> None:
        dense = set(self.plan.dense_layers) | set(self.info.local)
        bad = sorted(i for i in self.plan.dense_layers if i >= self.info.num_layers)
        if bad:
            raise ValueError(f"sparse_fx: dense_layers holds layers {bad} but the model has {self.info.num_layers} "
                             f"layers (valid: 0..{self.info.num_layers - 1})")
        self.roles = self.method.roles(self.plan, self.info.num_layers, dense)
        self.context = Context(self.plan, self.roles, self.layer_encoders, self.encoders.learned)

    # ------------------------------------------------------------------ layers
    def role(self, layer: int) -> str:
        return self.roles[layer] if 0 <= layer < len(self.roles) else "dense"

    def dense_reason(self, layer: int) -> str:
        if not 0 <= layer < len(self.roles):
            return f"layer index {layer} is outside the model's {len(self.roles)} layers"
        if layer in self.info.local:
            return self.info.local[layer]
        if layer in self.plan.dense_layers:
            return "dense_layers option"
        return f"plan {self.plan.name} keeps this layer dense"

    def min_context(self, kv: KVShape) -> tuple[int, str]:
        """The static cache length from which a decode graph on `kv` runs sparse, and where it comes from."""
        p = self.plan
        if p.min_context != "auto":
            return p.min_context, "the plan's min_context"
        table = self.method.break_even(p) if kv.device.type == "cuda" else {}
        if not table:
            return 0, "min_context='auto'"
        rows = kv.batch * kv.kv_heads
        at = max((r for r in table if r <= rows), default=min(table))
        return table[at], (f"min_context='auto': where {p.name} was measured to pay at {at} KV rows "
                           f"(this graph: batch {kv.batch} x {kv.kv_heads} KV heads); min_context=0 forces sparse")

    def short(self, kv: KVShape | None) -> str | None:
        """Why a decode graph on `kv` keeps dense attention in every layer by the plan itself (None: it
        may run sparse): its static cache is shorter than the plan's min_context, or the budget with
        the sink and local window covers the whole cache, so there is no selection to make (and the
        selection's size, its cost, is bounded by the cache). Such a graph keeps no side caches."""
        if kv is None:
            return None
        p = self.plan
        if p.window + p.budget >= kv.max_len:
            return (f"budget {p.budget} + sink {p.sink} + local {p.local} cover the whole static cache of {kv.length} "
                    "tokens: no selection to make")
        need, source = self.min_context(kv)
        if kv.max_len >= need:
            return None
        return f"static cache of {kv.length} tokens is shorter than {need} ({source})"

    def budget_text(self) -> str:
        p = self.plan
        return f"{p.sink}+{p.local}+{p.budget}"

    def layer_encoders(self, layer: int, kv: KVShape, q_heads: int | None = None) -> LayerEncoders:
        """A layer's signature encoders for the heads this rank runs (`kv` and `q_heads` count those;
        the key side does not depend on `q_heads`): its shard of them, or all of them in a layer
        that a tensor-parallel plan runs whole on every rank (e.g. `colwise_gather_output`)."""
        shard, total = self.info.shard, self.info.kv_heads or kv.kv_heads
        if kv.kv_heads == total:
            shard = Shard()
        elif kv.kv_heads * shard.size != total:
            raise ValueError(f"sparse_fx: layer {layer} runs {kv.kv_heads} of the model's {total} KV heads on this rank, "
                             f"neither all nor a 1/{shard.size} share; its signature encoders cannot be split")
        q_heads = q_heads or (self.info.q_heads // shard.size if self.info.q_heads else kv.kv_heads)
        return self.encoders.layer(layer, q_heads, kv.kv_heads, kv.head_dim, kv.device, shard)

    def record(self, report: GraphReport) -> None:
        """Keep a compiled graph's report. A decode graph may read a layer's side cache only if
        every compiled prefill graph writes it (Hugging Face models prefill eagerly, writing all)."""
        if not report.decode:
            needs = {r.layer for r in report.rows if self.role(r.layer) != "dense" and r.side_cache == "-"
                     and not self.short(report.shape)
                     and self.method.side_cache(self.role(r.layer), report.shape, self.plan)}
            self.unfilled |= needs
            reads = {r.layer for rep in self.reports if rep.decode for r in rep.rows if r.action == "sparse"}
            if reads & needs:
                raise RuntimeError(f"sparse_fx: a new prefill graph cannot write the side caches of layers "
                                   f"{sorted(reads & needs)}, which a compiled decode graph reads; run "
                                   "sparse_fx.explain(model) and report this model form")
        self.reports.append(report)

    # ------------------------------------------------------------------ side caches, eagerly
    def fill(self, cache, lo: int | None = None, hi: int | None = None) -> None:
        """Write the side caches of every sparse layer for the positions [lo, hi) of a static cache
        (default: all it holds), exactly as decode steps would have, and take ownership of them.
        A cache whose side caches describe another cache is refilled from position 0."""
        described = list(self._described(cache))
        emit = EagerEmitter()
        with torch.no_grad():
            for i, layer, kv, specs in described:
                start = 0 if lo is None or not self.side_caches.owned_by(kv, cache) else lo
                stop = filled(layer) if hi is None else hi
                if stop > start:
                    side = self.side_caches.layer(i, kv, specs)
                    pos = torch.arange(start, stop, device=kv.device)
                    self.method.write(emit, self.context, i, kv, side, layer.keys[:, :, start:stop], pos)
            for kv in {kv for _, _, kv, _ in described}:
                self.side_caches.own(kv, cache)

    def graph_side_caches(self, cache) -> dict[tuple[int, str], torch.Tensor]:
        """The side caches a decode graph on `cache` reads and writes, by (layer, name): the graph's
        inputs (`api._own_frame`), allocated on first use. Called every decode step, so the dict is
        kept while the cache's key tensors and the side caches' allocation stay the same (building
        it cost ~7 us a layer)."""
        keys = [getattr(layer, "keys", None) for layer in static_layers(cache)]
        memo = self._graph_inputs
        if (memo is not None and memo[0] == self.side_caches.allocations and len(memo[1]) == len(keys)
                and all((ref() if ref is not None else None) is k for ref, k in zip(memo[1], keys))):
            return memo[2]
        inputs = {(i, name): t for i, _, kv, specs in self._described(cache)
                  for name, t in self.side_caches.layer(i, kv, specs).items()}
        refs = tuple(weakref.ref(k) if k is not None else None for k in keys)
        self._graph_inputs = (self.side_caches.allocations, refs, inputs)
        return inputs

    def owns(self, cache) -> bool:
        """Whether the side caches describe `cache` (True when it has none to describe). Checked on
        the first layer with a side cache: `fill` owns those of all its layers at once."""
        first = next(self._described(cache), None)
        return first is None or self.side_caches.owned_by(first[2], cache)

    def _described(self, cache):
        """(layer index, cache layer, its KVShape, side-cache specs) of each initialised layer of a
        static cache that the plan keeps a side cache for."""
        for i, (role, layer) in enumerate(zip(self.roles, static_layers(cache) or ())):
            if role == "dense" or getattr(layer, "is_sliding", False) or not getattr(layer, "is_initialized", False):
                continue
            kv = KVShape.of(layer.keys)
            if self.info.cache_problem(kv) or self.short(kv):
                continue
            specs = self.method.side_cache(role, kv, self.plan)
            if specs:
                yield i, layer, kv, specs
