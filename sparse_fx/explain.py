"""What `sparse_fx.explain(model)` returns: one row per layer of the model's decode graph, with
what became of its attention and why, printable as a table."""

from __future__ import annotations

from dataclasses import dataclass

from .plan import Plan
from .runtime.caches import Shard

COLUMNS = (
    ("layer", "layer"),
    ("call_form", "call form"),
    ("role", "role"),
    ("action", "decode"),
    ("budget", "budget"),
    ("side_cache", "side cache"),
    ("reason", "why dense"),
)


@dataclass
class Row:
    """One attention (one SDPA call) of a decode graph."""

    layer: int
    call_form: str
    role: str
    action: str = "dense"
    reason: str = ""
    budget: str = "-"
    side_cache: str = "-"
    side_cache_bytes: int = 0
    short: bool = False  # dense because the plan asks it there (min_context, a covering budget), not for want of support

    def dense(self, reason: str, short: bool = False) -> Row:
        self.action, self.reason, self.short = "dense", reason, short
        return self

    def sparse(self) -> Row:
        self.action, self.reason = "sparse", ""
        return self


@dataclass
class GraphReport:
    """What the rewrite did to one compiled decode graph (`shape`: its KV-cache shape)."""

    rows: list[Row]
    shape: object = None  # KVShape of the graph's KV cache
    decode: bool = True  # one query per call (else another model's compiled prefill)


@dataclass
class Report:
    plan: Plan
    method: str  # the method as it runs (e.g. learned or random signatures)
    description: str
    model_type: str
    num_layers: int
    rows: list[Row]
    side_cache_bytes: int
    notes: list[str]
    traced: bool = False
    shard: Shard = Shard()  # the tensor-parallel rank and heads it describes

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def sparse_layers(self) -> list[int]:
        return [r.layer for r in self.rows if r.action == "sparse"]

    @property
    def dense_layers(self) -> list[int]:
        return [r.layer for r in self.rows if r.action != "sparse"]

    def __str__(self) -> str:
        cells = [[title for _, title in COLUMNS]]
        for r in self.rows:
            cells.append([str(getattr(r, key)) for key, _ in COLUMNS])
        widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS) - 1)]
        lines = []
        for i, row in enumerate(cells):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 9)
        n_sparse = len(self.sparse_layers)
        head = [
            f"sparse_fx plan {self.method} on {self.model_type} ({self.num_layers} layers): {self.description}",
            f"{self.num_layers} layer(s) in the decode graph: {n_sparse} sparse, {self.num_layers - n_sparse} dense",
        ]
        if self.traced:
            head.append("(traced on a tiny throwaway cache: run a decode step for the real side-cache sizes)")
        else:
            head[-1] += f"; side caches {self.side_cache_bytes / 2**20:.2f} MiB in all"
        head += self.notes
        return "\n".join(head) + "\n" + "\n".join(line.rstrip() for line in lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(str(self))
