"""Per-model runtime state: side caches, signature encoders and what each compiled graph did.

Side caches are allocated once per (layer, kind, KV-cache shape, device) and handed to every graph
that needs them (prefill and decode graphs share them), so their addresses never change and CUDA
graphs can capture them. They are written only at the positions the KV cache is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..lowering.reference import INT2_CODES_PER_WORD, WORD_BITS
from .encoders import LayerEncoders, lsh_layer

SCALE_DTYPE = torch.float16  # INT2 scale/zero storage: 11 mantissa bits keep the round trip tight


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


@dataclass
class SideCaches:
    """All side caches of one model, keyed by (layer, kind, KV shape)."""

    tensors: dict[tuple, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def signature(self, layer: int, kv: KVShape, bits: int) -> torch.Tensor:
        """[B, Hkv, L, bits/32] int32 key signatures."""
        key = (layer, "signature", kv, bits)
        if key not in self.tensors:
            self.tensors[key] = (
                torch.zeros(kv.batch, kv.kv_heads, kv.max_len, bits // WORD_BITS, dtype=torch.int32, device=kv.device),
            )
        return self.tensors[key][0]

    def int2(self, layer: int, kv: KVShape, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """INT2 keys: codes [B, Hkv, L, D/16] int32, scale and zero [B, Hkv, L, D/group] fp16."""
        key = (layer, "int2", kv, group)
        if key not in self.tensors:
            lead = (kv.batch, kv.kv_heads, kv.max_len)
            self.tensors[key] = (
                torch.zeros(*lead, kv.head_dim // INT2_CODES_PER_WORD, dtype=torch.int32, device=kv.device),
                torch.zeros(*lead, kv.head_dim // group, dtype=SCALE_DTYPE, device=kv.device),
                torch.zeros(*lead, kv.head_dim // group, dtype=SCALE_DTYPE, device=kv.device),
            )
        return self.tensors[key]  # type: ignore[return-value]

    def of_layer(self, layer: int) -> list[torch.Tensor]:
        return [t for key, ts in self.tensors.items() if key[0] == layer for t in ts]

    def nbytes(self, layer: int | None = None) -> int:
        ts = self.of_layer(layer) if layer is not None else [t for ts in self.tensors.values() for t in ts]
        return sum(t.numel() * t.element_size() for t in ts)

    def reset(self) -> None:
        """Zero every side cache in place (addresses unchanged)."""
        for ts in self.tensors.values():
            for t in ts:
                t.zero_()


class Encoders:
    """Signature encoders per layer: the trained ones when given, else seeded LSH."""

    def __init__(self, bits: int, seed: int, trained=None):
        self.bits, self.seed, self.trained = bits, seed, trained
        self._cache: dict[tuple, LayerEncoders] = {}

    @property
    def kind(self) -> str:
        return "learned" if self.trained is not None else "lsh"

    def layer(self, layer: int, q_heads: int, kv_heads: int, head_dim: int, device: torch.device) -> LayerEncoders:
        key = (layer, str(device))
        if key not in self._cache:
            if self.trained is not None:
                enc = self.trained.layer(layer)
            else:
                enc = lsh_layer(q_heads, kv_heads, head_dim, self.bits, seed=self.seed * 100003 + layer)
            self._cache[key] = LayerEncoders(query=enc.query.to(device), key=enc.key.to(device))
        return self._cache[key]
