"""One-pass teacher forcing: next-token agreement and cross-entropy delta vs dense over many tokens.

The harness (`sparse_fx.offline.harness`) decodes token by token through the compiled model: the
product's path, but about 90 s per 256 tokens of one plan at 4K on 2 CPU cores, so its model-level
numbers rest on one window of 256 tokens, where one token is 0.4%. Teacher-forced sparse decoding
is one forward pass in which each of the last `span` positions attends only to what the plan's
decode step would select for it while earlier positions attend densely: later layers then read
keys and values computed from sparse hidden states, as in decode. The selection is the product's
own (`Selector`: the plan's method, its ops run eagerly on one row per position), so every plan
runs: dense, oracle, hash, hash-b<bits>, prism-g<G>[-hash], static-g<G>[-hash], calibrated plan
files, and any of them with -mass<p>. On the harness's window and tokens it gives the harness's
agreement and tokens kept, and its CE delta to ~1e-6 (tests/offline/test_quality.py checks it; floats
round differently in one pass, which rarely swaps one key that sits within an ulp of a score
bucket's edge). A window costs, per plan, 0.2-0.5 s on an H200 at 8K tokens (span 256 or 1024),
and 20-30 s on 2 CPU cores at 2K with a span of 128 (the reference ops score every row's keys:
the cost grows as span x context).

    from sparse_fx.offline import agreement
    from sparse_fx.offline.models import load_model
    model, tok = load_model()
    plans = agreement.plans_of(["oracle", "hash", "prism-g4"], encoders=[])
    run = agreement.evaluate(model, tok, plans, n=2048, sparsity=16, windows=8, span=256)
    run["passkey"] = agreement.passkey(model, tok, plans, 2048, 16, depths=[10, 50, 90], trials=10)
    report = agreement.merge([earlier_report, {"meta": meta, "runs": [run]}], meta)

A run (`evaluate`) is one cell: a context and a sparsity, with a row per plan. A report is
{"meta": ..., "runs": [cell, ...]}; `merge` combines the cells of several reports. The command line
over this module, with its tables and plots, is `python bench/teacher_agreement.py`.

So that it selects exactly what a decode step would, the selector takes the state `compile` builds
and calls the plan's method hooks eagerly: this module reads the front end's internals, as
`calibrate` does, and the product never imports it.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AttentionInterface

from .. import methods
from ..api import compile, sparse_state
from ..graph import EagerEmitter
from ..lowering.reference import kept
from ..methods import Site
from ..plan import Plan
from ..runtime.caches import KVShape
from ..runtime.encoders import SignatureEncoders
from .data import passkey_prompt, token_windows
from .harness import passkey_key, share_weights_copy

ATTENTION = "sparse_fx_teacher_mask"
ROW_KEYS = 2**20  # query rows x keys selected at once: bounds what the ops materialise per row (INT2 keys, logits)
METRICS = ("agreement", "ce_delta", "kept")  # per window, per plan


class Selector:
    """What the product's decode step selects for each of the last E positions of a sequence.

    The plan's method chooses (`Method.select`, its graph ops run eagerly, as `attach_cache` runs
    its side-cache writes) on a batch of decode steps, one row per position: row r holds the keys
    and side cache up to its position, left-padded so that its query sits in the last slot, and
    its sink starts at its first real slot (the product's left-padding path). So scores, ties,
    sink, local window, Prism pools and mass cuts are the product's, on caches as long as the
    harness's. A Prism proposal layer's pool reaches later layers through `carry`, as in the
    decode graph: call `begin` before each forward.

    refresh=s (a study for selections shared across decode steps): a position whose step is not a
    multiple of s after the first scored one reads what the last such step selected, plus its own
    sink and local window (which holds every token since, for s <= local). share="pool" (plans whose
    refined layers re-score a proposal's pool): only the proposals' pools are shared so; between
    refreshes every layer, a proposal layer too, re-scores the last pool with its own query, as a
    refined layer does."""

    def __init__(self, plan: Plan, model, budget: int, refresh: int = 1, share: str = "choice"):
        if not 1 <= refresh <= plan.local:
            raise ValueError(f"refresh must be in 1..local ({plan.local}): a shared selection's local window must hold "
                             f"every token since it was chosen (got {refresh})")
        if share not in SHARES:
            raise ValueError(f"share must be one of {', '.join(SHARES)}, got {share!r}")
        self.refresh, self.share = refresh, share
        # the state `compile` builds (roles, shipped role tables, encoders, checks), on a copy of the
        # model that shares its weights and is never run: `model` is left as it is
        self.state = sparse_state(compile(share_weights_copy(model), plan, budget=budget, backend="eager"))
        if share == "pool" and ("proposal" not in self.state.roles or not getattr(self.state.method, "rescores", False)):
            raise ValueError(f"share='pool' needs a plan whose refined layers re-score a proposal layer's pool (prism); "
                             f"{plan.name} has none")
        self.emit = EagerEmitter()
        self.begin()

    def begin(self) -> None:
        """A new forward: no pool carried yet, no tokens counted."""
        self.carry: dict = {}
        self.chosen, self.slots = 0, 0

    @property
    def kept(self) -> float:
        """Tokens chosen by score per step and KV head in this forward (the budget; fewer under mass < 1)."""
        return float(self.chosen) / self.slots if self.slots else 0.0

    def mask(self, layer: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        """[B, Hkv, E, T] bool: the keys each of the last E positions reads (q [B, Hq, E, D], k [B, Hkv, T, D])."""
        E, T = q.shape[2], k.shape[2]
        side = self._side_cache(layer, k)
        s = self.refresh
        step = max(s, max(1, ROW_KEYS // T) // s * s)  # chunks start at multiples of s: a row's sharer is in its chunk
        out = []
        for b in range(k.shape[0]):
            padded = {name: left_pad(t[b], E - 1) for name, t in {"k": k, **side}.items()}
            chunks = [self._rows(layer, q[b, :, lo : lo + step], padded, lo, E, scale, self.carry.setdefault((b, lo), {}))
                      for lo in range(0, E, step)]
            out.append(torch.cat(chunks, 1))
        chosen = torch.stack(out)
        return self._shared(chosen, T) if self.share == "choice" else chosen

    def _shared(self, chosen: torch.Tensor, T: int) -> torch.Tensor:
        """chosen [B, Hkv, E, T] with refresh s: row e takes row e - e % s's choice, and its own sink and window."""
        E, s = chosen.shape[2], self.refresh
        if s == 1:
            return chosen
        e = torch.arange(E, device=chosen.device)
        plan = self.state.plan
        window = kept(torch.arange(T, device=chosen.device)[None], (T - E + e)[:, None], plan.sink, plan.local)  # row e's own
        return chosen[:, :, e - e % s] | window

    def _side_cache(self, layer: int, k: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layer's side cache (INT2 keys, signatures, or none) for the whole sequence, as the product writes it."""
        s, kv = self.state, KVShape.of(k)
        specs = s.method.side_cache(s.role(layer), kv, s.plan)
        if not specs:
            return {}
        side = s.side_caches.layer(layer, kv, specs)
        s.method.write(self.emit, s.context, layer, kv, side, k, torch.arange(kv.max_len, device=k.device))
        return side

    def _rows(self, layer: int, q: torch.Tensor, padded: dict, lo: int, E: int, scale: float, carry: dict) -> torch.Tensor:
        """[Hkv, R, T] bool for rows lo..lo+R-1 of E (q [Hq, R, D]): one decode step each."""
        R, dev = q.shape[1], q.device
        T = padded["k"].shape[1] - (E - 1)
        start = E - 1 - torch.arange(lo, lo + R, device=dev)  # row r: position T - E + r, first real slot E - 1 - r
        rows = {name: t[:, lo : lo + R - 1 + T].unfold(1, T, 1).movedim(-1, 2).transpose(0, 1) for name, t in padded.items()}
        keys = rows.pop("k")  # [R, Hkv, T, D], views of the padded sequence
        site = Site(layer=layer, role=self.state.role(layer), q=q.transpose(0, 1)[:, :, None], k=keys, v=None,
                    mask=(torch.arange(T, device=dev) >= start[:, None])[:, None, None], scale=scale,
                    pos=torch.tensor([T - 1], device=dev), start=start.int(), kv=KVShape.of(keys), q_heads=q.shape[0],
                    side=rows, carry=carry)
        idx = self.state.method.select(self.emit, self.state.context, site).indices.long()  # [R, Hkv, K] slots, -1 none
        if self.share == "pool" and self.refresh > 1 and site.role == "proposal":
            self._share_pool(carry, lo, R)
            between = (lo + torch.arange(R, device=dev)) % self.refresh != 0  # rows that are not a refresh step
            rescored = self.state.method.select(self.emit, self.state.context, replace(site, role="refined")).indices.long()
            idx = torch.where(between[:, None, None], rescored, idx)
        self.chosen += (idx[..., self.state.plan.window :] >= 0).sum()
        self.slots += idx.shape[0] * idx.shape[1]
        position = torch.where(idx >= 0, idx - start[:, None, None], T)  # T: nowhere (dropped below)
        chosen = torch.zeros(*idx.shape[:2], T + 1, dtype=torch.bool, device=dev).scatter_(2, position, True)
        return chosen[..., :T].transpose(0, 1)

    def _share_pool(self, carry: dict, lo: int, R: int) -> None:
        """Row r of rows lo..lo+R-1 takes the pool of row r0 = r - (lo + r) % s, moved into its own slots
        (row r's slots are row r0's shifted by r0 - r: its left padding is r - r0 shorter)."""
        layer, pool, own = carry["proposal"]
        r = torch.arange(R, device=pool.device)
        r0 = r - (lo + r) % self.refresh
        shared = torch.where(pool[r0] >= 0, pool[r0] + (r0 - r)[:, None, None].to(pool.dtype), -1)
        carry["proposal"] = (layer, shared.to(pool.dtype), own)


SHARES = ("choice", "pool")


def left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """t [H, T, *tail] behind n zero slots (masked in every row that has them)."""
    return torch.cat([t.new_zeros(t.shape[0], n, *t.shape[2:]), t], 1)


class TeacherMask:
    """An attention function for `AttentionInterface`: dense causal SDPA for all but the last `span`
    positions; those read only their selection. Layers the plan keeps dense read everything."""

    def __init__(self, span: int):
        self.span, self.selector = span, None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        B, Hq, T, D = query.shape
        G = Hq // key.shape[1]
        E = self.span
        scale = D**-0.5 if scaling is None else scaling
        k, v = key.repeat_interleave(G, 1), value.repeat_interleave(G, 1)
        head = F.scaled_dot_product_attention(query[:, :, : T - E], k[:, :, : T - E], v[:, :, : T - E], is_causal=True, scale=scale)
        if self.selector.state.role(module.layer_idx) == "dense":
            positions = torch.arange(T - E, T, device=query.device)
            allowed = (torch.arange(T, device=query.device)[None, :] <= positions[:, None])[None, None]
        else:
            allowed = self.selector.mask(module.layer_idx, query[:, :, T - E :], key, scale).repeat_interleave(G, 1)
        tail = F.scaled_dot_product_attention(query[:, :, T - E :], k, v, attn_mask=allowed, scale=scale)
        return torch.cat([head, tail], 2).transpose(1, 2).contiguous(), None


def plans_of(names: list[str], encoders: list[str]) -> dict[str, Plan]:
    """Rows by name: each plan of `names` (a name or a plan file), then per encoder directory a learned
    row of each signature plan among them of the encoders' width."""
    plans = {name: Plan.parse(name) for name in names}
    for d in encoders:
        bits = SignatureEncoders.load(d).bits
        learned = {f"{name} learned ({Path(d).name})": Plan.parse(plans[name], encoders=d) for name in names
                   if methods.get(plans[name].method).uses_encoders(plans[name]) and plans[name].options.bits == bits}
        if not learned:
            raise ValueError(f"encoders {d!r} ({bits}-bit) apply to none of the plans: give a signature plan of that width "
                             "(hash, prism-g<G>-hash)")
        plans.update(learned)
    return plans


def selectors(model, plans: dict, n: int, sparsity: int, refresh: tuple[int, ...] = (1,),
              pool_refresh: tuple[int, ...] = ()) -> dict[str, Selector]:
    """A Selector per sparse plan at budget n // sparsity, per refresh s > 1 one named "<plan> refresh=<s>",
    and per pool_refresh s one named "<plan> pool-refresh=<s>" for each plan whose refined layers re-score
    a proposal's pool (the others get no such row)."""
    budget = max(1, n // sparsity)
    out = {name if s == 1 else f"{name} refresh={s}": Selector(p, model, budget, refresh=s)
           for name, p in plans.items() if not p.dense for s in refresh}
    for name, p in plans.items():
        state = None if p.dense or not pool_refresh else (out.get(name) or Selector(p, model, budget)).state
        if state is not None and "proposal" in state.roles and getattr(state.method, "rescores", False):
            out |= {f"{name} pool-refresh={s}": Selector(p, model, budget, refresh=s, share="pool") for s in pool_refresh}
    return out


def forwards(model, ids: torch.Tensor, teacher: TeacherMask, sparse: dict):
    """(None, dense logits, seconds), then (name, logits, seconds) per sparse plan whose last
    `teacher.span` positions attend to what the plan selects for them: logits [span, V] of those
    positions (a copy, so that no full [T, V] logits outlive their forward)."""
    AttentionInterface.register(ATTENTION, teacher)
    previous = model.config._attn_implementation
    try:
        with torch.no_grad():
            for name, sel in [(None, None), *sparse.items()]:
                t0 = time.perf_counter()
                model.config._attn_implementation = previous if sel is None else ATTENTION
                if sel is not None:
                    teacher.selector = sel
                    sel.begin()
                logits = model(ids, use_cache=False).logits[0, -teacher.span:].clone()
                yield name, logits, time.perf_counter() - t0
    finally:
        model.config._attn_implementation = previous


def evaluate(model, tok, plans: dict, n: int, sparsity: int, windows: int, span: int, seed: int = 0, progress: bool = False,
             refresh: tuple[int, ...] = (1,), pool_refresh: tuple[int, ...] = ()) -> dict:
    """One cell: per plan, agreement and CE delta vs dense over `windows` held-out windows' last
    `span` tokens, and the tokens its selections chose by score."""
    device = next(model.parameters()).device
    teacher = TeacherMask(span)
    ids = token_windows(tok, "heldout", n + 1, windows, seed=seed).to(device)
    sparse = selectors(model, plans, n, sparsity, refresh, pool_refresh)
    rows = {name: {**{m: [] for m in METRICS}, "seconds": 0.0} for name in sparse}
    dense_ce = []
    for w in tqdm(ids, desc=f"context {n}, 1/{sparsity}", disable=not progress):
        inputs, targets = w[None, :n], w[n - span + 1:]
        for name, logits, seconds in forwards(model, inputs, teacher, sparse):
            lp = torch.log_softmax(logits.double(), -1)
            if name is None:
                ref, ref_t = lp, lp.gather(1, targets[:, None])[:, 0]
                dense_ce.append(float(-ref_t.mean()))
                continue
            r = rows[name]
            r["agreement"].append(float((lp.argmax(-1) == ref.argmax(-1)).double().mean()))
            r["ce_delta"].append(float((ref_t - lp.gather(1, targets[:, None])[:, 0]).mean()))
            r["kept"].append(sparse[name].kept)
            r["seconds"] += seconds
    out = {"context": n, "sparsity": sparsity, "budget": max(1, n // sparsity), "windows": windows, "span": span,
           "dense_ce": dense_ce, "plans": {}}
    for name, r in rows.items():
        out["plans"][name] = {"plan": sparse[name].state.plan.to_dict(), **{m: summary(r[m]) for m in METRICS},
                              "per_window": {m: r[m] for m in METRICS}, "seconds": r["seconds"]}
    if "oracle" in out["plans"]:
        oracle = out["plans"]["oracle"]["per_window"]["agreement"]
        for row in out["plans"].values():
            row["agreement_of_oracle"] = sum(row["per_window"]["agreement"]) / sum(oracle)
    return out


def passkey(model, tok, plans: dict, n: int, sparsity: int, depths: list[int], trials: int, offset: int = 1,
            seed: int = 0, progress: bool = False, refresh: tuple[int, ...] = (1,), pool_refresh: tuple[int, ...] = ()) -> dict:
    """Pass-key retrieval, teacher-forced: the harness's prompts and keys (`harness.passkey_key`), each
    followed by its key's tokens. From the prompt's last `offset` tokens on (the harness decodes those
    sparsely) every position attends to its selection; a plan finds the key when every next-token
    argmax over the key's tokens is the key's next token, which is exactly when greedy decoding would
    write the key first (the harness also counts a key written later in its answer). Dense is a row."""
    device = next(model.parameters()).device
    teacher = TeacherMask(1)
    sparse = selectors(model, plans, n, sparsity, refresh, pool_refresh)
    found = {name: {d: [] for d in depths} for name in ["dense", *sparse]}
    for d in tqdm(depths, desc=f"passkey {n}, 1/{sparsity}", disable=not progress):
        for t in range(trials):
            key = passkey_key(seed, t)
            answer = tok(f" {key}", add_special_tokens=False, return_tensors="pt")["input_ids"][0]
            ids = torch.cat([passkey_prompt(tok, n, d / 100, key)[0], answer[:-1]])[None].to(device)
            A = answer.numel()
            teacher.span = offset - 1 + A
            for name, logits, _ in forwards(model, ids, teacher, sparse):
                found[name or "dense"][d].append(bool((logits[-A:].argmax(-1).cpu() == answer).all()))
    return {name: {str(d): sum(f[d]) / trials for d in depths} | {"trials": trials, "found": {str(d): f[d] for d in depths}}
            for name, f in found.items()}


def summary(values: list[float]) -> dict:
    """Mean over windows (each the same number of tokens) and its standard error."""
    m = sum(values) / len(values)
    se = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values)) if len(values) > 1 else float("nan")
    return {"mean": m, "stderr": se}


def merge(reports: list[dict], meta: dict, keep: list[str] | None = None) -> dict:
    """One report of several reports' cells: plans (and pass keys) of the same context and sparsity
    side by side, the first report's row kept where two measured the same plan; `keep`: only these
    plans' rows (and dense's pass keys). `meta` is the merging command's header: its command names
    the result, the first report's header says where the cells ran, and every report's header is
    kept under "merged"."""
    cells: dict = {}
    for rep in reports:
        for run in rep["runs"]:
            cell = cells.setdefault((run["context"], run["sparsity"]),
                                    {k: v for k, v in run.items() if k not in ("plans", "passkey")} | {"plans": {}})
            for name, row in run["plans"].items():
                if keep is None or name in keep:
                    cell["plans"].setdefault(name, row)
            if "passkey" in run:
                cell.setdefault("passkey", {})
                for name, row in run["passkey"].items():
                    if keep is None or name in keep or name == "dense":
                        cell["passkey"].setdefault(name, row)
    for cell in cells.values():  # rows of a run without the oracle, against the oracle of another (same windows)
        oracle = cell["plans"].get("oracle")
        for row in cell["plans"].values():
            if oracle is not None and not row.get("agreement_of_oracle", 0) > 0:
                row["agreement_of_oracle"] = sum(row["per_window"]["agreement"]) / sum(oracle["per_window"]["agreement"])
    meta = {**reports[0]["meta"], "command": meta["command"], "merged": [rep["meta"] for rep in reports]}  # where they ran
    return {"meta": meta, "runs": [cells[k] for k in sorted(cells)]}
