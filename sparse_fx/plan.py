"""Plans: which sparse attention each layer runs, as a validated dataclass with a name table.

`Plan.parse(name, budget=512)` is the one way from a user's string to a plan; the names a
plan may take come from the method registry (`sparse_fx.methods`). A plan holds what every method
shares; its method's own options are a dataclass of that method's (`plan.options`), given by name
like the shared ones. A plan round-trips through JSON (`Plan.save` / `Plan.load`), its options
flattened beside the shared fields.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import methods
from .methods import fail, require_int

FORMAT = "sparse_fx.plan/1"
INT32_MAX = 2**31 - 1
MASS_NAME = re.compile(r"(.+)-mass([0-9.e+-]+)")  # "<name>-mass0.95": any plan name, with mass < 1
MASS_FORM = "any of them + -mass<p> (0 < p <= 1, e.g. <name>-mass0.95)"


@dataclass(frozen=True)
class Plan:
    """A sparse-attention plan.

    budget is κ, the tokens chosen by score on top of `sink` first and `local` last tokens;
    `dense_layers` stay dense under any method; `seed` seeds what a method draws at random (e.g.
    untrained signature projections); `options` are the method's own (`methods.get(method).options`:
    None takes its defaults, a dict sets fields by name).

    `min_context` keeps dense attention in a decode graph whose static cache is shorter (its
    length and batch are fixed when the graph is compiled, so the choice costs nothing at run
    time): "auto" (the default) takes, on CUDA, the cache length from which the plan's method was
    measured to beat dense attention at the graph's batch (`Method.break_even`), and 0 elsewhere;
    an int sets the length for every batch (0: always sparse, as the quality harness and
    calibration run, since they study the sparse path at any length).

    `mass` < 1 makes the budget adaptive: per layer, KV head and step, of the `budget` best
    candidates only the fewest whose attention mass reaches that share of all candidates' mass
    are kept (1: always `budget`). Shapes stay static: unused slots hold -1, at the end. See
    `sparse_fx.lowering.reference.trim_to_mass`; methods without exact mass refuse it.
    """

    method: str = "dense"
    budget: int = 1024
    sink: int = 128
    local: int = 128
    seed: int = 0
    mass: float = 1.0
    min_context: int | str = "auto"
    dense_layers: tuple[int, ...] = ()
    options: Any = None
    note: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("method", "note"):
            if not isinstance(getattr(self, name), str):
                fail(f"{name} must be a string, got {getattr(self, name)!r}")
        handler = methods.get(self.method)
        require_int("budget", self.budget, 1, " (tokens chosen by score)")
        require_int("sink", self.sink, 0)
        require_int("local", self.local, 1, " (the window holds the current token)")
        require_int("seed", self.seed)
        if self.window + self.budget > INT32_MAX:
            fail(f"budget {self.budget} + sink {self.sink} + local {self.local} exceed the int32 cache positions the "
                 f"kernels index by (at most {INT32_MAX} in all)")
        if not isinstance(self.mass, numbers.Real) or isinstance(self.mass, bool) or not 0 < self.mass <= 1:
            fail(f"mass (share of the candidates' attention mass to keep) must be a number in (0, 1], got {self.mass!r}")
        object.__setattr__(self, "mass", float(self.mass))
        if self.mass < 1 and not handler.takes_mass:
            fail(f"mass={self.mass} needs a method that estimates attention mass; {self.method!r} does not "
                 f"(valid with mass < 1: {methods.mass_methods()})")
        if self.min_context != "auto":
            require_int("min_context", self.min_context, 0,
                        ' (the static cache length below which decode stays dense) or "auto"')
        if not isinstance(self.dense_layers, (list, tuple, set, frozenset, range)):
            fail(f"dense_layers must be a list of layer indices, got {self.dense_layers!r}")
        for i in self.dense_layers:
            require_int("dense_layers entries", i, 0, " (layer indices; negative ones are not taken)")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))
        object.__setattr__(self, "options", _options_of(handler, self.options))
        handler.validate(self)

    # ------------------------------------------------------------------ names
    @classmethod
    def parse(cls, plan: str | Plan | Path, **options) -> Plan:
        """A plan from its name (`methods.plan_forms()`), a Plan, or a JSON file, with options applied."""
        if isinstance(plan, Plan):
            return plan.replace(**options) if options else plan
        if isinstance(plan, Path) or (isinstance(plan, str) and plan.endswith(".json")):
            return cls.load(plan, **options)
        if not isinstance(plan, str):
            fail(f"plan must be a name, a Plan or a .json path, got {type(plan).__name__}; "
                 f"valid plans: {methods.plan_forms()}")
        text = plan.strip().lower()
        mass = MASS_NAME.fullmatch(text)
        found = methods.parse(mass.group(1) if mass else text)
        if found is None:
            fail(f"unknown plan {plan!r}; valid plans: {methods.plan_forms()}; {MASS_FORM}")
        method, named = found
        shared = {}
        if mass:
            try:
                shared["mass"] = float(mass.group(2))
            except ValueError:
                fail(f"plan {plan!r}: -mass{mass.group(2)} is not a number; {MASS_FORM}")
        return cls(method=method, **shared, options=named).replace(**options)

    def replace(self, **options) -> Plan:
        """This plan with options changed by name, shared ones and the method's alike."""
        handler = methods.get(self.method)
        shared, own = _split(handler, options)
        return dataclasses.replace(self, **shared, options=dataclasses.replace(self.options, **own))

    @property
    def name(self) -> str:
        """The plan's name, which `parse` reads back ("-mass<p>" only when mass < 1)."""
        name = methods.get(self.method).plan_name(self)
        return f"{name}-mass{self.mass!r}" if self.mass < 1 else name

    @property
    def description(self) -> str:
        return methods.get(self.method).description

    @property
    def dense(self) -> bool:
        """Whether the plan leaves every layer dense (it rewrites nothing)."""
        return not methods.get(self.method).rewrites

    @property
    def window(self) -> int:
        """Slots always kept: the sink plus the local window."""
        return self.sink + self.local

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}
        d["dense_layers"] = list(self.dense_layers)
        for f in dataclasses.fields(self.options):
            value = getattr(self.options, f.name)
            d[f.name] = list(value) if isinstance(value, tuple) else str(value) if isinstance(value, Path) else value
        return {"format": FORMAT, "name": self.name, **d}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, **options) -> Plan:
        path = Path(path)
        if path.is_dir():
            fail(f"plan file {str(path)!r} is a directory; give the plan's .json file (Plan.save writes one)")
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            fail(f"plan file {str(path)!r} does not exist")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"plan file {str(path)!r} cannot be read: {e}")
        except json.JSONDecodeError as e:
            fail(f"plan file {str(path)!r} is not valid JSON: {e}")
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            fail(f"{str(path)!r} is not a sparse_fx plan file (expected \"format\": \"{FORMAT}\")")
        fields = {k: v for k, v in data.items() if k not in ("format", "name")}
        if fields.get("dense_layers") is None:
            fields.pop("dense_layers", None)
        try:
            method = fields.pop("method", "dense")
            shared = {k: fields.pop(k) for k in ("note",) if k in fields}
            return cls(method=method, **shared).replace(**{**fields, **options})
        except ValueError as e:
            raise ValueError(f"{e} (in plan file {str(path)!r})") from None


SHARED = tuple(f.name for f in dataclasses.fields(Plan) if f.name not in ("method", "options", "note"))


def _split(handler: methods.Method, options: dict) -> tuple[dict, dict]:
    """Options by name -> (the plan's shared fields, the method's own). An option of another method
    at its default value asks for nothing and is dropped (plan files written while every option
    lived on Plan carry them all); at any other value it is an error naming its owner."""
    own_names = [f.name for f in dataclasses.fields(handler.options)]
    defaults = {f.name: f.default for m in methods.registered() for f in dataclasses.fields(m.options)}
    others = {k for k in options if k not in SHARED and k not in own_names}
    unknown = sorted(k for k in others if k not in defaults or options[k] != defaults[k])
    if unknown:
        owners = sorted({m.name for m in methods.registered() for f in dataclasses.fields(m.options) if f.name in unknown})
        why = f" ({', '.join(k for k in unknown if k in defaults)}: an option of {', '.join(owners)})" if owners else ""
        fail(f"unknown plan option(s) {unknown} for {handler.name!r}{why}; valid options: {', '.join(SHARED)}"
             + (f"; {handler.name}'s own: {', '.join(own_names)}" if own_names else ""))
    return ({k: v for k, v in options.items() if k in SHARED},
            {k: v for k, v in options.items() if k not in SHARED and k not in others})


def _options_of(handler: methods.Method, given):
    """The method's options dataclass from None (its defaults), a dict of fields, or itself."""
    if given is None:
        return handler.options()
    if isinstance(given, handler.options):
        return given
    if isinstance(given, dict):
        shared, own = _split(handler, given)
        if shared:
            fail(f"options {sorted(shared)} are fields of the plan itself, not of {handler.name!r}'s options")
        return handler.options(**own)
    fail(f"options must be a {handler.options.__name__} or a dict of {handler.name!r}'s options, got {given!r}")
