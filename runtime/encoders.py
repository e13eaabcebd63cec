"""Signature encoders: per-head MLPs that map keys and queries to HashAttention bit signatures.

One representation serves both kinds: a `HeadMLP` is a stack of per-head linear layers with SiLU
between them. Random-projection LSH is the one-layer, bias-free case whose query heads reuse their
KV head's projection (so q and k land in the same random hyperplane code); learned encoders
(trained by `sparse_fx.train_signatures`) have independent query and key networks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HeadMLP:
    """Per-head MLP: weights[i] [H, in, out], biases[i] [H, out] or None; SiLU between layers."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]

    @property
    def heads(self) -> int:
        return self.weights[0].shape[0]

    @property
    def out_features(self) -> int:
        return self.weights[-1].shape[-1]

    def params(self) -> list[torch.Tensor | None]:
        """Flat [w0, b0, w1, b1, ...], the argument order of `apply_head_mlp`."""
        return [t for wb in zip(self.weights, self.biases) for t in wb]

    def to(self, device: torch.device | str) -> HeadMLP:
        return HeadMLP(
            [w.to(device) for w in self.weights],
            [None if b is None else b.to(device) for b in self.biases],
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return apply_head_mlp(x, *self.params())


def apply_head_mlp(x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
    """x [B,H,T,in] -> [B,H,T,out] float32 through the per-head layers (w0, b0, w1, b1, ...)."""
    h = x.float()
    n = len(params) // 2
    for i in range(n):
        w, b = params[2 * i], params[2 * i + 1]
        h = torch.matmul(h, w[None])
        if b is not None:
            h = h + b[None, :, None, :]
        if i < n - 1:
            h = torch.nn.functional.silu(h)
    return h


@dataclass
class LayerEncoders:
    """One layer's encoders: `query` over the Hq query heads, `key` over the Hkv KV heads."""

    query: HeadMLP
    key: HeadMLP


def lsh_layer(q_heads: int, kv_heads: int, head_dim: int, bits: int, seed: int) -> LayerEncoders:
    """Random signed projections (SimHash): a query head uses its KV head's hyperplanes."""
    g = torch.Generator().manual_seed(seed)
    planes = torch.randn(kv_heads, head_dim, bits, generator=g)
    per_query = planes.repeat_interleave(q_heads // kv_heads, dim=0)
    return LayerEncoders(query=HeadMLP([per_query], [None]), key=HeadMLP([planes], [None]))
