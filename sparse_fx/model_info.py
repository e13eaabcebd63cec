"""What sparse_fx knows of a Hugging Face decoder, read from its config: the one module that does.

`ModelInfo.of(model)` gives the shapes plans and caches need; `fingerprint` names a model for
trained signature encoders (shapes and a sample of the weights, so that encoders trained on one
model are refused by another of the same shape); `use_sdpa` puts the model on SDPA attention,
the call the pass rewrites. Under Hugging Face tensor parallelism (`tp_plan="auto"`) the config
keeps the whole model's head counts; `Shard` says which heads this rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .runtime.caches import KVShape, Shard

SDPA = "sdpa"


def _text_config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("sparse_fx: the model has no `config`; pass a Hugging Face decoder (PreTrainedModel)")
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def shard_of(model: torch.nn.Module) -> Shard:
    """This process's share of a model that Hugging Face sharded for tensor parallelism."""
    size = getattr(model, "_tp_size", None) or 1
    mesh = getattr(model, "_device_mesh", None)
    if size <= 1 or mesh is None:
        return Shard()
    tp = mesh["tp"] if mesh.ndim > 1 else mesh
    return Shard(tp.get_local_rank(), size)


@dataclass(frozen=True)
class ModelInfo:
    """The shape facts of a decoder that plans, caches and encoders need."""

    model_type: str
    num_layers: int
    q_heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    local_layers: tuple[tuple[int, str], ...] = ()  # (layer, kind) of each local-attention layer
    mla: bool = False  # multi-head latent attention: keys and values of different widths
    shard: Shard = Shard()  # the heads this rank holds (head counts above are the whole model's)

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelInfo:
        text = _text_config(model)
        layers = getattr(text, "num_hidden_layers", None)
        if not isinstance(layers, int):
            raise ValueError("sparse_fx: the model config has no num_hidden_layers")
        types = getattr(text, "layer_types", None)
        if types is None and isinstance(getattr(text, "sliding_window", None), int):
            types = ["sliding_attention"] * layers  # e.g. Mistral: one window for every layer
        local = tuple((i, kind) for i, t in enumerate(types or ()) if (kind := local_kind(t)))
        q_heads = getattr(text, "num_attention_heads", None)
        mla = isinstance(getattr(text, "qk_head_dim", None), int)
        # MLA configs' head_dim is the rotary part of a query/key head; the attention reads qk_head_dim
        head_dim = text.qk_head_dim if mla else getattr(text, "head_dim", None)
        if not isinstance(head_dim, int):
            hidden = getattr(text, "hidden_size", None)
            head_dim = hidden // q_heads if isinstance(hidden, int) and isinstance(q_heads, int) and q_heads else None
        kv_heads = getattr(text, "num_key_value_heads", None) or q_heads
        shard = shard_of(model)
        if shard.size > 1 and (not kv_heads or kv_heads % shard.size):
            raise ValueError(f"sparse_fx: tensor parallelism over {shard.size} ranks needs KV heads divisible by it, "
                             f"the model has {kv_heads}")
        return cls(getattr(text, "model_type", type(model).__name__), layers, q_heads, kv_heads, head_dim, local, mla, shard)

    @property
    def local(self) -> dict[int, str]:
        """{layer: why it is local} for the layers whose attention is already local."""
        return dict(self.local_layers)

    def cache_problem(self, kv: KVShape) -> str | None:
        """Why a cache layer of shape `kv` does not store the attention's keys, so that no side cache
        can describe them (None: it does: this rank's KV heads, or all of them, of the attention's
        head dim). Multi-head latent attention caches hold compressed latents instead (DeepSeek-V3:
        one 'head' of kv_lora_rank channels), from which the keys are recomputed every step."""
        heads_ok = self.kv_heads is None or kv.kv_heads in (self.kv_heads, self.kv_heads // self.shard.size)
        if heads_ok and (self.head_dim is None or kv.head_dim == self.head_dim):
            return None
        return (f"the KV cache stores {kv.kv_heads} head(s) of {kv.head_dim} channels a token, not the attention's "
                f"{self.kv_heads} KV heads of {self.head_dim}: it does not hold the keys the attention reads")

    def fingerprint(self, model: torch.nn.Module) -> dict:
        """Shapes and a sample of the weights: what trained encoders must match."""
        return {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "q_heads": self.q_heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "weights": weights_sample(model),
        }


def weights_sample(model: torch.nn.Module, per_param: int = 4) -> list[float]:
    """A few evenly spaced values of every parameter (in name order), to 6 significant digits:
    compared within a tolerance (`runtime.encoders.same_weights`), it tells the trained model from
    another of the same shapes and survives a change of dtype, device or tensor-parallel sharding."""
    out = []
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda np: np[0]):
            p = p.full_tensor() if hasattr(p, "full_tensor") else p  # a tensor-parallel shard: the whole weight, one at a time
            flat = p.detach().reshape(-1)
            n = min(per_param, flat.numel())
            idx = torch.tensor([j * (flat.numel() - 1) // max(n - 1, 1) for j in range(n)], device=flat.device)
            out += [float(f"{v:.6g}") for v in flat[idx].float().tolist()]
    return out


def local_kind(layer_type) -> str | None:
    """Why a layer of this `config.layer_types` entry is dense by design (None: global attention)."""
    t = str(layer_type)
    if "chunked" in t:
        return "chunked local attention (each token attends within its chunk only)"
    if "sliding" in t or "local" in t:
        return "sliding-window layer (already local attention)"
    return None


def attention_implementation(model: torch.nn.Module) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def use_sdpa(model: torch.nn.Module) -> str | None:
    """Put the model on PyTorch's scaled_dot_product_attention, the call the pass rewrites; returns
    the implementation it replaced (None when it was SDPA already). Raises when the model cannot."""
    current = attention_implementation(model)
    if current in (None, SDPA):
        return None
    if not getattr(model, "_supports_sdpa", False):
        raise ValueError(f"sparse_fx: this model uses attn_implementation={current!r} and does not support 'sdpa', "
                         "the attention call sparse_fx rewrites; load a model class that supports "
                         "attn_implementation='sdpa'")
    set_attention(model, SDPA)
    return current


def set_attention(model: torch.nn.Module, implementation: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    else:
        model.config._attn_implementation = implementation
