"""`train_signatures`: learn HashAttention's key and query encoders on a frozen model.

Per layer, an MLP per query head and one per KV head (d -> 128 -> 128 -> bits, SiLU) map post-RoPE
queries and keys to bit signatures. Training follows the paper: labels are true top-64 keys, the
loss is binary cross-entropy with positive weight alpha + beta * n (n = keys the query sees), and
tanh stands in for sign.

By default it trains the decision the plan serves. A KV head selects for its query heads by the
sum of their Hamming similarities (one key encoder per KV head, what the runtime serves), so with
`labels="kv"` the logit is that sum (of tanh codes) and the labels are the KV head's top keys by
attention mass summed over its query heads (the oracle plan's score); and the first `sink` and
last `local` keys, which the plan keeps whatever they score, are neither labels nor negatives.
`labels="query"` with sink = local = 0 is the paper's recipe (each query head's own top keys and
logit); it leaves model-level agreement 0.5-1.7 points lower at 2K-8K (bench/NOTES.md, Signatures).
`key_sharing="query"` trains one key encoder per query head, each query head selecting for itself.

All layers train at once: (layer, head) pairs are one batch dimension of the per-head MLPs. A step
takes a few queries of one captured window and a uniform sample of its keys (the BCE over every
visible key of every query is what made whole-window steps slow on a CPU); the positives that
fall in the sample keep their weight, so the objective is the whole-window one, estimated on a subsample.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from ..lowering.reference import kept
from ..model_info import ModelInfo
from ..plan import Plan
from ..runtime.encoders import HeadMLP, LayerEncoders, SignatureEncoders, apply_head_mlp

CAPTURE = "sparse_fx_capture"
WINDOWS = 4  # training windows `train_signatures` takes by default (of TrainConfig.context tokens)


@dataclass(frozen=True)
class TrainConfig:
    bits: int = 32
    hidden: int = 128
    context: int = 8192  # train at the context length you deploy at (it serves shorter ones too)
    queries: int = 1024  # query positions sampled per window (labels are computed at capture)
    top: int = 64  # labels: each selection unit's top-64 keys
    alpha: float = 1.0  # positive weight alpha + beta * n
    beta: float = 1.0 / 64
    steps: int = 1000  # Adam steps (linear warm-up, cosine decay)
    # Per step, from one window: 128 queries x 512 keys learns as much per step as 64 x 1024 (the
    # same query-key pairs) and costs 0.63 s instead of 0.91 on 2 CPU cores: the key MLPs, which run
    # over every KV head of every layer, dominate the step (bench/NOTES.md, Signatures).
    batch_queries: int = 128  # queries per step
    batch_keys: int = 512  # keys per step, sampled uniformly from the window
    lr: float = 2e-3
    seed: int = 0
    key_sharing: str = "kv"  # "kv": one key encoder per KV head (served); "query": one per query head
    labels: str = "kv"  # "kv": per KV head, by summed attention mass (served); "query": per query head
    sink: int = Plan.sink  # keys the plan keeps anyway (its defaults): not labels, not negatives
    local: int = Plan.local

    def __post_init__(self) -> None:
        if self.bits < 32 or self.bits % 32:
            raise ValueError(f"sparse_fx: bits must be a positive multiple of 32, got {self.bits}")
        if self.key_sharing not in ("kv", "query"):
            raise ValueError(f"sparse_fx: key_sharing must be 'kv' or 'query', got {self.key_sharing!r}")
        if self.labels not in ("kv", "query"):
            raise ValueError(f"sparse_fx: labels must be 'kv' or 'query', got {self.labels!r}")
        if self.labels == "kv" and self.key_sharing == "query":
            raise ValueError("sparse_fx: labels='kv' needs key_sharing='kv' (per-query-head keys select per query head)")
        if min(self.steps, self.batch_queries, self.batch_keys) < 1:
            raise ValueError("sparse_fx: steps, batch_queries and batch_keys must be positive")
        if min(self.sink, self.local) < 0:
            raise ValueError("sparse_fx: sink and local must be >= 0")
        if self.context <= self.sink + self.local + 2 * self.top:
            raise ValueError(f"sparse_fx: context {self.context} is too short for labels of the top {self.top} keys "
                             f"beside sink {self.sink} and local {self.local}")


@dataclass
class Window:
    """What one text window contributes, per layer: all keys, sampled queries and their labels."""

    keys: torch.Tensor  # [layers, Hkv, T, D] float16
    queries: torch.Tensor  # [layers, Hq, S, D] float32
    ranked: torch.Tensor  # [layers, Hq, S, max(top, 32)] int32: keys by true attention, best first (recall)
    labels: torch.Tensor  # [layers, units, S, top] int32: each selection unit's positives (training)
    positions: torch.Tensor  # [S] int64: the sampled queries' positions


def capture_windows(model, windows: torch.Tensor, config: TrainConfig, progress: bool = True) -> list[Window]:
    """Run the frozen model over token windows [N, T]; keep per-layer keys, sampled queries, labels,
    on the model's device (the labels' logits are the costly part after the forward pass)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    captured: dict[int, tuple[torch.Tensor, torch.Tensor, float | None]] = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured[module.layer_idx] = (query.detach(), key.detach(), kwargs.get("scaling"))
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
            out.append(_window(captured, ids.shape[0], config, gen, device))
    finally:
        model.config._attn_implementation = previous
    return out


def _window(captured, T: int, config: TrainConfig, gen: torch.Generator, device) -> Window:
    low = max(T // 8, config.sink + config.local + 2 * config.top)
    positions = torch.sort(torch.randint(low, T, (config.queries,), generator=gen)).values.to(device)
    key = torch.arange(T, device=device)[None, :]
    keep = kept(key, positions[:, None], config.sink, config.local)  # [S,T]: the plan keeps these anyway
    keys, queries, ranked, labels = [], [], [], []
    for layer in sorted(captured):
        q, k, scale = captured[layer]  # [1,Hq,T,D], [1,Hkv,T,D]
        q, k = q[0].float(), k[0].float()
        G = q.shape[0] // k.shape[0]
        qs = q[:, positions]  # [Hq,S,D]
        logits = qs @ k.repeat_interleave(G, 0).transpose(-1, -2)  # [Hq,S,T]; softmax order = logit order
        logits = logits.masked_fill(key[None] > positions[None, :, None], float("-inf"))
        ranked.append(torch.topk(logits, max(config.top, 32), dim=-1).indices.int())
        score = _kv_mass(logits * (qs.shape[-1] ** -0.5 if scale is None else scale), G) if config.labels == "kv" else logits
        labels.append(torch.topk(score.masked_fill(keep[None], float("-inf")), config.top, dim=-1).indices.int())
        keys.append(k.half())
        queries.append(qs)
    return Window(torch.stack(keys), torch.stack(queries), torch.stack(ranked), torch.stack(labels), positions)


def _mlp(heads: int, d_in: int, hidden: int, bits: int, gen: torch.Generator) -> HeadMLP:
    dims = [d_in, hidden, hidden, bits]
    weights = [torch.randn(heads, a, b, generator=gen) * math.sqrt(1.0 / a) for a, b in zip(dims, dims[1:])]
    biases = [torch.zeros(heads, b) for b in dims[1:]]
    return HeadMLP(weights, biases)


def train_on_windows(data: list[Window], config: TrainConfig, progress: bool = True) -> tuple[list[LayerEncoders], list[float]]:
    """Adam on all layers' encoders at once, on the device the windows are on; returns per-layer
    encoders (on the CPU) and the loss, averaged over each tenth of the steps (the first entry is
    the untrained encoders' loss on the first step). The initial weights and the sampled batches
    come from CPU generators, so a seed picks the same run on every device."""
    device = data[0].keys.device
    layers, Hq, S, D = data[0].queries.shape
    Hkv = data[0].keys.shape[1]
    G = Hq // Hkv
    k_heads = Hq if config.key_sharing == "query" else Hkv
    gen = torch.Generator().manual_seed(config.seed)
    q_enc = _mlp(layers * Hq, D, config.hidden, config.bits, gen)
    k_enc = _mlp(layers * k_heads, D, config.hidden, config.bits, gen)
    q_enc, k_enc = q_enc.to(device), k_enc.to(device)
    units = layers * (Hkv if config.labels == "kv" else Hq)  # a KV head (its query heads' summed logits) or a query head
    temp = torch.full((units, 1, 1), 4.0 / math.sqrt(config.bits) * units / (layers * Hq), device=device)
    bias = torch.zeros(units, 1, 1, device=device)
    params = [t.requires_grad_() for t in q_enc.weights + q_enc.biases + k_enc.weights + k_enc.biases + [temp, bias]]
    opt = torch.optim.Adam(params, lr=config.lr)
    warm = max(1, config.steps // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / config.steps)))
    history, window_sum, window_n = [], 0.0, 0
    every = max(1, config.steps // 10)
    bar = tqdm(range(config.steps), desc="train signatures", disable=not progress)
    for step in bar:
        w = data[int(torch.randint(len(data), (1,), generator=gen))]
        queries = torch.randperm(S, generator=gen)[: config.batch_queries].to(device)
        T = w.keys.shape[2]
        keys = torch.sort(torch.randperm(T, generator=gen)[: config.batch_keys]).values.to(device)
        opt.zero_grad()
        loss = _loss(w, queries, keys, q_enc, k_enc, temp, bias, config, G)
        loss.backward()
        opt.step()
        sched.step()
        value = loss.item()
        if step == 0:
            history.append(value)
        window_sum, window_n = window_sum + value, window_n + 1
        if window_n == every or step == config.steps - 1:
            history.append(window_sum / window_n)
            window_sum, window_n = 0.0, 0
            bar.set_postfix(loss=f"{history[-1]:.4f}")
    encoders = []
    for layer in range(layers):
        q = _slice(q_enc, layer * Hq, (layer + 1) * Hq)
        k = _slice(k_enc, layer * k_heads, (layer + 1) * k_heads)
        encoders.append(LayerEncoders(query=q, key=k))
    return encoders, history


def _slice(mlp: HeadMLP, a: int, b: int) -> HeadMLP:
    return HeadMLP([w[a:b].detach().cpu().clone() for w in mlp.weights], [x[a:b].detach().cpu().clone() for x in mlp.biases])


def _loss(w: Window, qi, kj, q_enc: HeadMLP, k_enc: HeadMLP, temp, bias, config: TrainConfig, G: int) -> torch.Tensor:
    """Weighted BCE of queries `qi` against keys `kj` of window `w`, per selection unit: the logit
    is temp * (query codes summed over the unit's query heads) . key code + bias, in the served
    score's order; a key is positive iff it is one of the unit's labels; positives weigh
    alpha + beta * n (n = keys the query sees), other candidates 1, keys the plan keeps anyway or
    after the query 0. Written as softplus(x) - y*x, so the dense part is one softplus over
    candidate pairs and the positive correction touches only the positives."""
    layers, Hq, _, D = w.queries.shape
    T, bits = w.keys.shape[2], config.bits
    keys = w.keys[:, :, kj].float()
    if config.key_sharing == "query":
        keys = keys.repeat_interleave(G, 1)
    kb = torch.tanh(apply_head_mlp(keys.reshape(1, -1, len(kj), D), *k_enc.params()))[0]  # [layers*key heads, keys, bits]
    units = layers * w.labels.shape[1]
    if units > kb.shape[0]:  # labels per query head, keys per KV head
        kb = kb.reshape(layers, -1, len(kj), bits).repeat_interleave(G, 1).reshape(units, len(kj), bits)
    qb = torch.tanh(apply_head_mlp(w.queries[:, :, qi].reshape(1, layers * Hq, len(qi), D), *q_enc.params()))[0]
    qb = qb.reshape(units, -1, len(qi), bits).sum(1)  # a KV head's score sums its query heads' similarities
    logits = torch.baddbmm(bias, qb * temp, kb.transpose(-1, -2))  # [units, queries, keys]
    pos = w.positions[qi]
    candidate = (kj[None, :] <= pos[:, None]) & ~kept(kj[None, :], pos[:, None], config.sink, config.local)
    dense = torch.nn.functional.softplus(logits.masked_fill(~candidate[None], float("-inf"))).sum()
    column = torch.full((T,), -1, dtype=torch.long, device=kj.device)
    column[kj] = torch.arange(len(kj), device=kj.device)
    col = column[w.labels[:, :, qi].long()].reshape(units, len(qi), config.top)
    present = col >= 0  # labels are candidates, so a sampled positive is always a candidate
    x = logits.gather(2, col.clamp(min=0))
    w_pos = (config.alpha + config.beta * (pos + 1).float())[None, :, None]
    positive = torch.where(present, (w_pos - 1) * torch.nn.functional.softplus(x) - w_pos * x, 0.0).sum()
    weight = candidate.sum() * units + torch.where(present, w_pos - 1, 0.0).sum()
    return (dense + positive) / weight


def train_signatures(
    model,
    texts=None,
    *,
    tokenizer=None,
    bits: int = 32,
    context: int = TrainConfig.context,
    windows: int = WINDOWS,
    progress: bool = True,
    **options,
) -> SignatureEncoders:
    """Train HashAttention encoders for `model` (frozen, eval mode) and return them.

    texts: token windows [N, context] (a LongTensor), a list of strings (needs `tokenizer`), or
    None for the training split of the real text that ships with Python (`sparse_fx.offline.data`,
    disjoint from the held-out split; needs `tokenizer`). options: fields of `TrainConfig`
    (hidden, queries, top, alpha, beta, steps, batch_queries, batch_keys, lr, seed, key_sharing, labels,
    sink, local). With the defaults, SmolLM2-135M trains in about 12 minutes on 2 CPU cores; the
    metadata records the seconds spent capturing and in all. Deterministic under `seed`; captures
    and trains where the model is (CPU or GPU).
    """
    config = TrainConfig(bits=bits, context=context, **options)
    start = time.perf_counter()
    ids, source = _token_windows(texts, tokenizer, config, windows)
    data = capture_windows(model, ids, config, progress)
    captured = time.perf_counter()
    encoders, history = train_on_windows(data, config, progress)
    metadata = {"train_config": asdict(config), "loss_history": history, "data": source,
                "capture_seconds": captured - start, "train_seconds": time.perf_counter() - start}
    return SignatureEncoders(encoders, config.bits, ModelInfo.of(model).fingerprint(model), metadata)


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


def oracle_scores(layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The oracle plan's score for many queries at once, as a `selection_recall` score_fn: exact
    attention mass, softmax per query head over the keys up to each query, summed over a KV head's
    query heads. q [Hq,S,D], k [Hkv,T,D], positions [S] -> [Hkv,S,T]."""
    G = q.shape[0] // k.shape[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q @ k.repeat_interleave(G, 0).transpose(-1, -2)) * scale
    future = torch.arange(k.shape[1], device=k.device)[None, None] > positions[None, :, None]
    return _kv_mass(logits.masked_fill(future, float("-inf")), G)


def _kv_mass(logits: torch.Tensor, G: int) -> torch.Tensor:
    """Scaled, masked logits [Hq,S,T] -> attention mass summed over each KV head's G query heads [Hkv,S,T]."""
    p = torch.softmax(logits, -1)
    return p.reshape(-1, G, *p.shape[1:]).sum(1)


def selection_recall(
    data: list[Window], score_fn, fractions=(1 / 16, 1 / 32), k: int = 32, per_query_head: bool = False,
    fixed: tuple[int, int] = (0, 0),
) -> dict[float, float]:
    """Recall@k of selecting the top n*fraction keys by `score_fn`, averaged over queries and heads.

    score_fn(layer, queries [Hq,S,D], keys [Hkv,T,D], positions [S]) -> scores [Hkv or Hq, S, T]
    (higher first; keys after a query's position are ignored);
    a KV head's score selects for all its query heads unless `per_query_head`.
    fixed = (sink, local): keys always kept on top of the budget, as a plan keeps its first `sink`
    and last `local` tokens; (0, 0) measures the score alone.
    """
    sink, local = fixed
    hits = {f: [] for f in fractions}
    for w in data:
        layers, Hq, S, _ = w.queries.shape
        T = w.keys.shape[2]
        key = torch.arange(T, device=w.positions.device)[None, :]
        future = key > w.positions[:, None]  # [S,T]
        keep = kept(key, w.positions[:, None], sink, local)
        for layer in range(layers):
            scores = score_fn(layer, w.queries[layer], w.keys[layer].float(), w.positions).float()
            if not per_query_head:
                scores = scores.repeat_interleave(Hq // scores.shape[0], 0)
            scores = scores.masked_fill(future[None], float("-inf")).masked_fill(keep[None], float("inf"))
            truth = w.ranked[layer, :, :, :k]  # [Hq,S,k]
            for f in fractions:
                budget = ((w.positions + 1) * f).clamp(min=1).long() + keep.sum(-1)  # a query sees positions+1 keys
                chosen = torch.topk(scores, min(T, int(budget.max())), dim=-1).indices
                rank = torch.arange(chosen.shape[-1], device=chosen.device)
                chosen = torch.where(rank[None, None, :] < budget[None, :, None], chosen, -1)
                hit = (truth[..., :, None] == chosen[..., None, :]).any(-1).float().mean()
                hits[f].append(float(hit))
    return {f: sum(v) / len(v) for f, v in hits.items()}
