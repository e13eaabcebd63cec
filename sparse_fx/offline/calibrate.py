"""`calibrate`: choose Prism's proposal layers on calibration text (training-free).

Two objectives, both constrained to the plan's shape (ceil(sparse layers / group) proposal layers,
each refined layer served by the nearest proposal above it):

- "mass" (default): one dense forward per window captures every layer's queries at the last
  `steps` positions and its keys. For every pair of a proposal candidate p and a later layer l,
  it measures the attention mass l keeps, step by step, when it chooses its `budget` within p's
  pool (p itself choosing by its proposal score, INT2 or signatures, as the plan runs), as a share of the mass of l's
  own exact top-`budget`. The roles maximising the summed share are found exactly by dynamic
  programming over contiguous groups. Thousands of steps cost seconds, so it runs at the deployed
  length on many windows.
- "ce": the paper's objective, the token-level cross-entropy of sparse decode steps under teacher
  forcing, by greedy search. The model is compiled once in search mode: every sparse layer
  computes both its proposal path and its refined path, and a per-layer flag on the device picks
  one, so trying a role assignment writes a tensor, not a graph. Layer 0 proposes; each round
  makes proposal the layer that lowers the cross-entropy most. Each trial decodes every window,
  so it affords far fewer tokens than "mass".
"""

from __future__ import annotations

import dataclasses
import math

import torch
from tqdm.auto import tqdm

from .. import methods
from ..lowering.reference import choose, int2_dequantize, int2_quantize, selection_keys
from ..plan import Plan
from ..model_info import ModelInfo
from ..runtime.encoders import Encoders, apply_head_mlp

OBJECTIVES = ("mass", "ce")


def calibrate(
    model,
    texts=None,
    *,
    tokenizer=None,
    group: int = 4,
    method: str = "prism",
    context: int = 2048,
    windows: int = 4,
    steps: int = 16,
    seed: int = 0,
    objective: str = "mass",
    progress: bool = True,
    **plan_options,
) -> Plan:
    """A plan whose layer roles maximise the attention mass the pools keep (objective "mass") or
    minimise decode cross-entropy by greedy search ("ce"); see the module docstring.

    texts: token windows [N, context] (LongTensor) or None for the training split of
    `sparse_fx.offline.data` (needs `tokenizer`); the last `steps` tokens of each window are decoded
    sparsely under teacher forcing after a dense prefill of the rest (their queries, for "mass").
    method: "prism" or "static" (IndexCache-style reuse, for the ablation). plan_options: budget, sink, local, rho,
    int2_group, proposal ("int2" or "hash": signature proposals, with `encoders` a directory of
    trained ones or LSH without), dense_layers. The model is left as it was.
    """
    from transformers import StaticCache

    from ..api import SparseForward, attach_cache, compile, restore, sparse_state

    handler = methods.get(method)
    if "roles" not in {f.name for f in dataclasses.fields(handler.options)}:
        raise ValueError(f"sparse_fx: calibrate chooses proposal and refined layers; plan method {method!r} has none "
                         "(valid: prism, static)")
    if objective not in OBJECTIVES:
        raise ValueError(f"sparse_fx: unknown calibration objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
    ids = _windows(texts, tokenizer, context, windows, seed)
    N, T = ids.shape
    prefill = T - steps
    if prefill < 1:
        raise ValueError(f"sparse_fx: windows of {T} tokens leave nothing to prefill before {steps} decode steps")
    if isinstance(model.__dict__.get("forward"), SparseForward):
        raise ValueError("sparse_fx: calibrate a plain model, not one already compiled by sparse_fx")
    device = next(model.parameters()).device
    ids = ids.to(device)
    if objective == "mass":
        return _by_mass(model, ids, steps, handler, Plan.parse(f"{method}-g{group}", **plan_options), progress)
    cache = StaticCache(config=model.config, max_cache_len=T)
    with torch.no_grad():
        model(ids[:, :prefill], past_key_values=cache)  # dense prefill, once
    base = Plan.parse(f"{method}-g{group}", **plan_options)
    compile(model, base.replace(min_context=0), backend="eager", _search=True)  # sparse at any length
    state = sparse_state(model)
    try:
        attach_cache(model, cache)
        sparse = [i for i, r in enumerate(state.roles) if r == "search"]
        if not sparse:
            raise ValueError("sparse_fx: no layer is left to calibrate (all dense)")
        n_proposals = math.ceil(len(sparse) / group)

        def ce(roles: list[str]) -> float:
            state.method.set_roles(roles)
            for layer in cache.layers:
                layer.cumulative_length.fill_(prefill)
            total = 0.0
            with torch.no_grad():
                for t in range(prefill, T - 1):
                    logits = model(ids[:, t : t + 1], past_key_values=cache).logits[:, -1].float()
                    total += float(torch.nn.functional.cross_entropy(logits, ids[:, t + 1], reduction="sum"))
            return total / (N * (T - 1 - prefill))

        roles = ["dense" if r == "dense" else "refined" for r in state.roles]
        roles[sparse[0]] = "proposal"
        uniform = handler.roles(base, len(roles), {i for i, r in enumerate(state.roles) if r == "dense"})
        history = {"uniform": ce(uniform)}
        rounds = n_proposals - 1
        bar = tqdm(total=sum(len(sparse) - 1 - r for r in range(rounds)), desc=f"calibrate {method}-g{group}", disable=not progress)
        for _ in range(rounds):
            best = None
            for layer in sparse:
                if roles[layer] != "refined":
                    continue
                trial = roles.copy()
                trial[layer] = "proposal"
                score = ce(trial)
                bar.update()
                bar.set_postfix(ce=f"{score:.4f}")
                if best is None or score < best[0]:
                    best = (score, layer)
            roles[best[1]] = "proposal"
        bar.close()
        history["calibrated"] = ce(roles)
    finally:
        restore(model)
    note = (f"calibrated on {N} windows x {T} tokens ({steps} decode steps each): decode cross-entropy "
            f"{history['calibrated']:.4f} vs uniform {history['uniform']:.4f}")
    return dataclasses.replace(base.replace(roles=tuple(roles)), note=note)


def _windows(texts, tokenizer, context: int, windows: int, seed: int) -> torch.Tensor:
    if isinstance(texts, torch.Tensor):
        if texts.dim() != 2:
            raise ValueError(f"sparse_fx: token windows must be [N, T], got {tuple(texts.shape)}")
        return texts.long()
    if texts is not None or tokenizer is None:
        raise ValueError("sparse_fx: pass token windows [N, T], or tokenizer= to use the training split of sparse_fx.offline.data")
    from .data import token_windows

    return token_windows(tokenizer, "train", context, windows, seed=seed)


# ------------------------------------------------------------------------------ the mass objective
def _by_mass(model, ids: torch.Tensor, steps: int, handler, base: Plan, progress: bool) -> Plan:
    N, T = ids.shape
    proposal_score = _proposal_scorer(model, base)
    roles = handler.roles(base, model.config.num_hidden_layers, set(base.dense_layers))
    sparse = [i for i, r in enumerate(roles) if r != "dense"]
    if not sparse:
        raise ValueError("sparse_fx: no layer is left to calibrate (all dense)")
    o = base.options
    pool_size = o.pool(base.budget)
    if pool_size >= T - steps - base.window:
        raise ValueError(f"sparse_fx: windows of {T} tokens hold fewer candidates than a pool of {pool_size} "
                         "(rho x budget): every role assignment would pool them all; use longer windows or a smaller budget")
    kept = torch.zeros(len(sparse), len(sparse), dtype=torch.float64)  # [proposal, layer]: mass l keeps from p's pool
    best = torch.zeros(len(sparse), dtype=torch.float64)  # mass of each layer's own top-budget
    allowed = decode_candidates(T, steps, base, ids.device)
    for w in tqdm(range(N), desc=f"calibrate {base.name} (mass)", disable=not progress):
        layers = capture(model, ids[w : w + 1], steps)
        mass = [attention_mass(*layers[i], allowed) for i in sparse]
        best += torch.tensor([float(_top_sum(m, base.budget)) for m in mass], dtype=torch.float64)
        # how a refined layer ranks the pool: its exact mass, or its own INT2 scores (refine="int2")
        ranks = [selection_keys(int2_score(*layers[i], o.int2_group)) if o.refine == "int2"
                 else selection_keys(m) for i, m in zip(sparse, mass)]
        for a, p in enumerate(sparse):
            q, k = layers[p]
            keys = selection_keys(proposal_score(p, q, k))
            pool = choose(keys, allowed, pool_size)
            own = choose(keys, pool, base.budget)  # the proposal's own choice: the served selections
            for b in range(a, len(sparse)):
                if b == a or not handler.rescores:
                    chosen = own
                else:  # a refined layer: its own best within the pool
                    chosen = choose(ranks[b], pool, base.budget)
                kept[a, b] += float(mass[b][chosen].sum())
    share = kept / best.clamp(min=1e-30)
    leads = _best_leads(share, math.ceil(len(sparse) / o.group))
    uniform = [n for n in range(len(sparse)) if n % o.group == 0]
    out = ["dense" if r == "dense" else "refined" for r in roles]
    for n in leads:
        out[sparse[n]] = "proposal"
    note = (f"calibrated on {N} windows x {T} tokens (queries of the last {steps}): attention mass kept "
            f"{_value(share, leads) / len(sparse):.4f} of each layer's own top-budget vs uniform {_value(share, uniform) / len(sparse):.4f}")
    return dataclasses.replace(base.replace(roles=tuple(out)), note=note)


def capture(model, ids: torch.Tensor, steps: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """layer -> (queries of the last `steps` positions [steps, Hq, D], keys [Hkv, T, D]), float32,
    from one dense forward (any attention implementation: recorded, then run as SDPA)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    got = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        got[module.layer_idx] = (query[0, :, -steps:].transpose(0, 1).float(), key[0].float())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("sparse_fx_calibration_capture", recording)
    previous = model.config._attn_implementation
    model.config._attn_implementation = "sparse_fx_calibration_capture"
    try:
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)  # no vocabulary-wide logits: only attention is wanted
    finally:
        model.config._attn_implementation = previous
    return got


def decode_candidates(T: int, steps: int, plan: Plan, device) -> torch.Tensor:
    """[steps, 1, T] bool: what a decode query at each of the last `steps` positions may select
    (after the sink, before its local window; reference.select_topk)."""
    now = torch.arange(T - steps, T, device=device)[:, None, None]
    j = torch.arange(T, device=device)
    return (j >= plan.sink) & (j <= now - plan.local)


def attention_mass(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[steps, Hkv, T]: attention weights summed over each KV head's query heads, 0 off the candidates
    (reference.mass_scores over each step's causal prefix)."""
    S, Hq, D = q.shape
    Hkv, T, _ = k.shape
    steps = torch.arange(T - S, T, device=k.device)[:, None, None, None]
    logits = torch.einsum("skgd,ktd->skgt", q.view(S, Hkv, Hq // Hkv, D), k) * D**-0.5
    weights = logits.masked_fill(torch.arange(T, device=k.device) > steps, float("-inf")).softmax(-1).sum(2)
    return weights * allowed


def _proposal_scorer(model, plan: Plan):
    """(layer, q, k) -> [steps, Hkv, T]: how the plan's proposal layers score every key."""
    o = plan.options
    if o.proposal == "int2":
        return lambda layer, q, k: int2_score(q, k, o.int2_group)
    from ..api import _load_encoders

    info = ModelInfo.of(model)
    trained = _load_encoders(o.encoders, model, info, plan) if o.encoders else None
    encoders = Encoders(o.bits, plan.seed, trained)
    return lambda layer, q, k: signature_score(q, k, encoders.layer(layer, q.shape[1], k.shape[0], k.shape[2], k.device))


def signature_score(q: torch.Tensor, k: torch.Tensor, enc) -> torch.Tensor:
    """[steps, Hkv, T] int64: summed over the group's query heads, agreeing minus differing bits of
    their signatures and the key's (enc: the layer's encoders): 2 x reference.hamming_scores - G x bits."""
    S, Hq, D = q.shape
    Hkv = k.shape[0]
    qs = torch.where(apply_head_mlp(q.transpose(0, 1)[None], *enc.query.params())[0] > 0, 1.0, -1.0)  # [Hq, S, bits]
    ks = torch.where(apply_head_mlp(k[None], *enc.key.params())[0] > 0, 1.0, -1.0)  # [Hkv, T, bits]
    return torch.einsum("kgsb,ktb->skt", qs.view(Hkv, Hq // Hkv, S, -1), ks).round().long()


def int2_score(q: torch.Tensor, k: torch.Tensor, group: int) -> torch.Tensor:
    """[steps, Hkv, T]: max over the group's query heads of <q, INT2 round trip of k> (reference.int2_scores)."""
    S, Hq, D = q.shape
    Hkv = k.shape[0]
    kd = int2_dequantize(*int2_quantize(k, group))
    return torch.einsum("skgd,ktd->skgt", q.view(S, Hkv, Hq // Hkv, D), kd).amax(2)


def _top_sum(mass: torch.Tensor, k: int) -> torch.Tensor:
    return mass.topk(min(k, mass.shape[-1]), -1).values.sum()


def _value(share: torch.Tensor, leads: list[int]) -> float:
    """Summed share of every layer under the leads (each layer served by the nearest lead at or above it)."""
    bounds = leads + [share.shape[0]]
    return float(sum(share[a, a:b].sum() for a, b in zip(bounds, bounds[1:])))


def _best_leads(share: torch.Tensor, groups: int) -> list[int]:
    """The `groups` lead positions (the first is 0) maximising `_value`: dynamic programming over
    where each contiguous group starts."""
    n = share.shape[0]
    groups = min(groups, n)
    seg = torch.zeros(n, n + 1, dtype=torch.float64)  # seg[a, b]: layers a..b-1 led by a
    for a in range(n):
        seg[a, a + 1 :] = share[a, a:].cumsum(0)
    NEG = float("-inf")
    value = [[NEG] * (n + 1) for _ in range(groups + 1)]  # value[g][b]: layers 0..b-1 in g groups
    start = [[0] * (n + 1) for _ in range(groups + 1)]
    value[0][0] = 0.0
    for g in range(1, groups + 1):
        for b in range(g, n + 1):
            for a in range(g - 1, b):
                if value[g - 1][a] > NEG and value[g - 1][a] + float(seg[a, b]) > value[g][b]:
                    value[g][b], start[g][b] = value[g - 1][a] + float(seg[a, b]), a
    leads, b = [], n
    for g in range(groups, 0, -1):
        b = start[g][b]
        leads.append(b)
    return sorted(leads)
