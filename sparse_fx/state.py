"""What one compiled model carries: plan, layer roles, runtime caches and the rewrite reports."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .measure import Measurements
from .plan import Plan
from .runtime.state import Encoders, SideCaches

def side_cache_kind(method: str, role: str) -> str | None:
    """What a layer of this role keeps beside its KV cache: key signatures (hash), INT2 keys (a
    layer that proposes, or may, in calibration's search), or nothing."""
    if method == "hash" and role == "sparse":
        return "signature"
    if method in ("prism", "static") and role in ("proposal", "search"):
        return "int2"
    return None


@dataclass(frozen=True)
class ModelInfo:
    """The shape facts of a decoder that plans need, read from its config."""

    model_type: str
    num_layers: int
    q_heads: int | None = None
    head_dim: int | None = None
    sliding_layers: frozenset[int] = frozenset()

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelInfo:
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError("sparse_fx: the model has no `config`; pass a Hugging Face decoder (PreTrainedModel)")
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        layers = getattr(text, "num_hidden_layers", None)
        if not isinstance(layers, int):
            raise ValueError("sparse_fx: the model config has no num_hidden_layers")
        types = getattr(text, "layer_types", None)
        if types is None and isinstance(getattr(text, "sliding_window", None), int):
            types = ["sliding_attention"] * layers  # e.g. Mistral: one window for every layer
        sliding = frozenset(i for i, t in enumerate(types or ()) if "sliding" in str(t) or "local" in str(t))
        head_dim = getattr(text, "head_dim", None)
        if not isinstance(head_dim, int):
            hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
            head_dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
        q_heads = getattr(text, "num_attention_heads", None)
        return cls(getattr(text, "model_type", type(model).__name__), layers, q_heads, head_dim, sliding)

    def check_plan(self, plan: Plan) -> None:
        """Reject options the model's shapes cannot take, naming the valid choices."""
        D = self.head_dim
        if plan.method in ("prism", "static") and D is not None:
            if D % 16:
                raise ValueError(f"sparse_fx: INT2 keys pack 16 channels per word; head dim {D} is not a multiple of 16")
            if D % plan.int2_group:
                valid = [g for g in range(2, D + 1) if D % g == 0]
                raise ValueError(f"sparse_fx: int2_group={plan.int2_group} does not divide head dim {D}; valid: {valid}")


@dataclass
class Row:
    """One SDPA node of one compiled graph, as `explain` shows it."""

    layer: int
    call_form: str
    role: str
    graph: str
    action: str = "dense"
    reason: str = ""
    budget: str = "-"
    side_cache: str = "-"
    side_cache_bytes: int = 0

    def dense(self, reason: str) -> Row:
        self.action, self.reason = "dense", reason
        return self

    def sparse(self) -> Row:
        self.action, self.reason = "sparse", ""
        return self


@dataclass
class GraphReport:
    kind: str  # "decode" or "prefill"
    rows: list[Row]


@dataclass
class SparseState:
    """Per-model state shared by every graph our backend compiles for that model."""

    plan: Plan
    info: ModelInfo
    encoders: Encoders
    backend: str = "inductor"
    mode: str | None = None
    strict: bool = False
    measurements: Measurements | None = None
    search: bool = False  # calibration: every sparse layer can propose, per a flag (see set_roles)
    side_caches: SideCaches = field(default_factory=SideCaches)
    reports: list[GraphReport] = field(default_factory=list)
    _unfilled: set[int] = field(default_factory=set)
    _decode_needs: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        dense = set(self.plan.dense_layers) | set(self.info.sliding_layers)
        self.roles = dataclasses.replace(self.plan, dense_layers=tuple(sorted(dense))).layer_roles(self.info.num_layers)
        if self.search:
            self.roles = ["dense" if r == "dense" else "search" for r in self.roles]
        self._flags: torch.Tensor | None = None

    def role_flags(self, device: torch.device) -> torch.Tensor:
        """[layers] bool on `device`: which search layers propose (True) or refine (False)."""
        if self._flags is None:
            self._flags = torch.tensor([r in ("proposal", "search") for r in self.roles])
        if self._flags.device != device:  # only before the first compile: graphs hold the tensor
            self._flags = self._flags.to(device)
        return self._flags

    def set_roles(self, roles: list[str]) -> None:
        """Search mode: make `roles` (proposal / refined / dense per layer) take effect in place."""
        flags = torch.tensor([r == "proposal" for r in roles])
        if self._flags is None:
            self._flags = flags
        else:
            self._flags.copy_(flags)

    def role(self, layer: int) -> str:
        return self.roles[layer] if 0 <= layer < len(self.roles) else "dense"

    def dense_reason(self, layer: int) -> str:
        if not 0 <= layer < len(self.roles):
            return f"layer index {layer} is outside the model's {len(self.roles)} layers"
        if self.plan.method == "dense":
            return "plan is dense"
        if layer in self.info.sliding_layers:
            return "sliding-window layer (already local attention)"
        if layer in self.plan.dense_layers:
            return "dense_layers option"
        return "plan role: dense"

    def budget_text(self) -> str:
        p = self.plan
        return f"{p.sink}+{p.local}+{p.budget}"

    # ------------------------------------------------------------ prefill / decode agreement
    def unfilled_layers(self) -> set[int]:
        """Layers some compiled prefill graph cannot fill the side cache of."""
        return self._unfilled

    def check_side_cache_coverage(self, report: GraphReport) -> None:
        """A decode graph may read a side cache only if every prefill graph fills it."""
        def needs(r: Row) -> bool:
            return side_cache_kind(self.plan.method, r.role) is not None

        if report.kind == "prefill":
            self._unfilled |= {r.layer for r in report.rows if needs(r) and r.side_cache == "-"}
            broken = sorted(self._decode_needs & self._unfilled)
            if broken:
                raise RuntimeError(
                    f"sparse_fx: a new prefill graph cannot fill the side caches of layers {broken}, which an already "
                    "compiled decode graph reads; run sparse_fx.explain(model) and report this model form"
                )
        else:
            self._decode_needs |= {r.layer for r in report.rows if needs(r) and r.action == "sparse"}
        self.reports.append(report)
        if self.strict and report.kind == "decode":
            missed = [r for r in report.rows if r.action == "dense" and r.role != "dense"]
            if missed:
                lines = "; ".join(f"layer {r.layer}: {r.reason}" for r in missed)
                raise RuntimeError(f"sparse_fx (strict): {len(missed)} attention(s) not rewritten: {lines}")

    def reset(self) -> None:
        """Forget side-cache contents (zeroed in place, addresses kept)."""
        self.side_caches.reset()
