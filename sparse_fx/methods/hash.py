"""HashAttention: 32-bit (or wider) learned or random key/query signatures, scored by Hamming
similarity summed over a KV head's query heads; the scan is fused into the selection."""

from __future__ import annotations

import operator
import re

import torch

from ..runtime.caches import Spec
from ..runtime.encoders import apply_head_mlp
from . import OPS, Method, Selection, register

WORD_BITS = 32


class Hash(Method):
    name = "hash"
    name_forms = "hash, hash-b<bits> (e.g. hash-b128)"
    description = "key/query bit signatures scored by Hamming similarity (HashAttention)"

    def parse(self, text):
        m = re.fullmatch(r"hash(?:-b(\d+))?", text)
        if not m:
            return None
        return {"bits": int(m.group(1))} if m.group(1) else {}

    def plan_name(self, plan):
        return "hash" + (f"-b{plan.bits}" if plan.bits != 32 else "") + ("-learned" if plan.encoders else "")

    def describe(self, state):
        kind = "learned" if state.encoders.learned else "LSH, untrained"
        return f"{state.plan.name} ({kind} {state.plan.bits}-bit signatures)"

    def side_cache(self, role, kv, plan):
        return {"signatures": Spec((plan.bits // WORD_BITS,), torch.int32)} if role == "sparse" else {}

    def write(self, emit, state, layer, kv, side, new_keys, pos):
        enc = state.layer_encoders(layer, kv)
        logits = emit.call(apply_head_mlp, new_keys, *emit.tensors(f"l{layer}_kenc", enc.key.params()))
        emit.call(OPS.signature_write.default, side["signatures"], logits, pos)

    def select(self, emit, state, site):
        p = state.plan
        enc = state.layer_encoders(site.layer, site.kv, site.q_heads)
        q_logits = emit.call(apply_head_mlp, site.q, *emit.tensors(f"l{site.layer}_qenc", enc.query.params()))
        q_logits = emit.call(operator.getitem, q_logits, (slice(None), slice(None), 0))  # [B, Hq, bits]
        idx = emit.call(OPS.hash_select.default, q_logits, site.side["signatures"], site.pos, p.budget, p.sink,
                        p.local, site.mask, site.start)
        return Selection(idx)


register(Hash())
