"""Plans: which sparse attention each layer runs, as a validated dataclass with a name table.

`Plan.parse("prism-g4", budget=512)` is the one way from a user's string to a plan. Layer roles
are derived from the plan and the layer count (`Plan.layer_roles`); a calibrated plan carries them
explicitly and round-trips through JSON.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

METHODS = ("dense", "oracle", "hash", "prism", "static")
GROUPED = ("prism", "static")
ROLES = ("dense", "sparse", "proposal", "refined")
PLAN_NAMES = "dense, oracle, hash, hash-b<bits> (e.g. hash-b128), prism-g<G> (e.g. prism-g4, prism-g9), static-g<G> (e.g. static-g4)"
DEFAULT_GROUP = 4

_DESCRIPTIONS = {
    "dense": "no rewrite: every layer keeps dense SDPA",
    "oracle": "exact attention-mass top-k over the full-precision keys (the quality ceiling)",
    "hash": "32-bit key/query signatures scored by Hamming similarity (HashAttention)",
    "prism": "INT2 proposal layers build a candidate pool that refined layers re-score (Prism)",
    "static": "INT2 proposal layers' selections reused unchanged by the next layers (IndexCache-style ablation)",
}


def _fail(msg: str) -> None:
    raise ValueError(f"sparse_fx: {msg}")


@dataclass(frozen=True)
class Plan:
    """A sparse-attention plan.

    budget is κ, the tokens chosen by score on top of `sink` first and `local` last tokens; a
    Prism proposal layer keeps a pool of round(rho * budget) candidates; `bits` is the signature
    width of `hash` (LSH until trained encoders are given); `int2_group` is the channels per INT2
    scale/zero group; `roles` (one per layer: proposal / refined / dense) overrides the uniform
    grouping; `dense_layers` stay dense under any method; `encoders` is the directory of trained
    signature encoders for `hash` (see `sparse_fx.train_signatures`), so a plan file can carry them.
    """

    method: str = "dense"
    group: int = DEFAULT_GROUP
    budget: int = 1024
    sink: int = 128
    local: int = 128
    rho: float = 4.0
    int2_group: int = 32
    bits: int = 32
    seed: int = 0
    dense_layers: tuple[int, ...] = ()
    roles: tuple[str, ...] | None = None
    encoders: str | None = None
    note: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            _fail(f"unknown method {self.method!r}; valid plans: {PLAN_NAMES}")
        for name in ("budget", "group", "int2_group", "bits"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                _fail(f"{name} must be an int, got {value!r}")
        if self.budget <= 0:
            _fail(f"budget must be > 0 tokens, got {self.budget}")
        if not isinstance(self.sink, int) or self.sink < 0:
            _fail(f"sink must be an int >= 0, got {self.sink!r}")
        if not isinstance(self.local, int) or self.local < 1:
            _fail(f"local must be an int >= 1 (the window holds the current token), got {self.local!r}")
        if not self.rho >= 1:
            _fail(f"rho (pool size / budget) must be >= 1, got {self.rho!r}")
        if self.method in GROUPED and self.group < 1:
            _fail(f"group must be >= 1 layer (1: every layer proposes, no sharing), got {self.group}")
        if self.bits < 32 or self.bits % 32:
            _fail(f"bits must be a positive multiple of 32, got {self.bits}")
        if self.int2_group < 2:
            _fail(f"int2_group must be >= 2 channels, got {self.int2_group}")
        if self.encoders is not None and self.method != "hash":
            _fail(f"encoders apply to the hash plan, not {self.method!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(int(i) for i in self.dense_layers))))
        if self.roles is not None:
            object.__setattr__(self, "roles", tuple(self.roles))
            self._check_roles(self.roles)

    # ------------------------------------------------------------------ names
    @classmethod
    def parse(cls, plan: str | Plan | Path, **options) -> Plan:
        """A plan from its name ("prism-g4"), a Plan, or a JSON file, with options applied."""
        if isinstance(plan, Plan):
            return dataclasses.replace(plan, **_checked_options(options)) if options else plan
        if isinstance(plan, Path) or (isinstance(plan, str) and plan.endswith(".json")):
            return cls.load(plan, **options)
        if not isinstance(plan, str):
            _fail(f"plan must be a name, a Plan or a .json path, got {type(plan).__name__}; valid plans: {PLAN_NAMES}")
        m = re.fullmatch(r"(dense|oracle)|(hash)(?:-b(\d+))?|(prism|static)(?:-g(\d+))?", plan.strip().lower())
        if not m:
            _fail(f"unknown plan {plan!r}; valid plans: {PLAN_NAMES}")
        method = m.group(1) or m.group(2) or m.group(4)
        base = {"method": method}
        if m.group(3):
            base["bits"] = int(m.group(3))
        if m.group(5):
            base["group"] = int(m.group(5))
        return cls(**{**base, **_checked_options(options)})

    @property
    def name(self) -> str:
        if self.method in GROUPED:
            return f"{self.method}-g{self.group}" + ("-calibrated" if self.roles else "")
        if self.method == "hash":
            return "hash" + (f"-b{self.bits}" if self.bits != 32 else "") + ("-learned" if self.encoders else "")
        return self.method

    @property
    def description(self) -> str:
        return _DESCRIPTIONS[self.method]

    @property
    def pool(self) -> int:
        """Candidate pool size of a Prism proposal layer."""
        return max(self.budget, round(self.rho * self.budget))

    @property
    def window(self) -> int:
        """Slots always kept: the sink plus the local window."""
        return self.sink + self.local

    # ------------------------------------------------------------------ roles
    def layer_roles(self, num_layers: int) -> list[str]:
        """One role per layer: dense, sparse (oracle/hash), proposal or refined (prism/static)."""
        if self.roles is not None:
            if len(self.roles) != num_layers:
                _fail(f"plan {self.name!r} has roles for {len(self.roles)} layers but the model has {num_layers}")
            roles = list(self.roles)
        elif self.method == "dense":
            roles = ["dense"] * num_layers
        elif self.method in GROUPED:
            roles = ["proposal" if i % self.group == 0 else "refined" for i in range(num_layers)]
        else:
            roles = ["sparse"] * num_layers
        for i in self.dense_layers:
            if i >= num_layers:
                _fail(f"dense_layers holds layer {i} but the model has {num_layers} layers")
            roles[i] = "dense"
        if self.method in GROUPED:
            roles = _promote_orphans(roles)
        return roles

    def _check_roles(self, roles: tuple[str, ...]) -> None:
        if self.method not in GROUPED:
            _fail(f"explicit roles need a prism or static plan, not {self.method!r}")
        bad = sorted(set(roles) - {"dense", "proposal", "refined"})
        if bad:
            _fail(f"unknown layer roles {bad}; valid roles: dense, proposal, refined")
        first = next((r for r in roles if r != "dense"), None)
        if first == "refined":
            _fail("the first sparse layer must be a proposal layer (a refined layer re-scores an earlier proposal's pool)")

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        d["roles"] = list(self.roles) if self.roles is not None else None
        return {"format": "sparse_fx.plan/1", "name": self.name, **d}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, **options) -> Plan:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            _fail(f"plan file {str(path)!r} does not exist")
        except json.JSONDecodeError as e:
            _fail(f"plan file {str(path)!r} is not valid JSON: {e}")
        if not isinstance(data, dict) or data.get("format") != "sparse_fx.plan/1":
            _fail(f"{str(path)!r} is not a sparse_fx plan file (expected \"format\": \"sparse_fx.plan/1\")")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields - {"format", "name"})
        if unknown:
            _fail(f"plan file {str(path)!r} has unknown keys {unknown}")
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["dense_layers"] = tuple(kwargs.get("dense_layers") or ())
        return cls(**{**kwargs, **_checked_options(options)})


def _promote_orphans(roles: list[str]) -> list[str]:
    """A refined layer needs an earlier proposal layer; the first sparse layer proposes."""
    out, seen_proposal = [], False
    for r in roles:
        if r == "refined" and not seen_proposal:
            r = "proposal"
        seen_proposal |= r == "proposal"
        out.append(r)
    return out


PLAN_OPTIONS = tuple(f.name for f in dataclasses.fields(Plan) if f.name not in ("method", "note"))


def _checked_options(options: dict) -> dict:
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        _fail(f"unknown plan option(s) {unknown}; valid options: {', '.join(PLAN_OPTIONS)}")
    return options
