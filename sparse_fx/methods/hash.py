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

    def uses_encoders(self, plan):
        return True

    def plan_name(self, plan):
        return "hash" + (f"-b{plan.bits}" if plan.bits != 32 else "") + ("-learned" if plan.encoders else "")

    def describe(self, state):
        return f"{state.plan.name} ({signature_kind(state)} {state.plan.bits}-bit signatures)"

    def notices(self, state):
        return lsh_notice(state, "hash")

    def break_even(self, plan):
        return {8: 32768, 32: 16384, 128: 8192}  # measured at 32 bits; 8K is the shortest measured

    def side_cache(self, role, kv, plan):
        return signature_cache(plan) if role == "sparse" else {}

    def write(self, emit, state, layer, kv, side, new_keys, pos):
        write_signatures(emit, state, layer, kv, side, new_keys, pos)

    def select(self, emit, state, site):
        p = state.plan
        idx = emit.call(OPS.hash_select.default, query_logits(emit, state, site), site.side["signatures"], site.pos,
                        p.budget, p.sink, p.local, site.mask, site.start)
        return Selection(idx)


# ------------------------------------------------------------------------ shared with Prism's
# signature proposals
def signature_kind(state) -> str:
    return "learned" if state.encoders.learned else "LSH, untrained"


def lsh_notice(state, plan: str) -> dict[str, str]:
    if state.encoders.learned:
        return {}
    return {"lsh": f"sparse_fx: {plan} is running untrained random signatures (LSH, about 90% of the oracle's "
                   "next-token agreement for hash); train encoders with sparse_fx.train_signatures(model, "
                   "tokenizer=...) and pass them as compile(..., encoders=...)"}


def signature_cache(plan) -> dict[str, Spec]:
    return {"signatures": Spec((plan.bits // WORD_BITS,), torch.int32)}


def write_signatures(emit, state, layer, kv, side, new_keys, pos) -> None:
    """Sign the keys just stored (the layer's key encoder) into its signature cache."""
    enc = state.layer_encoders(layer, kv)
    logits = emit.call(apply_head_mlp, new_keys, *emit.tensors(f"l{layer}_kenc", enc.key.params()))
    emit.call(OPS.signature_write.default, side["signatures"], logits, pos)


def query_logits(emit, state, site):
    """The decode query through the layer's query encoder: [B, Hq, bits] floats (signs = signature)."""
    enc = state.layer_encoders(site.layer, site.kv, site.q_heads)
    q_logits = emit.call(apply_head_mlp, site.q, *emit.tensors(f"l{site.layer}_qenc", enc.query.params()))
    return emit.call(operator.getitem, q_logits, (slice(None), slice(None), 0))


register(Hash())
