"""HashAttention: 32-bit (or wider) learned or random key/query signatures, scored by Hamming
similarity summed over a KV head's query heads; the scan is fused into the selection."""

from __future__ import annotations

import operator

import torch

from ..lowering.reference import WORD_BITS
from ..runtime.caches import Spec
from ..runtime.encoders import apply_head_mlp
from . import OPS, Method, Selection, register


class Hash(Method):
    name = "hash"
    name_forms = "hash, hash-b<bits> (e.g. hash-b128)"
    name_option = ("b", "bits")
    description = "key/query bit signatures scored by Hamming similarity (HashAttention)"
    uses_encoders = True

    def plan_name(self, plan):
        return "hash" + (f"-b{plan.bits}" if plan.bits != 32 else "") + ("-learned" if plan.encoders else "")

    def describe(self, state):
        kind = "learned" if state.encoders.learned else "LSH, untrained"
        return f"{state.plan.name} ({kind} {state.plan.bits}-bit signatures)"

    def notices(self, state):
        if state.encoders.learned:
            return {}
        return {"lsh": "sparse_fx: hash is running untrained random signatures (LSH, about 90% of the oracle's "
                       "next-token agreement); train encoders with sparse_fx.train_signatures(model, tokenizer=...) "
                       "and pass them as compile(..., encoders=...)"}

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
