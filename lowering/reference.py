"""Reference implementations of every sparse_fx op, in plain torch.

They define correctness: the ops run them on CPU, the Triton kernels are tested against them, and
they must stay traceable (no `.item()`, no data-dependent shapes) because `triton_op` uses an op's
body as its fake implementation and Inductor traces it.

Shapes, used throughout: B batch, Hq query heads, Hkv KV heads (G = Hq // Hkv query heads share a
KV head, query head h reads KV head h // G), L cache slots, D head dim, T new tokens, K selected
slots. Index tensors hold cache positions, -1 marking an empty slot.
"""

from __future__ import annotations

import torch

WORD_BITS = 32
INT2_CODES_PER_WORD = 16


# ----------------------------------------------------------------------------------------- masks
def valid_positions(
    mask: torch.Tensor | None, batch: int, kv_heads: int, length: int, device: torch.device | None = None
) -> torch.Tensor:
    """[B, Hkv, L] bool: where an SDPA attention mask lets at least one query head of a KV head read.

    `mask` is SDPA's `attn_mask` for one query, `[B|1, 1|Hq, 1, L]`: boolean (True = attend) or
    additive float (a value at or below half the dtype's minimum, or -inf, means masked).
    """
    if mask is None:
        return torch.ones(batch, kv_heads, length, dtype=torch.bool, device=device)
    ok = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    ok = ok[:, :, 0, :]  # [B|1, 1|Hq, L]
    if ok.shape[1] != 1:
        ok = ok.reshape(ok.shape[0], kv_heads, -1, length).any(2)
    return ok.expand(batch, kv_heads, length)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


# ---------------------------------------------------------------------------- gather-attention
def _softmax_values(logits: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(logits) @ v over the last dim; a row with nothing readable (all -inf) gives zeros."""
    peak = logits.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    w = torch.exp(logits - peak)
    denom = w.sum(-1, keepdim=True)
    return torch.matmul(w, v) / torch.where(denom > 0, denom, torch.ones_like(denom))


def sparse_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of one query restricted to the indexed cache positions.

    q [B,Hq,1,D], k [B,Hkv,L,D], v [B,Hkv,L,Dv], indices [B,Hkv,K] (distinct positions, -1 empty),
    mask [B|1,1|Hq,1,L] additive or boolean. Returns [B,Hq,1,Dv] in q's dtype; a head whose
    selection is empty (or fully masked) returns zeros.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = D**-0.5 if scale is None else scale
    present = indices >= 0
    idx = indices.clamp(min=0).long()  # [B,Hkv,K]
    kg = torch.gather(k, 2, idx[..., None].expand(-1, -1, -1, D)).to(acc)
    vg = torch.gather(v, 2, idx[..., None].expand(-1, -1, -1, v.shape[-1])).to(acc)
    qg = q.reshape(B, Hkv, G, D).to(acc)
    logits = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # [B,Hkv,G,K]
    bias = torch.zeros_like(logits).masked_fill(~present[:, :, None, :], float("-inf"))
    if mask is not None:
        m = _additive(mask, acc)[:, :, 0, :].expand(B, Hq, L).reshape(B, Hkv, G, L)
        bias = bias + torch.gather(m, 3, idx[:, :, None, :].expand(-1, -1, G, -1))
    return _softmax_values(logits + bias, vg).reshape(B, Hq, 1, v.shape[-1]).to(q.dtype)


# ------------------------------------------------------------------------------ signatures
def few_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Dense softmax attention of T queries over every cache position.

    q [B,Hq,T,D], k [B,Hkv,L,D], v [B,Hkv,L,Dv], mask [B|1,1|Hq,T,L] additive or boolean. Returns
    [B,Hq,T,Dv] in q's dtype; a query with nothing readable returns zeros (SDPA would return NaN).
    """
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = D**-0.5 if scale is None else scale
    qg = q.reshape(B, Hkv, G * T, D).to(acc)
    logits = torch.matmul(qg, k.to(acc).transpose(-1, -2)) * scale  # [B,Hkv,G*T,L]
    if mask is not None:
        logits = logits + _additive(mask, acc).expand(B, Hq, T, L).reshape(B, Hkv, G * T, L)
    return _softmax_values(logits, v.to(acc)).reshape(B, Hq, T, v.shape[-1]).to(q.dtype)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """[..., bits] float -> [..., bits/32] int32; bit j of word w is set iff x[..., 32w + j] > 0.

    This is HashAttention's ReLU(sign(F(x))) packed into machine words.
    """
    *lead, bits = x.shape
    b = (x > 0).reshape(*lead, bits // WORD_BITS, WORD_BITS).to(torch.int64)
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=x.device) << torch.arange(
        WORD_BITS, dtype=torch.int64, device=x.device
    )
    words = (b * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def popcount32(x: torch.Tensor) -> torch.Tensor:
    """Bits set in each 32-bit word (SWAR, in int64 so the sign bit is an ordinary bit)."""
    x = x.to(torch.int64) & 0xFFFFFFFF
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) & 0xFFFFFFFF) >> 24


def hamming_dtype(groups: int, words: int) -> torch.dtype:
    """The narrowest dtype holding scores 0..G*32*W: uint8 for 32-bit signatures and G <= 7 (a
    quarter of the bytes the selection reads, and 256 exact histogram bins), else int16 / int32."""
    top = groups * words * WORD_BITS
    return torch.uint8 if top <= 255 else torch.int16 if top <= 32767 else torch.int32


def hamming_scores(q_sig: torch.Tensor, k_sig: torch.Tensor) -> torch.Tensor:
    """Similarity (bits - Hamming distance), summed over the query heads of each KV head.

    q_sig [B,Hq,W] int32, k_sig [B,Hkv,L,W] int32 -> [B,Hkv,L] in [0, G*32*W], as
    `hamming_dtype(G, W)`.
    """
    B, Hq, W = q_sig.shape
    Hkv = k_sig.shape[1]
    qg = q_sig.reshape(B, Hkv, Hq // Hkv, 1, W)
    dist = popcount32(qg ^ k_sig[:, :, None]).sum(-1)  # [B,Hkv,G,L]
    return ((W * WORD_BITS - dist).sum(2)).to(hamming_dtype(Hq // Hkv, W))


def signature_write(cache: torch.Tensor, logits: torch.Tensor, pos: torch.Tensor) -> None:
    """cache[:, :, pos] = pack_signs(logits); cache [B,H,L,W], logits [B,H,T,32W], pos [T].

    Slots after the query's position are never read (every scan stops there), so a new sequence
    needs no clearing of what an older, longer one left behind.
    """
    cache.index_copy_(2, pos, pack_signs(logits))


# -------------------------------------------------------------------------------------- INT2
def int2_quantize(
    k: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric 2-bit quantisation along the head dim (Prism).

    k [..., D] -> codes [..., D/16] int32 (channel c at bits 2(c%16) of word c//16) and params
    [..., 2 D/group] in `scale_dtype`: the M = D/group scales, then the M zeros (k ~ zero + scale *
    code, code in 0..3), side by side so that a key's record is one memory sector. The codes are
    computed from the stored (rounded) scale and zero, so the round-trip error is at most half a
    step of the stored scale.
    """
    *lead, D = k.shape
    kg = k.float().reshape(*lead, D // group, group)
    lo, hi = kg.amin(-1), kg.amax(-1)
    scale = ((hi - lo) / 3).to(scale_dtype)
    zero = lo.to(scale_dtype)
    s, z = scale.float()[..., None], zero.float()[..., None]
    codes = torch.where(s > 0, torch.round((kg - z) / torch.where(s > 0, s, 1.0)), 0.0)
    codes = codes.clamp(0, 3).to(torch.int64).reshape(*lead, D // INT2_CODES_PER_WORD, INT2_CODES_PER_WORD)
    shifts = 2 * torch.arange(INT2_CODES_PER_WORD, dtype=torch.int64, device=k.device)
    words = (codes << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words, torch.cat([scale, zero], -1)


def int2_split(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A key's INT2 params [..., 2M] -> (scale, zero), each [..., M]."""
    return params.chunk(2, -1)


def int2_unpack(codes: torch.Tensor) -> torch.Tensor:
    """[..., D/16] int32 -> [..., D] int64 codes in 0..3."""
    shifts = 2 * torch.arange(INT2_CODES_PER_WORD, dtype=torch.int64, device=codes.device)
    c = (codes.to(torch.int64)[..., None] >> shifts) & 3
    return c.reshape(*codes.shape[:-1], codes.shape[-1] * INT2_CODES_PER_WORD)


def int2_dequantize(codes: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Inverse of `int2_quantize`, in float32: [..., D]."""
    c = int2_unpack(codes).float()
    scale, zero = int2_split(params)
    D, M = c.shape[-1], scale.shape[-1]
    k = zero.float()[..., None] + scale.float()[..., None] * c.reshape(*c.shape[:-1], M, D // M)
    return k.reshape(*c.shape)


def int2_write(codes: torch.Tensor, params: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> None:
    """Quantise the new keys k [B,H,T,D] and write them at `pos` [T] (see `signature_write`)."""
    c, prm = int2_quantize(k, 2 * k.shape[-1] // params.shape[-1], params.dtype)
    codes.index_copy_(2, pos, c)
    params.index_copy_(2, pos, prm)


def int2_scores(
    q: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, pos: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prism INT2 score: max over a KV head's query heads of <q, dequantised k>.

    q [B,Hq,1,D], codes [B,Hkv,L,D/16], params [B,Hkv,L,2D/g] -> [B,Hkv,L] float32 (a proposal
    layer scores every slot). With `positions` [B,Hkv,N] (a pool of slots, -1 empty) -> [B,Hkv,N],
    the scores of those slots, -inf for empty entries (a refined layer ranking its pool by its own
    INT2 keys). With `pos` (the positions written this step), slots after pos[-1] hold no key yet:
    they score -inf and the kernel never reads them.
    """
    B, Hq, _, D = q.shape
    Hkv, L = codes.shape[1], codes.shape[2]
    kd = int2_dequantize(codes, params)  # [B,Hkv,L,D]
    qg = q.reshape(B, Hkv, Hq // Hkv, D).float()
    out = torch.matmul(qg, kd.transpose(-1, -2)).amax(2)
    if pos is not None:
        out = out.masked_fill(torch.arange(L, device=out.device) > pos[-1], float("-inf"))
    if positions is not None:
        at = torch.gather(out, 2, positions.clamp(0, L - 1).long())
        out = at.masked_fill((positions < 0) | (positions >= L), float("-inf"))
    return out


# --------------------------------------------------------------------------- exact scores
def mass_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention mass: sum over a KV head's query heads of each candidate's softmax weight.

    The softmax runs over the candidates (all L slots, or `positions` [B,Hkv,N]) that the mask
    leaves readable; per-head normalisation keeps a sharp head from drowning a flat one, and the
    sum is the attention mass the shared selection keeps. Used by the oracle (all slots) and by
    Prism refined layers (the pool). Returns [B,Hkv,N] float32, 0 where not a candidate.
    """
    B, Hq, _, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    if positions is None:
        kc = k
        readable = valid_positions(mask, B, Hkv, L, q.device)
    else:
        idx = positions.clamp(min=0).long()
        kc = torch.gather(k, 2, idx[..., None].expand(-1, -1, -1, D))
        readable = (positions >= 0) & torch.gather(valid_positions(mask, B, Hkv, L, q.device), 2, idx)
    logits = torch.matmul(q.reshape(B, Hkv, G, D).float(), kc.float().transpose(-1, -2)) * scale
    if mask is not None:  # per head: a bool mask with heads may hide a slot from some heads of a group
        m = _additive(mask, torch.float32)[:, :, 0, :].expand(B, Hq, L).reshape(B, Hkv, G, L)
        if positions is not None:
            m = torch.gather(m, 3, idx[:, :, None, :].expand(-1, -1, G, -1))
        logits = logits + m
    logits = logits.masked_fill(~readable[:, :, None, :], float("-inf"))
    if logits.shape[-1] == 0:  # no candidates (an empty pool): no mass
        return logits.sum(2)
    peak = logits.amax(-1, keepdim=True)
    w = torch.exp(logits - torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak)))
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-30)
    return w.sum(2)


# ------------------------------------------------------------------------------ selection
def kept(keys: torch.Tensor, query: torch.Tensor, sink: int, local: int, start: torch.Tensor | int = 0) -> torch.Tensor:
    """The plan's always-kept keys: the first `sink` real positions and the last `local` up to the
    query (both inclusive of the query itself), whatever any score says. keys and query broadcast;
    `start` is the first real (non-padding) position of the row. The one definition of the rule:
    selection, the signature trainer, the measurements and the benches all use it."""
    return ((keys >= start) & (keys < start + sink)) | ((keys > query - local) & (keys <= query))


def first_readable(mask: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """[B] int32: each batch row's first position that some head may read.

    A left-padded row starts after its padding: that is where its sink lies."""
    ok = valid_positions(mask, batch, 1, length, mask.device)[:, 0]  # [B, L]
    first = torch.where(ok, torch.arange(length, device=mask.device), length).amin(-1)
    return torch.where(first < length, first, 0).to(torch.int32)  # (a min, not an argmax of bools: compilers lower it everywhere)


def selection_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 ranking keys, ordered like the scores: integer scores as they are; float scores by
    their bfloat16 truncation (the top 16 bits of the order-preserving image of float32), so that
    a selection compares scores to 8 significant bits and equal keys are ties. That makes the
    kernels' radix select exact in two 8-bit levels."""
    if not scores.is_floating_point():
        return scores.to(torch.int64)
    bits = scores.float().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits + 2**31, -1 - bits)  # two's complement: ~bits = -1 - bits
    return ordered >> 16


def _first(batch: int, start: torch.Tensor | None, device) -> torch.Tensor:
    """[B, 1, 1] int64: each row's first real position (0 without `start`)."""
    first = torch.zeros(batch, dtype=torch.int64, device=device) if start is None else start.to(device).long()
    return first[:, None, None]


def candidates(scores: torch.Tensor, pos: torch.Tensor, sink: int, local: int, mask: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache position [B,Hkv,N] int64, eligible [B,Hkv,N] bool) of each candidate `select_topk`
    ranks (same arguments): readable, at or before the query, outside the sink and local window,
    and scored (not -inf or NaN). The one definition, shared with the mass rule's totals."""
    B, Hkv, N = scores.shape
    dev = scores.device
    now, first = pos[-1].long(), _first(B, start, dev)
    cand = torch.arange(N, device=dev).expand(B, Hkv, N) if positions is None else positions.long()
    eligible = (cand >= first) & (cand <= now) & ~kept(cand, now, sink, local, first)
    if mask is not None:
        L = mask.shape[-1]
        eligible = eligible & torch.gather(valid_positions(mask, B, Hkv, L), 2, cand.clamp(0, L - 1))
    if scores.is_floating_point():
        eligible = eligible & (scores > float("-inf")) & ~scores.isnan()
    return cand, eligible


def choose(keys: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """bool [..., N]: the k best eligible entries of each row by integer key (all when fewer).

    Keys above the cut's key t are all taken. Of the T eligible keys equal to t, m are taken,
    spread evenly over them in row order: the j-th tie (j = 0..T-1) is taken when
    floor((j+1)·c / 2^32) > floor(j·c / 2^32), c = ceil(m·2^32 / T), which holds for exactly m of
    them. A rule that prefers no position: the later or the earlier ties would drop a whole region
    of the cache whenever a budget ends inside a run of equal Hamming scores (bench/NOTES.md,
    Signatures). Taken entries before row position i: the above ones plus floor(j·c / 2^32), so a
    kernel places each without a sort. Row order is candidate order, so choosing within a chosen
    set (`eligible` = that set) is how a pool is refined (select_nested). The choice for k is not
    always inside the one for k + 1 (5 ties: k = 2 takes ties 2 and 4, k = 3 takes 1, 3 and 4)."""
    keys, eligible = keys.long(), eligible.expand(keys.shape)  # (a mask shared by rows: counted per row)
    if keys.shape[-1] == 0:
        return eligible.clone()
    lowest = torch.iinfo(torch.int64).min
    masked = torch.where(eligible, keys, lowest)
    need = eligible.sum(-1, keepdim=True).clamp(max=k)
    kth = masked.topk(max(min(k, keys.shape[-1]), 1), dim=-1).values
    t = kth.gather(-1, (need - 1).clamp(min=0))
    above = eligible & (keys > t)
    tie = eligible & (keys == t) & (need > 0)
    m, T = need - above.sum(-1, keepdim=True), tie.sum(-1, keepdim=True)
    c = ((m << 32) + T - 1).div(T.clamp(min=1), rounding_mode="floor")
    j = tie.long().cumsum(-1) - 1
    return above | (tie & (((j + 1) * c) >> 32 > (j * c) >> 32))


def selection_mass(scores: torch.Tensor) -> torch.Tensor:
    """float64 masses as a selection ranks them: nonnegative scores truncated to bfloat16 (the value
    of their `selection_keys`), others 0. Sums of them are what the adaptive budget compares."""
    bits = torch.bitwise_and(scores.float().view(torch.int32), -65536).view(torch.float32)
    return torch.where(bits > 0, bits, 0.0).double()  # NaN compares false: 0


def trim_to_mass(taken: torch.Tensor, scores: torch.Tensor, eligible: torch.Tensor, p: float) -> torch.Tensor:
    """The adaptive budget (a plan's mass p < 1): bool [B,Hkv,N], of the `taken` candidates (the
    fixed budget's choice) the fewest, largest first by `selection_mass`, whose sum reaches p x the
    sum over every `eligible` candidate; the smallest mass so taken is the threshold and every taken
    candidate at or above it stays (ties included). All stay when even all fall short (no mass, or a
    budget too small for p). So the choice never holds a key the fixed budget would not take."""
    v = torch.where(eligible, selection_mass(scores), 0.0)
    goal = p * v.sum(-1, keepdim=True)
    ranked = torch.where(taken, v, 0.0).sort(-1, descending=True).values
    reach = ranked.cumsum(-1) >= goal
    reached = reach.any(-1, keepdim=True) & (goal > 0)
    t = ranked.gather(-1, reach.long().argmax(-1, keepdim=True))  # the first prefix to reach the goal
    return taken & (~reached | (v >= t))


def select_topk(scores: torch.Tensor, pos: torch.Tensor, k: int, sink: int, local: int, mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, start: torch.Tensor | None = None, mass: float = 1.0) -> torch.Tensor:
    """Choose the cache positions one decode query attends to, per KV head.

    scores [B,Hkv,N] (float or int, larger is better) rate candidates: candidate i is cache
    position i, or positions[..., i] when given ([B,Hkv,N], distinct, -1 = no candidate). pos [T]
    holds the positions written this step; pos[-1] is the query's own position. mask: SDPA's
    attn_mask [B|1,1|Hq,1,L] or None. start [B]: each row's first real position (left padding;
    None = 0), where its sink begins.

    Returns [B,Hkv, sink + local + k] int32: slots [0,sink) the sink start..start+sink-1, slots
    [sink, sink+local) the local window pos-local+1..pos, then the chosen candidates, then -1.
    Candidates are the readable positions after the sink and before the local window; the k
    best by `selection_keys` are chosen (`choose`: equal keys at the cut spread evenly over the
    tied candidates) and listed in candidate order. A position is never masked, never after
    pos[-1] and never repeated; -inf and NaN scores are never chosen. With mass < 1 the scores are
    attention masses and the chosen are trimmed to that share of the candidates' mass (`trim_to_mass`).
    """
    B, Hkv, N = scores.shape
    dev = scores.device
    now = pos[-1].long()
    first = _first(B, start, dev)
    window = torch.cat(
        [
            torch.arange(sink, device=dev).expand(B, 1, sink) + first,
            (now - local + 1 + torch.arange(local, device=dev)).expand(B, 1, local),
        ],
        dim=-1,
    ).expand(B, Hkv, sink + local)
    in_sink = torch.arange(sink + local, device=dev) < sink
    window_ok = (window >= 0) & (window <= now) & (in_sink | (window >= first + sink))
    if mask is not None:
        L = mask.shape[-1]
        window_ok = window_ok & torch.gather(valid_positions(mask, B, Hkv, L), 2, window.clamp(0, L - 1))
    cand, eligible = candidates(scores, pos, sink, local, mask, positions, start)
    window = torch.where(window_ok, window, -1)
    kk = min(k, N)
    taken = choose(selection_keys(scores), eligible, k)
    if mass < 1:
        taken = trim_to_mass(taken, scores, eligible, mass)
    slot = torch.where(taken, torch.arange(N, device=dev), N).sort(-1).values[..., :kk]  # candidate order; not-taken last
    chosen = torch.where(slot < N, torch.gather(cand, 2, slot.clamp(max=N - 1)), -1)
    if kk < k:
        chosen = torch.cat([chosen, chosen.new_full((B, Hkv, k - kk), -1)], dim=-1)
    return torch.cat([window, chosen], dim=-1).to(torch.int32)


def mass_select(q: torch.Tensor, k: torch.Tensor, scale: float | None, mask: torch.Tensor | None, positions: torch.Tensor,
                pos: torch.Tensor, budget: int, sink: int, local: int, start: torch.Tensor | None = None,
                mass: float = 1.0) -> torch.Tensor:
    """A Prism refined layer's selection: select_topk of the pool `positions` by mass_scores (with
    mass < 1, trimmed to that share of the pool's mass)."""
    return select_topk(mass_scores(q, k, scale, mask, positions), pos, budget, sink, local, mask, positions, start, mass)


def select_nested(scores: torch.Tensor, pos: torch.Tensor, k: int, k_inner: int, sink: int, local: int,
                  mask: torch.Tensor | None = None, start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prism's proposal selection: (select_topk of the best k, and select_topk of the best k_inner
    among those k by the same scores, with the chosen k as its candidate positions)."""
    outer = select_topk(scores, pos, k, sink, local, mask, None, start)
    pool = outer[..., sink + local:]
    at_pool = torch.gather(scores, 2, pool.clamp(min=0).long())
    return outer, select_topk(at_pool, pos, k_inner, sink, local, mask, pool, start)


def hash_select(q_logits: torch.Tensor, k_sig: torch.Tensor, pos: torch.Tensor, k: int, sink: int, local: int,
                mask: torch.Tensor | None = None, start: torch.Tensor | None = None) -> torch.Tensor:
    """HashAttention's decode selection in one op: the query logits [B,Hq,32W] signed and packed,
    scored by Hamming similarity against the key signatures [B,Hkv,L,W] (summed over each KV
    head's query heads), then `select_topk`. The kernels fuse scoring with the first selection pass."""
    return select_topk(hamming_scores(pack_signs(q_logits), k_sig), pos, k, sink, local, mask, None, start)


def hash_select_nested(q_logits: torch.Tensor, k_sig: torch.Tensor, pos: torch.Tensor, k: int, k_inner: int, sink: int,
                       local: int, mask: torch.Tensor | None = None,
                       start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """select_nested of the Hamming similarities `hash_select` ranks by."""
    return select_nested(hamming_scores(pack_signs(q_logits), k_sig), pos, k, k_inner, sink, local, mask, start)
