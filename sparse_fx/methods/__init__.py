"""Sparse-attention methods, one module each, behind one small interface and a name table.

A plan names its method (`Plan.method`); `get(name)` returns the handler, as a torchao config maps
to its handler. A method says which layers do what (`roles`), rejects models and plans it cannot
serve (`check`, `site_problem`), declares and writes the side cache a layer keeps (`side_cache`,
`write`: the same code serves the compiled decode graph and the eager prefill), and emits the
graph ops that choose a decode step's cache positions (`select`). The rewrite around it is
generic: it finds attention, decides, splices, and never tests a method's name.

A method owns its options: `Method.options` is a frozen dataclass whose fields are plan options
by name (`Plan.parse("prism-g4", rho=2)` sets `plan.options.rho`), validated by `Method.validate`.
Its hooks see a `Context` (the plan, the layers' roles, the signature encoders), not the compiled
model's whole state. A new method is one module: subclass `Method` (and `Options`), then
`register(MyMethod())`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..lowering import ops  # noqa: F401  (registers torch.ops.sparse_fx)

if TYPE_CHECKING:
    from ..model_info import ModelInfo
    from ..plan import Plan
    from ..runtime.caches import KVShape, Spec
    from ..runtime.encoders import LayerEncoders

OPS = torch.ops.sparse_fx
# `Method.break_even` tables: the kernel step of one sparse layer against cuDNN (the fastest dense
# at every shape), Hq 32 / Hkv 8 / D 128 bf16, budget 4096 + 128 + 128, rho 4, on an H200, from
# bench/results/kernels-2026-12-04-1836.json (`python bench/kernel_step.py --repeat 2 --short
# --contexts 8192 ... 131072 --batches 1 4 16`; tests/pass/test_min_context.py derives the tables
# from it). A step must be this much faster to count: kernel tables of different days differ by up to
# 10-20% (docs/results.md), so a thinner edge may not hold.
PAYS = 1.1


def fail(msg: str) -> None:
    raise ValueError(f"sparse_fx: {msg}")


def require_int(name: str, value, low: int | None = None, why: str = "") -> None:
    """Raise unless `value` is an int (not a bool) of at least `low`, naming the option."""
    bound = f" >= {low}" if low is not None else ""
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        fail(f"{name} must be an int{bound}{why}, got {value!r}" + ("" if isinstance(value, int) else f" ({type(value).__name__})"))


def require_choice(name: str, value, valid: tuple[str, ...], method: str, why: str = "") -> None:
    if not isinstance(value, str) or value not in valid:
        fail(f"{name}={value!r} is not one {method!r} takes; valid: {', '.join(valid)}{why}")


@dataclass(frozen=True)
class Options:
    """A method's own plan options (none here): each method's options dataclass derives from it."""


@dataclass
class Context:
    """What a method's hooks see of one compiled model."""

    plan: Plan
    roles: list[str]  # each layer's role
    layer_encoders: Callable[..., LayerEncoders]  # (layer, kv, q_heads=None): a layer's signature encoders, this rank's heads
    learned: bool  # whether those encoders are trained (else random projections)


@dataclass
class Site:
    """One attention of a decode graph, as a method sees it: graph values (FX nodes) and facts."""

    layer: int
    role: str
    q: Any  # [B, Hq, 1, D]
    k: Any  # [B, Hkv, L, D], the KV cache itself (no repeat)
    v: Any
    mask: Any  # SDPA's attn_mask [B|1, 1|Hq, 1, L] or None
    scale: Any  # SDPA's scale or None
    pos: Any  # [T] cache positions written this step; pos[-1] is the query's
    start: Any  # [B] each row's first real position (left padding), or None
    kv: KVShape
    q_heads: int
    side: dict[str, Any]  # this layer's side caches
    carry: dict = field(default_factory=dict)  # what earlier layers of the graph left (e.g. a Prism pool)


@dataclass
class Selection:
    """What `Method.select` decided: the positions to attend to, or why the layer stays dense."""

    indices: Any = None  # [B, Hkv, sink + local + budget] int32
    note: str = ""  # added to explain's budget column
    dense_reason: str = ""
    pool: Any = None  # candidates a later layer re-scores (measurements report its recall)


class Method:
    """The interface a sparse-attention method implements (defaults: no side cache, every layer
    of role 'sparse')."""

    name = ""
    description = ""
    options = Options  # this method's options dataclass: its fields are plan options by name
    shipped_roles = False  # whether its default roles come from a shipped calibrated table when one matches (role_tables)
    rewrites = True  # whether any layer can run sparse (the dense plan: none)
    takes_mass = False  # whether its selections can estimate attention mass (plans with mass < 1)

    # ---------------------------------------------------------------- plans
    name_option: tuple[str, str] | None = None  # ("g", "group"): "prism-g4" sets group=4
    name_forms = ""  # how the plan names read, for error messages (default: the bare name)

    def parse(self, text: str) -> dict | None:
        """Plan fields named by `text` (e.g. "prism-g4" -> {"group": 4}), or None if not this method's."""
        if self.name_option is None:
            return {} if text == self.name else None
        letter, option = self.name_option
        m = re.fullmatch(rf"{self.name}(?:-{letter}(\d+))?", text)
        if not m:
            return None
        return {option: int(m.group(1))} if m.group(1) else {}

    def plan_name(self, plan: Plan) -> str:
        return self.name

    def uses_encoders(self, plan: Plan) -> bool:
        """Whether `plan` scores with signature encoders (then it may name trained ones)."""
        return False

    def validate(self, plan: Plan) -> None:
        """Reject option values this method cannot take (ValueError naming the option and the valid choices)."""

    def roles(self, plan: Plan, num_layers: int, dense: set[int]) -> list[str]:
        return ["dense" if i in dense else "sparse" for i in range(num_layers)]

    def check(self, info: ModelInfo, plan: Plan) -> None:
        """Reject a model whose shapes this method cannot serve."""

    def for_search(self) -> Method:
        """Calibration's variant, in which every sparse layer can propose (see `sparse_fx.calibrate`)."""
        raise ValueError(f"sparse_fx: plan method {self.name!r} has no proposal layers to calibrate")

    def describe(self, ctx: Context) -> str:
        """The method as explain() shows it."""
        return ctx.plan.name

    def cache_to_trace(self, plan: Plan) -> int:
        """A static cache length on which every sparse layer of this plan selects (explain() traces one)."""
        return plan.window + plan.budget + 1

    def notices(self, ctx: Context) -> dict[str, str]:
        """Warnings for the user, once per model, by key (e.g. untrained encoders)."""
        return {}

    # ---------------------------------------------------------------- side caches
    def side_cache(self, role: str, kv: KVShape, plan: Plan) -> dict[str, Spec]:
        """The side-cache tensors a layer of this role keeps ({}: none)."""
        return {}

    def write(self, emit, ctx: Context, layer: int, kv: KVShape, side: dict, new_keys, pos) -> None:
        """Write the side cache for the keys `new_keys` [B, Hkv, T, D] just stored at `pos` [T]."""

    # ---------------------------------------------------------------- where it pays
    def break_even(self, plan: Plan) -> dict[int, int]:
        """Where this plan's decode step pays, for min_context="auto" on CUDA: {KV rows (batch x KV
        heads): the shortest static cache from which it was measured at least `PAYS` times as fast
        as the fastest dense attention} ({}: no rule, every length runs sparse). A graph with rows
        between two measured counts takes the smaller count's length, and below the fewest, the
        fewest's (no extrapolation)."""
        return {}

    # ---------------------------------------------------------------- decode
    def site_problem(self, role: str, kv: KVShape, plan: Plan) -> str | None:
        """Why this layer cannot run sparse here (None: it can)."""
        return None

    def select(self, emit, ctx: Context, site: Site) -> Selection:
        raise NotImplementedError

    # ---------------------------------------------------------------- shared steps
    def topk(self, emit, ctx: Context, site: Site, scores, k: int, positions=None, mass: bool = False):
        """The plan's selection over `scores`: sink + local window + the best `k` candidates; when
        the scores are attention masses (`mass`) and the plan's mass is < 1, only the fewest of
        those holding that share of the candidates' mass (`reference.trim_to_mass`)."""
        p = ctx.plan
        share = p.mass if mass else 1.0
        return emit.call(OPS.select_topk.default, scores, site.pos, k, p.sink, p.local, site.mask, positions, site.start, share)

    @staticmethod
    def mass_note(plan: Plan) -> str:
        """explain's budget-column note for a selection under the plan's mass ("" at mass 1)."""
        return f", mass {plan.mass!r}" if plan.mass < 1 else ""


class Dense(Method):
    name = "dense"
    description = "no rewrite: every layer keeps dense SDPA"
    rewrites = False

    def roles(self, plan, num_layers, dense):
        return ["dense"] * num_layers


_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Make `method` a plan method (by `method.name`); returns it."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", method.name or ""):
        raise ValueError(f"sparse_fx: a method needs a lowercase name, got {method.name!r}")
    _REGISTRY[method.name] = method
    return method


def get(name: str) -> Method:
    if name not in _REGISTRY:
        raise ValueError(f"sparse_fx: unknown method {name!r}; valid plans: {plan_forms()}")
    return _REGISTRY[name]


def parse(text: str) -> tuple[str, dict] | None:
    """(method name, plan fields) for a plan name, or None."""
    for method in _REGISTRY.values():
        fields = method.parse(text)
        if fields is not None:
            return method.name, fields
    return None


def registered() -> list[Method]:
    return list(_REGISTRY.values())


def plan_forms() -> str:
    return ", ".join(m.name_forms or m.name for m in _REGISTRY.values())


def break_even_points(speedups: dict[int, dict[int, float]]) -> dict[int, int | None]:
    """A `Method.break_even` table from measurements: {KV rows: {static cache length: speed-up
    against dense}} -> {KV rows: the shortest length from which every measured longer one is at
    least `PAYS` times as fast} (None: no measured length is)."""
    out = {}
    for rows, speed in sorted(speedups.items()):
        paying = [n for n in sorted(speed) if all(speed[m] >= PAYS for m in speed if m >= n)]
        out[rows] = paying[0] if paying else None
    return out


def mass_methods() -> str:
    """The methods whose plans take mass < 1."""
    return ", ".join(m.name for m in _REGISTRY.values() if m.takes_mass)


register(Dense())

from . import oracle, hash, prism  # noqa: E402,F401,I001  (each registers itself, in this order)
