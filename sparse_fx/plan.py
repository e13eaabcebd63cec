"""Plans: which sparse attention each layer runs, as a validated dataclass with a name table.

`Plan.parse("prism-g4", budget=512)` is the one way from a user's string to a plan; the names a
plan may take come from the method registry (`sparse_fx.methods`). A calibrated plan carries its
layer roles explicitly and round-trips through JSON (`Plan.save` / `Plan.load`).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = "sparse_fx.plan/1"
DEFAULT_GROUP = 4
INT32_MAX = 2**31 - 1
MASS_NAME = re.compile(r"(.+)-mass([0-9.e+-]+)")  # "prism-g4-mass0.95": any plan name, with mass < 1
MASS_FORM = "any of them + -mass<p> (0 < p <= 1, e.g. prism-g4-mass0.95)"


def _fail(msg: str) -> None:
    raise ValueError(f"sparse_fx: {msg}")


def _methods():
    from . import methods  # the registry imports plan types lazily too: no cycle at import time

    return methods


def _int(name: str, value, low: int | None = None, why: str = "") -> None:
    bound = f" >= {low}" if low is not None else ""
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        _fail(f"{name} must be an int{bound}{why}, got {value!r}" + ("" if isinstance(value, int) else f" ({type(value).__name__})"))


@dataclass(frozen=True)
class Plan:
    """A sparse-attention plan.

    budget is κ, the tokens chosen by score on top of `sink` first and `local` last tokens; a
    Prism proposal layer keeps a pool of round(rho * budget) candidates; `bits` is the signature
    width of `hash` (LSH until trained encoders are given); `int2_group` is the channels per INT2
    scale/zero group; `proposal` is how Prism's proposal layers score every key: INT2 copies of
    the keys (the paper) or `hash` signatures (4 bytes a key, then the refined layers re-score the
    pool exactly as with INT2); `refine` is how Prism's refined layers rank the pool: by exact
    attention mass over their own keys (the paper), or by their own INT2 copies of the keys
    (`int2`, name suffix -int2refine: 48 bytes a pool key read instead of 256 at head dim 128, at
    the cost of INT2 side caches in every sparse layer and of the adaptive budget, which needs
    exact mass); `roles` (one per layer: proposal / refined / dense) overrides the uniform
    grouping, "uniform" asks for it, and None (the default) takes the roles calibrated for the model
    when sparse_fx ships them (`sparse_fx.role_tables`), else the uniform grouping; `dense_layers`
    stay dense under any method; `encoders` is the directory of trained
    signature encoders for signature scores (see `sparse_fx.train_signatures`), so a plan file can carry them.

    `min_context` keeps dense attention in a decode graph whose static cache is shorter (its
    length and batch are fixed when the graph is compiled, so the choice costs nothing at run
    time): "auto" (the default) takes, on CUDA, the cache length from which the plan's method was
    measured to beat dense attention at the graph's batch (`Method.break_even`), and 0 elsewhere;
    an int sets the length for every batch (0: always sparse, as the quality harness and
    calibration run, since they study the sparse path at any length).

    `mass` < 1 makes the budget adaptive: per layer, KV head and step, of the `budget` best
    candidates only the fewest whose attention mass reaches that share of all candidates' mass
    are kept (1: always `budget`). Shapes stay static: unused slots hold -1, at the end. See
    `sparse_fx.lowering.reference.trim_to_mass`; methods without exact mass (hash, static) refuse it.
    """

    method: str = "dense"
    group: int = DEFAULT_GROUP
    budget: int = 1024
    sink: int = 128
    local: int = 128
    rho: float = 4.0
    int2_group: int = 32
    proposal: str = "int2"
    refine: str = "exact"
    bits: int = 32
    seed: int = 0
    mass: float = 1.0
    min_context: int | str = "auto"
    dense_layers: tuple[int, ...] = ()
    roles: tuple[str, ...] | str | None = None
    encoders: str | None = None
    note: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("method", "proposal", "refine", "note"):
            if not isinstance(getattr(self, name), str):
                _fail(f"{name} must be a string, got {getattr(self, name)!r}")
        handler = _methods().get(self.method)
        _int("budget", self.budget, 1, " (tokens chosen by score)")
        _int("sink", self.sink, 0)
        _int("local", self.local, 1, " (the window holds the current token)")
        _int("group", self.group)
        _int("int2_group", self.int2_group, 2, " (channels per INT2 scale)")
        _int("bits", self.bits, 32)
        _int("seed", self.seed)
        if self.bits % 32:
            _fail(f"bits must be a positive multiple of 32, got {self.bits}")
        if not isinstance(self.rho, numbers.Real) or isinstance(self.rho, bool) or not self.rho >= 1:
            _fail(f"rho (pool size / budget) must be a number >= 1, got {self.rho!r}")
        if not isinstance(self.mass, numbers.Real) or isinstance(self.mass, bool) or not 0 < self.mass <= 1:
            _fail(f"mass (share of the candidates' attention mass to keep) must be a number in (0, 1], got {self.mass!r}")
        object.__setattr__(self, "mass", float(self.mass))
        if self.mass < 1 and not handler.takes_mass:
            _fail(f"mass={self.mass} needs a method that estimates attention mass; {self.method!r} does not "
                  f"(valid with mass < 1: {_methods().mass_methods()})")
        if self.min_context != "auto":
            _int("min_context", self.min_context, 0,
                 ' (the static cache length below which decode stays dense) or "auto"')
        if not isinstance(self.dense_layers, (list, tuple, set, frozenset, range)):
            _fail(f"dense_layers must be a list of layer indices, got {self.dense_layers!r}")
        for i in self.dense_layers:
            _int("dense_layers entries", i, 0, " (layer indices; negative ones are not taken)")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        if self.roles is not None and self.roles != "uniform":
            if (isinstance(self.roles, (str, bytes)) or not isinstance(self.roles, (list, tuple))
                    or not all(isinstance(r, str) for r in self.roles)):
                _fail(f"roles must be a list of layer roles (strings) or \"uniform\", got {self.roles!r}")
            object.__setattr__(self, "roles", tuple(self.roles))
        if self.encoders is not None and not isinstance(self.encoders, (str, Path)):
            _fail(f"encoders must be a directory path, got {self.encoders!r}")
        if self.proposal not in handler.proposals:
            _fail(f"proposal={self.proposal!r} is not one {self.method!r} takes; valid: {', '.join(handler.proposals)} "
                  "(how proposal layers score every key: prism takes int2 or hash)")
        if self.refine not in handler.refines:
            _fail(f"refine={self.refine!r} is not one {self.method!r} takes; valid: {', '.join(handler.refines)} "
                  "(how refined layers rank the pool: prism takes exact or int2)")
        if self.encoders is not None and not handler.uses_encoders(self):
            which = f"{self.method!r}" + (f" with proposal={self.proposal!r}" if len(handler.proposals) > 1 else "")
            _fail(f"encoders apply to plans that score with signatures (hash, prism with proposal='hash'), not {which}")
        if self.roles is not None and not handler.explicit_roles:
            _fail(f"explicit roles need a plan with proposal and refined layers, not {self.method!r}")
        if self.window + self.budget > INT32_MAX:  # (a pool is capped by the cache, see methods.prism.pool_size)
            _fail(f"budget {self.budget} + sink {self.sink} + local {self.local} exceed the int32 cache positions the "
                  f"kernels index by (at most {INT32_MAX} in all)")
        handler.validate(self)

    # ------------------------------------------------------------------ names
    @classmethod
    def parse(cls, plan: str | Plan | Path, **options) -> Plan:
        """A plan from its name ("prism-g4"), a Plan, or a JSON file, with options applied."""
        if isinstance(plan, Plan):
            return dataclasses.replace(plan, **_checked_options(options)) if options else plan
        if isinstance(plan, Path) or (isinstance(plan, str) and plan.endswith(".json")):
            return cls.load(plan, **options)
        if not isinstance(plan, str):
            _fail(f"plan must be a name, a Plan or a .json path, got {type(plan).__name__}; "
                  f"valid plans: {_methods().plan_forms()}")
        text = plan.strip().lower()
        mass = MASS_NAME.fullmatch(text)
        found = _methods().parse(mass.group(1) if mass else text)
        if found is None:
            _fail(f"unknown plan {plan!r}; valid plans: {_methods().plan_forms()}; {MASS_FORM}")
        method, fields = found
        if mass:
            try:
                fields["mass"] = float(mass.group(2))
            except ValueError:
                _fail(f"plan {plan!r}: -mass{mass.group(2)} is not a number; {MASS_FORM}")
        return cls(**{"method": method, **fields, **_checked_options(options)})

    @property
    def name(self) -> str:
        """The plan's name, which `parse` reads back ("-mass<p>" only when mass < 1)."""
        name = _methods().get(self.method).plan_name(self)
        return f"{name}-mass{self.mass!r}" if self.mass < 1 else name

    @property
    def description(self) -> str:
        return _methods().get(self.method).description

    @property
    def dense(self) -> bool:
        """Whether the plan leaves every layer dense (it rewrites nothing)."""
        return not _methods().get(self.method).rewrites

    @property
    def pool(self) -> int:
        """Candidate pool size of a Prism proposal layer."""
        return max(self.budget, round(self.rho * self.budget))

    @property
    def window(self) -> int:
        """Slots always kept: the sink plus the local window."""
        return self.sink + self.local

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        d["roles"] = list(self.roles) if isinstance(self.roles, tuple) else self.roles
        d["encoders"] = str(self.encoders) if self.encoders is not None else None
        return {"format": FORMAT, "name": self.name, **d}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, **options) -> Plan:
        path = Path(path)
        if path.is_dir():
            _fail(f"plan file {str(path)!r} is a directory; give the plan's .json file (Plan.save writes one)")
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            _fail(f"plan file {str(path)!r} does not exist")
        except (OSError, UnicodeDecodeError) as e:
            _fail(f"plan file {str(path)!r} cannot be read: {e}")
        except json.JSONDecodeError as e:
            _fail(f"plan file {str(path)!r} is not valid JSON: {e}")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            _fail(f"{str(path)!r} is not a sparse_fx plan file (expected \"format\": \"{FORMAT}\")")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields - {"format", "name"})
        if unknown:
            _fail(f"plan file {str(path)!r} has unknown keys {unknown}; valid keys: {', '.join(sorted(fields))}")
        kwargs = {k: v for k, v in data.items() if k in fields}
        if kwargs.get("dense_layers") is None:
            kwargs.pop("dense_layers", None)
        try:
            return cls(**{**kwargs, **_checked_options(options)})
        except ValueError as e:
            raise ValueError(f"{e} (in plan file {str(path)!r})") from None


PLAN_OPTIONS = tuple(f.name for f in dataclasses.fields(Plan) if f.name not in ("method", "note"))


def _checked_options(options: dict) -> dict:
    unknown = sorted(set(options) - set(PLAN_OPTIONS))
    if unknown:
        _fail(f"unknown plan option(s) {unknown}; valid options: {', '.join(PLAN_OPTIONS)}")
    return options
