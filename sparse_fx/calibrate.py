"""`calibrate`: choose Prism's proposal layers by greedy search on calibration text (training-free).

The model is compiled once in search mode: every sparse layer computes both its proposal path
(INT2 or signature scores over the cache, a pool of rho*budget candidates) and its refined path (re-score the
carried pool), and a per-layer flag in a device buffer picks one, so trying a role assignment is
writing a tensor, not recompiling. The objective is the token-level cross-entropy of sparse decode
steps under teacher forcing (dense prefill, sparse decode), as in the paper. Greedy: layer 0
proposes; each round makes proposal the layer that lowers the cross-entropy most, until there are
ceil(sparse layers / group) proposal layers.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from tqdm.auto import tqdm

from . import methods
from .plan import Plan


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
    progress: bool = True,
    **plan_options,
) -> Plan:
    """A plan whose layer roles come from greedy search minimising decode cross-entropy.

    texts: token windows [N, context] (LongTensor) or None for the training split of
    `sparse_fx.data` (needs `tokenizer`); the last `steps` tokens of each window are decoded
    sparsely under teacher forcing after a dense prefill of the rest. method: "prism" or
    "static" (IndexCache-style reuse, for the ablation). plan_options: budget, sink, local, rho,
    int2_group, proposal ("int2" or "hash": signature proposals, with `encoders` a directory of
    trained ones or LSH without), dense_layers. The model is left as it was.
    """
    from transformers import StaticCache

    from .api import SparseForward, attach_cache, compile, restore, sparse_state

    handler = methods.get(method)
    if not handler.explicit_roles:
        raise ValueError(f"sparse_fx: calibrate chooses proposal and refined layers; plan method {method!r} has none "
                         "(valid: prism, static)")
    ids = _windows(texts, tokenizer, context, windows, seed)
    N, T = ids.shape
    prefill = T - steps
    if prefill < 1:
        raise ValueError(f"sparse_fx: windows of {T} tokens leave nothing to prefill before {steps} decode steps")
    if isinstance(model.__dict__.get("forward"), SparseForward):
        raise ValueError("sparse_fx: calibrate a plain model, not one already compiled by sparse_fx")
    device = next(model.parameters()).device
    ids = ids.to(device)
    cache = StaticCache(config=model.config, max_cache_len=T)
    with torch.no_grad():
        model(ids[:, :prefill], past_key_values=cache)  # dense prefill, once
    base = Plan.parse(f"{method}-g{group}", **plan_options)
    compile(model, base, backend="eager", _search=True)
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
    return dataclasses.replace(base, roles=tuple(roles), note=note)


def _windows(texts, tokenizer, context: int, windows: int, seed: int) -> torch.Tensor:
    if isinstance(texts, torch.Tensor):
        if texts.dim() != 2:
            raise ValueError(f"sparse_fx: token windows must be [N, T], got {tuple(texts.shape)}")
        return texts.long()
    if texts is not None or tokenizer is None:
        raise ValueError("sparse_fx: pass token windows [N, T], or tokenizer= to use the training split of sparse_fx.data")
    from .data import token_windows

    return token_windows(tokenizer, "train", context, windows, seed=seed)
