"""A toy decoder whose attention can be written in every SDPA call form the pass must handle."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

FORMS = ("repeat_kv", "enable_gqa", "aten", "repeat_interleave", "unsqueeze", "setitem")
MASKS = ("bool", "float_inf", "float_min", "none", "causal", "flat", "bias")


class ToyAttention(nn.Module):
    def __init__(self, hq: int, hkv: int, d: int, form: str, mask_form: str, dropout: float, scale):
        super().__init__()
        self.hq, self.hkv, self.d, self.form, self.mask_form, self.scale = hq, hkv, d, form, mask_form, scale
        self.dropout_on = dropout > 0  # a bool, so Dynamo specialises it (HF passes a literal 0.0 in eval)
        self.q = nn.Linear(hq * d, hq * d, bias=False)
        self.k = nn.Linear(hq * d, hkv * d, bias=False)
        self.v = nn.Linear(hq * d, hkv * d, bias=False)

    def forward(self, x, k_cache, v_cache, pos):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.hq, self.d).transpose(1, 2)
        k = self.k(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        v = self.v(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        if self.form == "setitem":
            k_cache[:, :, pos] = k
            v_cache[:, :, pos] = v
        else:
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
        L, G = k_cache.shape[2], self.hq // self.hkv
        mask = self._mask(pos, L, x.dtype)
        causal = self.mask_form == "causal"
        dropout = 0.1 if self.dropout_on else 0.0
        if self.form == "enable_gqa":
            return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=causal, scale=self.scale, enable_gqa=True)
        if self.form == "repeat_interleave":
            kk, vv = k_cache.repeat_interleave(G, dim=1), v_cache.repeat_interleave(G, dim=1)
        elif self.form == "unsqueeze":
            kk = k_cache.unsqueeze(2).expand(B, self.hkv, G, L, self.d).reshape(B, self.hq, L, self.d)
            vv = v_cache.unsqueeze(2).expand(B, self.hkv, G, L, self.d).reshape(B, self.hq, L, self.d)
        else:  # Hugging Face's repeat_kv
            kk = k_cache[:, :, None, :, :].expand(B, self.hkv, G, L, self.d).reshape(B, self.hq, L, self.d)
            vv = v_cache[:, :, None, :, :].expand(B, self.hkv, G, L, self.d).reshape(B, self.hq, L, self.d)
        if self.form == "aten":
            return torch.ops.aten.scaled_dot_product_attention(q, kk, vv, mask, dropout, causal, scale=self.scale)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.scale)

    def _mask(self, pos, L, dtype):
        if self.mask_form in ("none", "causal"):
            return None
        seen = torch.arange(L, device=pos.device)[None, None, None, :] <= pos[None, None, :, None]  # [1,1,T,L]
        if self.mask_form == "bool":
            return seen
        if self.mask_form == "flat":  # a 2-D mask: SDPA broadcasts it, the sparse path does not take it
            return seen[0, 0]
        neg = float("-inf") if self.mask_form == "float_inf" else torch.finfo(dtype).min
        out = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, neg)
        if self.mask_form == "bias":  # ALiBi-style additive bias on top of the causal mask
            out = out - 0.05 * (pos[None, None, :, None] - torch.arange(L)[None, None, None, :]).abs().to(dtype)
        return out


class ToyDecoder(nn.Module):
    """x [B, T, hidden], pos [T] -> [B, T, hidden]; owns a static KV cache per layer."""

    def __init__(self, layers=3, hq=4, hkv=2, d=16, batch=1, max_len=64, form="repeat_kv", mask="bool",
                 dropout=0.0, scale=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(num_hidden_layers=layers, model_type=f"toy-{form}-{mask}", head_dim=d)
        self.layers = nn.ModuleList(ToyAttention(hq, hkv, d, form, mask, dropout, scale) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(hq * d, hq * d) for _ in range(layers))
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.zeros(batch, hkv, max_len, d))
            self.register_buffer(f"v{i}", torch.zeros(batch, hkv, max_len, d))
        self.eval()

    def forward(self, x, pos):
        for i, (attn, proj) in enumerate(zip(self.layers, self.proj)):
            a = attn(x, getattr(self, f"k{i}"), getattr(self, f"v{i}"), pos)
            x = x + proj(a.transpose(1, 2).reshape(x.shape))
        return x

    def reset(self):
        for b in self.buffers():
            b.zero_()
