"""HashAttention: 32-bit (or wider) learned or random key/query signatures, scored by Hamming
similarity summed over a KV head's query heads; the scan is fused into the selection."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..lowering.reference import WORD_BITS
from ..runtime.caches import Spec
from ..runtime.encoders import apply_head_mlp
from . import OPS, Method, Options, Selection, fail, register, require_int


@dataclass(frozen=True)
class SignatureOptions(Options):
    """bits: the signature width (LSH until trained encoders are given); encoders: the directory of
    trained signature encoders (`sparse_fx.train_signatures`), so that a plan file can carry them."""

    bits: int = 32
    encoders: str | None = None


def check_signature_options(o: SignatureOptions) -> None:
    require_int("bits", o.bits, 32)
    if o.bits % WORD_BITS:
        fail(f"bits must be a positive multiple of {WORD_BITS}, got {o.bits}")
    if o.encoders is not None and not isinstance(o.encoders, (str, Path)):
        fail(f"encoders must be a directory path, got {o.encoders!r}")


class Hash(Method):
    name = "hash"
    name_forms = "hash, hash-b<bits> (e.g. hash-b128)"
    name_option = ("b", "bits")
    description = "key/query bit signatures scored by Hamming similarity (HashAttention)"
    options = SignatureOptions

    def uses_encoders(self, plan):
        return True

    def validate(self, plan):
        check_signature_options(plan.options)

    def plan_name(self, plan):
        o = plan.options
        return "hash" + (f"-b{o.bits}" if o.bits != 32 else "") + ("-learned" if o.encoders else "")

    def describe(self, ctx):
        return f"{ctx.plan.name} ({signature_kind(ctx)} {ctx.plan.options.bits}-bit signatures)"

    def notices(self, ctx):
        return lsh_notice(ctx, "hash")

    def break_even(self, plan):
        return {8: 32768, 32: 16384, 128: 8192}  # measured at 32 bits; 8K is the shortest measured

    def side_cache(self, role, kv, plan):
        return signature_cache(plan) if role == "sparse" else {}

    def write(self, emit, ctx, layer, kv, side, new_keys, pos):
        write_signatures(emit, ctx, layer, kv, side, new_keys, pos)

    def select(self, emit, ctx, site):
        p = ctx.plan
        idx = emit.call(OPS.hash_select.default, query_logits(emit, ctx, site), site.side["signatures"], site.pos,
                        p.budget, p.sink, p.local, site.mask, site.start)
        return Selection(idx)


# ------------------------------------------------------------------------ shared with Prism's
# signature proposals
def signature_kind(ctx) -> str:
    return "learned" if ctx.learned else "LSH, untrained"


def lsh_notice(ctx, plan: str) -> dict[str, str]:
    if ctx.learned:
        return {}
    return {"lsh": f"sparse_fx: {plan} is running untrained random signatures (LSH, about 90% of the oracle's "
                   "next-token agreement for hash); train encoders with sparse_fx.train_signatures(model, "
                   "tokenizer=...) and pass them as compile(..., encoders=...)"}


def signature_cache(plan) -> dict[str, Spec]:
    return {"signatures": Spec((plan.options.bits // WORD_BITS,), torch.int32)}


def write_signatures(emit, ctx, layer, kv, side, new_keys, pos) -> None:
    """Sign the keys just stored (the layer's key encoder) into its signature cache."""
    enc = ctx.layer_encoders(layer, kv)
    logits = emit.call(apply_head_mlp, new_keys, *emit.tensors(f"l{layer}_kenc", enc.key.params()))
    emit.call(OPS.signature_write.default, side["signatures"], logits, pos)


def query_logits(emit, ctx, site):
    """The decode query through the layer's query encoder: [B, Hq, bits] floats (signs = signature)."""
    enc = ctx.layer_encoders(site.layer, site.kv, site.q_heads)
    q_logits = emit.call(apply_head_mlp, site.q, *emit.tensors(f"l{site.layer}_qenc", enc.query.params()))
    return emit.call(operator.getitem, q_logits, (slice(None), slice(None), 0))


register(Hash())
