"""Probes for quality work: what each sparse layer selected, measured against dense attention.

With `sparse_fx.compile(model, plan, measure=True)` every sparse decode layer also calls `record`
with its query, KV cache, mask, selection and output. The recorder computes, per query head, the
dense attention of that same query in float32 and compares: recall of the true top-k, attention
mass kept, relative output error, and (Prism refined layers) the share of the true top-budget
inside the proposal's pool; it also counts the tokens chosen by score (`kept`: the selection
less the always-kept sink and local window, at most the budget; fewer under a plan's mass < 1).
The graph then runs without Inductor (recording is Python).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from .lowering.reference import valid_positions

_LIVE: dict[int, Measurements] = {}
_KEYS = itertools.count()


@dataclass
class Measurements:
    """Per layer, one value per (decode step, batch row, query head) of each metric."""

    recall_k: int = 32
    values: dict[str, dict[int, list[torch.Tensor]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))

    def __post_init__(self) -> None:
        self.key = next(_KEYS)
        _LIVE[self.key] = self

    def reset(self) -> None:
        self.values.clear()

    @property
    def metrics(self) -> list[str]:
        return sorted(self.values)

    def per_layer(self, metric: str) -> dict[int, torch.Tensor]:
        """layer -> [samples, Hq] float64 (samples = steps x batch)."""
        return {layer: torch.cat(v) for layer, v in sorted(self.values[metric].items())}

    def summary(self) -> dict[str, dict]:
        """metric -> mean, std over layers, std over heads, and each layer's mean and std (over
        steps, batch rows and heads)."""
        out = {}
        for metric in self.metrics:
            layers = self.per_layer(metric)
            per_layer = torch.stack([v.mean() for v in layers.values()])
            per_head = torch.cat([v.mean(0) for v in layers.values()])
            out[metric] = {
                "mean": float(per_layer.mean()),
                "std_over_layers": float(per_layer.std()) if len(per_layer) > 1 else 0.0,
                "std_over_heads": float(per_head.std()) if len(per_head) > 1 else 0.0,
                "min_layer": float(per_layer.min()),
                "per_layer": {layer: float(v.mean()) for layer, v in layers.items()},
                "per_layer_std": {layer: float(v.std()) if v.numel() > 1 else 0.0 for layer, v in layers.items()},
            }
        return out

    def record(self, layer, q, k, v, mask, idx, out, scale, pool, window) -> None:
        B, Hq, _, D = q.shape
        Hkv, L = k.shape[1], k.shape[2]
        G = Hq // Hkv
        scale = D**-0.5 if scale is None else scale
        qf, kf, vf = q.float(), k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1)
        logits = (qf @ kf.transpose(-1, -2))[:, :, 0] * scale  # [B,Hq,L]
        if mask is not None and mask.dtype != torch.bool:
            logits = logits + mask.float()[:, :, 0].expand(B, Hq, L)
        readable = valid_positions(mask, B, Hkv, L, q.device).repeat_interleave(G, 1) if mask is not None else None
        if readable is not None:
            logits = logits.masked_fill(~readable, float("-inf"))
        p = torch.softmax(logits, -1)
        dense = (p[:, :, None, :] @ vf)[:, :, 0]  # [B,Hq,Dv]
        chosen = torch.zeros(B, Hkv, L + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(2, torch.where(idx >= 0, idx.long(), L), True)
        chosen = chosen[..., :L].repeat_interleave(G, 1)  # [B,Hq,L]
        n_ok = (p > 0).sum(-1, keepdim=True)
        self._add("recall", layer, self._recall(p, chosen, self.recall_k, n_ok))
        self._add("mass", layer, (p * chosen).sum(-1))
        err = (out.float()[:, :, 0] - dense).norm(dim=-1) / dense.norm(dim=-1).clamp(min=1e-12)
        self._add("output_error", layer, err)
        self._add("kept", layer, (idx[..., window:] >= 0).sum(-1).repeat_interleave(G, 1))
        if pool is not None:
            in_pool = torch.zeros(B, Hkv, L + 1, dtype=torch.bool, device=q.device)
            in_pool.scatter_(2, torch.where(pool >= 0, pool.long(), L), True)
            in_pool.scatter_(2, torch.where(idx[..., :window] >= 0, idx[..., :window].long(), L), True)
            budget = idx.shape[-1] - window
            self._add("pool_recall", layer, self._recall(p, in_pool[..., :L].repeat_interleave(G, 1), budget, n_ok))

    @staticmethod
    def _recall(p: torch.Tensor, chosen: torch.Tensor, k: int, n_ok: torch.Tensor) -> torch.Tensor:
        k = min(k, p.shape[-1])
        top = torch.topk(p, k, dim=-1).indices
        hit = torch.gather(chosen, -1, top)
        rank_ok = torch.arange(k, device=p.device) < n_ok  # fewer readable keys than k: count those
        return (hit & rank_ok).sum(-1) / rank_ok.sum(-1).clamp(min=1)

    def _add(self, metric: str, layer: int, value: torch.Tensor) -> None:
        self.values[metric][layer].append(value.detach().double().cpu())


def record(key: int, layer: int, q, k, v, mask, idx, out, scale, pool, window: int) -> None:
    """The graph's hook: forwards to the live `Measurements` registered under `key`."""
    _LIVE[key].record(layer, q, k, v, mask, idx, out, scale, pool, window)
