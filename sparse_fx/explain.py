"""The report `sparse_fx.explain(model)` returns: one row per SDPA node, printable as a table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .plan import Plan
from .state import GraphReport, ModelInfo, Row

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
class Report:
    plan: Plan
    info: ModelInfo
    decode: GraphReport
    prefill: GraphReport | None
    side_cache_bytes: int
    traced: bool = False

    @property
    def rows(self) -> list[Row]:
        return self.decode.rows

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

    def to_dict(self) -> dict:
        return {
            "plan": self.plan.to_dict(),
            "model_type": self.info.model_type,
            "num_layers": self.info.num_layers,
            "traced": self.traced,
            "side_cache_bytes": self.side_cache_bytes,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "prefill_rows": [dataclasses.asdict(r) for r in self.prefill.rows] if self.prefill else [],
        }

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
        head = (
            f"sparse_fx plan {self.plan.name} on {self.info.model_type} ({self.info.num_layers} layers): "
            f"{self.plan.description}\n"
            f"{len(self.rows)} attention node(s) in the decode graph: {n_sparse} sparse, {len(self.rows) - n_sparse} dense"
        )
        if self.traced:
            head += "\n(traced on a tiny throwaway cache: run a decode step for the real side-cache sizes)"
        else:
            head += f"; side caches {self.side_cache_bytes / 2**20:.2f} MiB in all"
        return head + "\n" + "\n".join(line.rstrip() for line in lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython
        p.text(str(self))
