"""Side caches: what a layer keeps beside its KV cache for the scores (key signatures, INT2 keys).

They are allocated once per (layer, KV-cache shape, device), with static addresses, and reach the
decode graph as inputs whose length is symbolic like the KV cache's (one graph serves every cache
length); they are written only where the KV cache is written. A layer keeps one set, for the cache
length it last ran on: a new length frees the old one (memory stays one set a layer), and a later
step on the old length allocates and refills it. One set serves every KV cache of its shape, so it
records which cache it currently describes (its owner); a decode step on another cache refills it
from that cache's keys first. Shapes are a rank's own under tensor parallelism (`Shard`: which heads
it holds).
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
        """The shape of a KV-cache tensor; a length that is symbolic in the graph stays so (comparing
        it then guards the graph on a range of lengths, never on one)."""
        b, h, n, d = t.shape
        return cls(int(b), int(h), n if isinstance(n, torch.SymInt) else int(n), int(d), t.device)

    @classmethod
    def hinted(cls, t: torch.Tensor) -> KVShape:
        """The shape with the length the graph is being compiled at (for reports; no guard)."""
        kv = cls.of(t)
        return cls(kv.batch, kv.kv_heads, kv.length, kv.head_dim, kv.device)

    @property
    def symbolic(self) -> bool:
        return isinstance(self.max_len, torch.SymInt)

    @property
    def length(self) -> int:
        """The length as a number for messages: a symbolic one's value at this compile (no guard)."""
        n = self.max_len
        return int(n.node.hint) if isinstance(n, torch.SymInt) and n.node.hint is not None else int(n)


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
    allocations: int = 0  # sets allocated so far: a change means other tensors (CompiledState's graph inputs)

    def layer(self, layer: int, kv: KVShape, specs: dict[str, Spec]) -> dict[str, torch.Tensor]:
        """The layer's side-cache tensors for this KV shape, allocated (zeroed) on first use."""
        key = (layer, kv)
        if key not in self.tensors:
            for old in [k for k in self.tensors if k[0] == layer]:
                del self.tensors[old]  # one set a layer (module docstring)
            held = {shape for _, shape in self.tensors}
            self.owners = {shape: ref for shape, ref in self.owners.items() if shape in held}
            self.allocations += 1
            lead = (kv.batch, kv.kv_heads, kv.max_len)
            self.tensors[key] = {name: _static(torch.zeros(*lead, *s.tail, dtype=s.dtype, device=kv.device))
                                 for name, s in specs.items()}
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


def _static(t: torch.Tensor) -> torch.Tensor:
    """A side cache as a decode graph's input: a static address (CUDA graphs read and write it in
    place, as they do the KV cache) and a length that may vary (dim 2)."""
    torch._dynamo.mark_static_address(t)
    torch._dynamo.maybe_mark_dynamic(t, 2)
    return t
