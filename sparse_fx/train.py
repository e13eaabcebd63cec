"""`train_signatures`: learn HashAttention's key and query encoders on a frozen model.

Per layer, an MLP per query head and one per KV head (d -> 128 -> 128 -> bits, SiLU) map post-RoPE
queries and keys to bit signatures. Training follows the paper: labels are each query's true
top-64 keys, the loss is binary cross-entropy with positive weight alpha + beta * n (n = keys the
query sees), and tanh stands in for sign. A KV head's selection sums the Hamming similarities of
its query heads, so the key encoders are shared by the group ("kv" sharing, what the runtime
serves); `key_sharing="query"` trains one key encoder per query head instead, for comparison.

All layers train at once: (layer, head) pairs are one batch dimension of the per-head MLPs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from .runtime.encoders import HeadMLP, LayerEncoders, SignatureEncoders, apply_head_mlp

CAPTURE = "sparse_fx_capture"


@dataclass(frozen=True)
class TrainConfig:
    bits: int = 32
    hidden: int = 128
    context: int = 4096  # train at the context length you deploy at
    queries: int = 256  # query positions sampled per window
    top: int = 64  # labels: each query's true top-64 keys
    alpha: float = 1.0  # positive weight alpha + beta * n
    beta: float = 1.0 / 64
    epochs: int = 12
    lr: float = 2e-3
    seed: int = 0
    key_sharing: str = "kv"  # "kv": one key encoder per KV head (served); "query": one per query head

    def __post_init__(self) -> None:
        if self.bits < 32 or self.bits % 32:
            raise ValueError(f"sparse_fx: bits must be a positive multiple of 32, got {self.bits}")
        if self.key_sharing not in ("kv", "query"):
            raise ValueError(f"sparse_fx: key_sharing must be 'kv' or 'query', got {self.key_sharing!r}")
        if self.context <= 2 * self.top:
            raise ValueError(f"sparse_fx: context {self.context} is too short for labels of the top {self.top} keys")


@dataclass
class Window:
    """What one text window contributes, per layer: all keys, sampled queries and their labels."""

    keys: torch.Tensor  # [layers, Hkv, T, D] float16
    queries: torch.Tensor  # [layers, Hq, S, D] float32
    ranked: torch.Tensor  # [layers, Hq, S, max(top, 32)] int64: keys by true attention, best first
    positions: torch.Tensor  # [S] int64: the sampled queries' positions


def fingerprint(model) -> dict:
    c = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = c.num_attention_heads
    return {
        "model_type": c.model_type,
        "num_layers": c.num_hidden_layers,
        "q_heads": heads,
        "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
    }


def capture_windows(model, windows: torch.Tensor, config: TrainConfig, progress: bool = True) -> list[Window]:
    """Run the frozen model over token windows [N, T]; keep per-layer keys, sampled queries, labels."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (query.detach(), key.detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE, capture)
    previous = model.config._attn_implementation
    gen = torch.Generator().manual_seed(config.seed)
    out = []
    try:
        model.config._attn_implementation = CAPTURE
        device = next(model.parameters()).device
        for ids in tqdm(windows, desc="capture q/k", disable=not progress):
            captured.clear()
            with torch.no_grad():
                model(ids[None].to(device), use_cache=False)
            out.append(_window(captured, ids.shape[0], config, gen))
    finally:
        model.config._attn_implementation = previous
    return out


def _window(captured, T: int, config: TrainConfig, gen: torch.Generator) -> Window:
    low = max(T // 8, 2 * config.top)
    positions = torch.sort(torch.randint(low, T, (config.queries,), generator=gen)).values
    keys, queries, ranked = [], [], []
    for layer in sorted(captured):
        q, k = captured[layer]  # [1,Hq,T,D], [1,Hkv,T,D]
        q, k = q[0].float().cpu(), k[0].float().cpu()
        G = q.shape[0] // k.shape[0]
        qs = q[:, positions]  # [Hq,S,D]
        logits = qs @ k.repeat_interleave(G, 0).transpose(-1, -2)  # [Hq,S,T]; softmax order = logit order
        logits = logits.masked_fill(torch.arange(T)[None, None, :] > positions[None, :, None], float("-inf"))
        ranked.append(torch.topk(logits, max(config.top, 32), dim=-1).indices)
        keys.append(k.half())
        queries.append(qs)
    return Window(torch.stack(keys), torch.stack(queries), torch.stack(ranked), positions)


def _mlp(heads: int, d_in: int, hidden: int, bits: int, gen: torch.Generator) -> HeadMLP:
    dims = [d_in, hidden, hidden, bits]
    weights = [torch.randn(heads, a, b, generator=gen) * math.sqrt(1.0 / a) for a, b in zip(dims, dims[1:])]
    biases = [torch.zeros(heads, b) for b in dims[1:]]
    return HeadMLP(weights, biases)


def train_on_windows(data: list[Window], config: TrainConfig, progress: bool = True) -> tuple[list[LayerEncoders], list[float]]:
    """Adam on all layers' encoders at once; returns per-layer encoders and the loss per epoch."""
    layers, Hq, S, D = data[0].queries.shape
    Hkv = data[0].keys.shape[1]
    G = Hq // Hkv
    k_heads = Hq if config.key_sharing == "query" else Hkv
    gen = torch.Generator().manual_seed(config.seed)
    q_enc = _mlp(layers * Hq, D, config.hidden, config.bits, gen)
    k_enc = _mlp(layers * k_heads, D, config.hidden, config.bits, gen)
    temp = torch.full((layers * Hq, 1, 1), 4.0 / math.sqrt(config.bits))
    bias = torch.zeros(layers * Hq, 1, 1)
    params = [t.requires_grad_() for t in q_enc.weights + q_enc.biases + k_enc.weights + k_enc.biases + [temp, bias]]
    opt = torch.optim.Adam(params, lr=config.lr)
    history = []
    bar = tqdm(range(config.epochs), desc="train signatures", disable=not progress)
    for _ in bar:
        order = torch.randperm(len(data), generator=gen).tolist()
        total = 0.0
        for i in order:
            opt.zero_grad()
            total += _loss(data[i], q_enc, k_enc, temp, bias, config, G).item()  # backward inside
            opt.step()
        history.append(total / len(data))
        bar.set_postfix(loss=f"{history[-1]:.4f}")
    encoders = []
    for layer in range(layers):
        q = _slice(q_enc, layer * Hq, (layer + 1) * Hq)
        k = _slice(k_enc, layer * k_heads, (layer + 1) * k_heads)
        encoders.append(LayerEncoders(query=q, key=k))
    return encoders, history


def _slice(mlp: HeadMLP, a: int, b: int) -> HeadMLP:
    return HeadMLP([w[a:b].detach().clone() for w in mlp.weights], [x[a:b].detach().clone() for x in mlp.biases])


def _loss(w: Window, q_enc: HeadMLP, k_enc: HeadMLP, temp, bias, config: TrainConfig, G: int, chunk: int = 64) -> torch.Tensor:
    """Weighted BCE over every (sampled query, visible key) pair: a key is positive iff it is in
    the query's true top `config.top`; positives weigh alpha + beta * n (n = keys the query sees).
    Queries go in chunks so the [layers*Hq, chunk, T] similarity stays small; the gradient is
    accumulated here (backward per chunk) and the mean loss returned for logging."""
    layers, Hq, S, D = w.queries.shape
    T, bits = w.keys.shape[2], config.bits
    keys = w.keys.float()
    if config.key_sharing == "query":
        keys = keys.repeat_interleave(G, 1)
    kb = torch.tanh(apply_head_mlp(keys.reshape(1, -1, T, D), *k_enc.params()))[0].reshape(layers, -1, T, bits)
    if config.key_sharing == "kv":
        kb = kb.repeat_interleave(G, 1)
    kb = kb.reshape(layers * Hq, T, bits)
    kb_detached = kb.detach().requires_grad_()
    n_all = (w.positions + 1).float()
    top = torch.clamp(n_all, max=config.top)
    weight_sum = float(((n_all - top) + top * (config.alpha + config.beta * n_all)).sum()) * layers * Hq
    total = torch.zeros(())
    for a in range(0, S, chunk):
        pos = w.positions[a : a + chunk]
        n = (pos + 1).float()[None, :, None]  # [1,c,1]
        qb = torch.tanh(apply_head_mlp(w.queries[:, :, a : a + chunk].reshape(1, layers * Hq, -1, D), *q_enc.params()))[0]
        logits = (qb @ kb_detached.transpose(-1, -2)) * temp + bias  # [LHq,c,T]
        target = torch.zeros(logits.shape)
        target.scatter_(2, w.ranked[:, :, a : a + chunk, : config.top].reshape(layers * Hq, -1, config.top), 1.0)
        visible = (torch.arange(T)[None, None, :] <= pos[None, :, None]).float()
        weight = visible * torch.where(target > 0, config.alpha + config.beta * n, torch.ones(()))
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="none")
        loss = (bce * weight).sum() / weight_sum
        loss.backward()
        total += loss.detach()
    kb.backward(kb_detached.grad)
    return total


def train_signatures(
    model,
    texts=None,
    *,
    tokenizer=None,
    bits: int = 32,
    context: int = 4096,
    windows: int = 16,
    progress: bool = True,
    **options,
) -> SignatureEncoders:
    """Train HashAttention encoders for `model` (frozen, eval mode) and return them.

    texts: token windows [N, context] (a LongTensor), a list of strings (needs `tokenizer`), or
    None for the training split of the real text that ships with Python (`sparse_fx.data`,
    disjoint from the held-out split; needs `tokenizer`). options: fields of `TrainConfig`
    (hidden, queries, top, alpha, beta, epochs, lr, seed, key_sharing, ...). Deterministic under
    `seed`; runs where the model is (CPU or GPU) for the forward passes, trains on the CPU.
    """
    config = TrainConfig(bits=bits, context=context, **options)
    ids, source = _token_windows(texts, tokenizer, config, windows)
    data = capture_windows(model, ids, config, progress)
    encoders, history = train_on_windows(data, config, progress)
    metadata = {"train_config": asdict(config), "loss_per_epoch": history, "data": source}
    return SignatureEncoders(encoders, config.bits, fingerprint(model), metadata)


def _token_windows(texts, tokenizer, config: TrainConfig, windows: int) -> tuple[torch.Tensor, dict]:
    if isinstance(texts, torch.Tensor):
        if texts.dim() != 2:
            raise ValueError(f"sparse_fx: token windows must be [N, T], got {tuple(texts.shape)}")
        return texts.long(), {"source": "token windows given by the caller", "windows": texts.shape[0], "tokens": texts.shape[1]}
    if tokenizer is None:
        raise ValueError("sparse_fx: pass tokenizer= to train on text (or give token windows [N, T])")
    if texts is None:
        from .data import HELDOUT_SHARE, documents, token_windows

        ids = token_windows(tokenizer, "train", config.context, windows, seed=config.seed)
        source = {
            "source": "sparse_fx.data split 'train': pydoc_data.topics prose + standard-library code",
            "split_rule": f"sha256(name) bucket; held-out share {HELDOUT_SHARE}",
            "heldout_documents": len(documents("heldout")),
            "train_documents": len(documents("train")),
            "windows": windows,
            "tokens": config.context,
        }
        return ids, source
    flat: list[int] = []
    for text in texts:
        flat += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
    n = min(windows, len(flat) // config.context)
    if n == 0:
        raise ValueError(f"sparse_fx: the texts hold fewer than {config.context} tokens")
    ids = torch.tensor(flat[: n * config.context]).reshape(n, config.context)
    return ids, {"source": f"{len(texts)} texts given by the caller", "windows": n, "tokens": config.context}


def selection_recall(
    data: list[Window], score_fn, fractions=(1 / 16, 1 / 32), k: int = 32, per_query_head: bool = False
) -> dict[float, float]:
    """Recall@k of selecting the top n*fraction keys by `score_fn`, averaged over queries and heads.

    score_fn(layer, queries [Hq,S,D], keys [Hkv,T,D], positions [S]) -> scores [Hkv or Hq, S, T]
    (higher first; keys after a query's position are ignored);
    a KV head's score selects for all its query heads unless `per_query_head`.
    """
    hits = {f: [] for f in fractions}
    for w in data:
        layers, Hq, S, _ = w.queries.shape
        T = w.keys.shape[2]
        future = torch.arange(T)[None, :] > w.positions[:, None]  # [S,T]
        for layer in range(layers):
            scores = score_fn(layer, w.queries[layer], w.keys[layer].float(), w.positions).float()
            if not per_query_head:
                scores = scores.repeat_interleave(Hq // scores.shape[0], 0)
            scores = scores.masked_fill(future[None], float("-inf"))
            truth = w.ranked[layer, :, :, :k]  # [Hq,S,k]
            for f in fractions:
                m = max(1, int(T * f))
                chosen = torch.topk(scores, m, dim=-1).indices
                budget_ok = torch.arange(m)[None, None, :] < ((w.positions + 1) * f).clamp(min=1).long()[None, :, None]
                chosen = torch.where(budget_ok, chosen, -1)  # a query sees positions+1 keys: budget n*f
                hit = (truth[..., :, None] == chosen[..., None, :]).any(-1).float().mean()
                hits[f].append(float(hit))
    return {f: sum(v) / len(v) for f, v in hits.items()}
