"""Signature encoders: per-head MLPs that map keys and queries to HashAttention bit signatures.

One representation serves both kinds: a `HeadMLP` is a stack of per-head linear layers with SiLU
between them. Random-projection LSH is the one-layer, bias-free case whose query heads reuse their
KV head's projection (so q and k land in the same random hyperplane code); learned encoders
(trained by `sparse_fx.train_signatures`) have independent query and key networks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .caches import Shard


@dataclass
class HeadMLP:
    """Per-head MLP: weights[i] [H, in, out], biases[i] [H, out] or None; SiLU between layers."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]

    def params(self) -> list[torch.Tensor | None]:
        """Flat [w0, b0, w1, b1, ...], the argument order of `apply_head_mlp`."""
        return [t for wb in zip(self.weights, self.biases) for t in wb]

    def to(self, device: torch.device | str) -> HeadMLP:
        return HeadMLP(
            [w.to(device) for w in self.weights],
            [None if b is None else b.to(device) for b in self.biases],
        )

    def heads(self, part: slice) -> HeadMLP:
        """The MLP of heads `part` only (a tensor-parallel rank's share)."""
        return HeadMLP([w[part] for w in self.weights], [None if b is None else b[part] for b in self.biases])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return apply_head_mlp(x, *self.params())


def apply_head_mlp(x: torch.Tensor, *params: torch.Tensor | None) -> torch.Tensor:
    """x [B,H,T,in] -> [B,H,T,out] float32 through the per-head layers (w0 [H,in,out], b0 [H,out],
    w1, b1, ...). Heads lead while the layers run, so each layer is one [H, B*T, in] x [H, in, out]
    product: torch.matmul's broadcast of w[None] over the batch copies every weight B times
    (a clone launch a layer, 8 MB at batch 16 for LSH query planes, 34 MB for a learned hidden layer)."""
    B, H, T, _ = x.shape
    h = x.float().transpose(0, 1).reshape(H, B * T, x.shape[-1])  # a view where B or T is 1
    n = len(params) // 2
    for i in range(n):
        w, b = params[2 * i], params[2 * i + 1]
        h = torch.bmm(h, w)
        if b is not None:
            h = h + b[:, None, :]
        if i < n - 1:
            h = torch.nn.functional.silu(h)
    return h.reshape(H, B, T, h.shape[-1]).transpose(0, 1)


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


FORMAT = "sparse_fx.signatures/1"


def same_weights(trained, model, rtol: float = 1e-2) -> bool:
    """Whether two weight samples (lists of floats) come from the same weights, allowing for a
    change of dtype (bfloat16 keeps 3 significant digits)."""
    if not isinstance(trained, list) or not isinstance(model, list) or len(trained) != len(model):
        return False
    return all(abs(a - b) <= rtol * max(abs(a), abs(b)) + 1e-6 for a, b in zip(trained, model))


@dataclass
class SignatureEncoders:
    """Trained HashAttention encoders for one model: per layer, query encoders over the query
    heads and key encoders over the KV heads; `fingerprint` names the model they were trained on
    (its shapes and a sample of its weights, `sparse_fx.model_info.ModelInfo.fingerprint`)."""

    layers: list[LayerEncoders]
    bits: int
    fingerprint: dict
    metadata: dict

    def layer(self, i: int) -> LayerEncoders:
        return self.layers[i]

    def check(self, fingerprint: dict) -> None:
        """Raise unless these encoders were trained for a model with this fingerprint."""
        diff = {k: (self.fingerprint.get(k), v) for k, v in fingerprint.items()
                if (not same_weights(self.fingerprint.get(k), v) if k == "weights" else self.fingerprint.get(k) != v)}
        if diff:
            lines = ", ".join("weights: sampled values differ" if k == "weights" else f"{k}: trained {a!r}, model {b!r}"
                              for k, (a, b) in diff.items())
            raise ValueError(f"sparse_fx: these signature encoders were trained for another model ({lines}); "
                             "train encoders for this one with sparse_fx.train_signatures(model, ...)")

    def save(self, path) -> None:
        """`path` (a directory): encoders.safetensors plus encoders.json (fingerprint, metadata)."""
        import json
        from pathlib import Path

        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, enc in enumerate(self.layers):
            for side, mlp in (("q", enc.query), ("k", enc.key)):
                for j, (w, b) in enumerate(zip(mlp.weights, mlp.biases)):
                    tensors[f"{i}.{side}.w{j}"] = w.detach().float().cpu().contiguous()
                    if b is not None:
                        tensors[f"{i}.{side}.b{j}"] = b.detach().float().cpu().contiguous()
        save_file(tensors, str(path / "encoders.safetensors"))
        meta = {"format": FORMAT, "bits": self.bits, "fingerprint": self.fingerprint, "metadata": self.metadata}
        (path / "encoders.json").write_text(json.dumps(meta, indent=2) + "\n")

    @classmethod
    def load(cls, path) -> SignatureEncoders:
        """Encoders saved by `save`; any malformed file is a ValueError naming the file and the field."""
        import json
        from pathlib import Path

        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"sparse_fx: encoders must be a directory holding encoders.json + encoders.safetensors "
                             f"(sparse_fx.train_signatures(...).save(dir)); {str(path)!r} is not a directory")
        files = [path / "encoders.json", path / "encoders.safetensors"]
        if not all(f.is_file() for f in files):
            raise ValueError(f"sparse_fx: {str(path)!r} holds no signature encoders (encoders.json + encoders.safetensors)")
        try:
            meta = json.loads(files[0].read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"sparse_fx: {str(files[0])!r} is not valid JSON: {e}") from None
        fields = ("bits", "fingerprint", "metadata")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or any(f not in meta for f in fields):
            raise ValueError(f"sparse_fx: {str(files[0])!r} is not a {FORMAT} file (needs format, {', '.join(fields)})")
        bits, fingerprint, metadata = (meta[f] for f in fields)
        _expect(files[0], "bits", bits, isinstance(bits, int) and not isinstance(bits, bool) and bits >= 32 and bits % 32 == 0,
                "a positive multiple of 32")
        _expect(files[0], "fingerprint", fingerprint, isinstance(fingerprint, dict), "an object")
        layers = fingerprint.get("num_layers")
        _expect(files[0], "fingerprint.num_layers", layers,
                isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1, "an int >= 1")
        _expect(files[0], "metadata", metadata, isinstance(metadata, dict), "an object")
        _expect(files[0], "metadata.train_config", metadata.get("train_config", {}),
                isinstance(metadata.get("train_config", {}), dict), "an object")
        tensors = _read_safetensors(files[1])
        heads = {"q": fingerprint.get("q_heads"), "k": fingerprint.get("kv_heads")}
        width = fingerprint.get("head_dim")
        out = []
        for i in range(layers):
            sides = [_head_mlp(files[1], tensors, f"{i}.{side}", heads[side], width, bits) for side in ("q", "k")]
            out.append(LayerEncoders(query=sides[0], key=sides[1]))
        return cls(out, bits, fingerprint, metadata)


def _expect(file, field: str, value, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"sparse_fx: {str(file)!r}: {field} must be {what}, got {value!r}")


def _read_safetensors(file) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own error type for truncated, empty or foreign files
        raise ValueError(f"sparse_fx: {str(file)!r} is not a readable safetensors file: {e}") from None


def _head_mlp(file, tensors: dict, prefix: str, heads, width, bits: int) -> HeadMLP:
    """One side's per-head MLP, tensors `{prefix}.w0`, `{prefix}.b0`, ...: [H, in, out] weights that
    chain from the head dim to `bits`, [H, out] biases."""
    n = 0
    while f"{prefix}.w{n}" in tensors:
        n += 1
    if n == 0:
        raise ValueError(f"sparse_fx: {str(file)!r} has no tensor {prefix}.w0 (the fingerprint's num_layers asks for it)")
    weights, biases = [tensors[f"{prefix}.w{j}"] for j in range(n)], [tensors.get(f"{prefix}.b{j}") for j in range(n)]
    H = heads if isinstance(heads, int) else weights[0].shape[0]
    last = width if isinstance(width, int) else None
    for j, (w, b) in enumerate(zip(weights, biases)):
        want_in = "?" if last is None else last
        _expect(file, f"{prefix}.w{j}", tuple(w.shape), w.dim() == 3 and w.is_floating_point() and w.shape[0] == H
                and (last is None or w.shape[1] == last), f"a float tensor [heads {H}, in {want_in}, out]")
        last = w.shape[2]
        if b is not None:
            _expect(file, f"{prefix}.b{j}", tuple(b.shape), b.is_floating_point() and tuple(b.shape) == (H, last),
                    f"a float tensor [{H}, {last}]")
    _expect(file, f"{prefix}.w{n - 1}", tuple(weights[-1].shape), last == bits, f"of {bits} outputs (the file's bits)")
    return HeadMLP(weights, biases)


class Encoders:
    """The signature encoders a compiled model serves, per layer: trained ones when given, else
    seeded random projections (LSH)."""

    def __init__(self, bits: int, seed: int, trained: SignatureEncoders | None = None):
        self.bits, self.seed, self.trained = bits, seed, trained
        self._cache: dict[tuple, LayerEncoders] = {}

    @property
    def learned(self) -> bool:
        return self.trained is not None

    def layer(self, layer: int, q_heads: int, kv_heads: int, head_dim: int, device: torch.device,
              shard: Shard = Shard()) -> LayerEncoders:
        """Layer `layer`'s encoders for the heads a rank holds: `q_heads` and `kv_heads` are its
        counts, `shard` which part of the whole model's heads they are. A rank gets exactly the
        encoders of its heads in the unsharded model, so sharding changes no signature."""
        key = (layer, str(device), q_heads, shard)
        if key not in self._cache:
            q_total, kv_total = q_heads * shard.size, kv_heads * shard.size
            if self.trained is not None:
                enc = self.trained.layer(layer)
            else:
                enc = lsh_layer(q_total, kv_total, head_dim, self.bits, seed=self.seed * 100003 + layer)
            query, keys = enc.query.heads(shard.part(q_total)), enc.key.heads(shard.part(kv_total))
            self._cache[key] = LayerEncoders(query=query.to(device), key=keys.to(device))
        return self._cache[key]
