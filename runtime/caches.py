"""Side caches: what a layer keeps beside its KV cache for the scores (key signatures, INT2 keys).

They are allocated once per (layer, KV-cache shape, device), with static addresses that every
compiled decode graph of that shape captures, and written only where the KV cache is written.
One set serves every KV cache of its shape, so it records which cache it currently describes
(its owner); a decode step on another cache refills it from that cache's keys first. Shapes
are a rank's own under tensor parallelism (`Shard`: which heads it holds).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVShape:
    """The KV cache one layer writes: [batch, kv_heads, max_len, head_dim] on `device`."""

    batch: int
    kv_heads: int
    max_len: int
    head_dim: int
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> KVShape:
        b, h, n, d = (int(s) for s in t.shape)
        return cls(b, h, n, d, t.device)


@dataclass(frozen=True)
class Shard:
    """The attention heads one tensor-parallel rank holds: part `rank` of `size` equal, contiguous
    parts of every layer's query and KV heads (Hugging Face shards q/k/v projections by column)."""

    rank: int = 0
    size: int = 1

    def part(self, total: int) -> slice:
        """This rank's heads of `total` (all of them when not sharded)."""
        if total % self.size:
            raise ValueError(f"sparse_fx: {total} heads do not split over {self.size} tensor-parallel ranks")
        n = total // self.size
        return slice(self.rank * n, (self.rank + 1) * n)

    def describe(self, kv_heads: int | None) -> str | None:
        """'rank r of n, KV heads a-b' (None when not sharded)."""
        if self.size == 1:
            return None
        if not kv_heads:
            return f"rank {self.rank} of {self.size}"
        heads = self.part(kv_heads)
        return f"rank {self.rank} of {self.size}, KV heads {heads.start}-{heads.stop - 1}"


@dataclass(frozen=True)
class Spec:
    """One side-cache tensor: [batch, kv_heads, max_len, *tail] of `dtype`."""

    tail: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class SideCaches:
    """All side caches of one compiled model, by layer and KV shape, and their owners."""

    tensors: dict[tuple[int, KVShape], dict[str, torch.Tensor]] = field(default_factory=dict)
    owners: dict[KVShape, weakref.ref] = field(default_factory=dict)

    def layer(self, layer: int, kv: KVShape, specs: dict[str, Spec]) -> dict[str, torch.Tensor]:
        """The layer's side-cache tensors for this KV shape, allocated (zeroed) on first use."""
        key = (layer, kv)
        if key not in self.tensors:
            lead = (kv.batch, kv.kv_heads, kv.max_len)
            self.tensors[key] = {name: torch.zeros(*lead, *s.tail, dtype=s.dtype, device=kv.device) for name, s in specs.items()}
        return self.tensors[key]

    def of_layer(self, layer: int) -> list[torch.Tensor]:
        return [t for (i, _), ts in self.tensors.items() if i == layer for t in ts.values()]

    def of_shape(self, kv: KVShape) -> list[torch.Tensor]:
        return [t for (_, shape), ts in self.tensors.items() if shape == kv for t in ts.values()]

    def nbytes(self, layer: int | None = None) -> int:
        ts = self.of_layer(layer) if layer is not None else [t for ts in self.tensors.values() for t in ts.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    # ------------------------------------------------------------------ ownership
    def owned_by(self, kv: KVShape, cache) -> bool:
        held = self.owners.get(kv)
        return held is not None and held() is cache

    def own(self, kv: KVShape, cache) -> None:
        self.owners[kv] = weakref.ref(cache)

    def disown(self, cache) -> None:
        """Forget that any set describes `cache` (its contents changed in a way not followed here)."""
        self.owners = {kv: ref for kv, ref in self.owners.items() if ref() is not cache}

    def reorder(self, cache, beam_idx: torch.Tensor) -> None:
        """Follow a reordering of `cache`'s batch rows (beam search) in place, addresses kept."""
        for kv, ref in self.owners.items():
            if ref() is cache:
                for side in self.of_shape(kv):
                    side.copy_(side.index_select(0, beam_idx.to(side.device)))
