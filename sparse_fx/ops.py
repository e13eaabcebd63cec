"""The sparse attention ops for direct use (torch.ops.sparse_fx.*); semantics in lowering/reference.py."""

from .lowering.ops import (
    hamming_scores,
    int2_scores,
    int2_write,
    mass_scores,
    pack_signs,
    select_topk,
    signature_write,
    sparse_decode_attention,
)

__all__ = [
    "hamming_scores",
    "int2_scores",
    "int2_write",
    "mass_scores",
    "pack_signs",
    "select_topk",
    "signature_write",
    "sparse_decode_attention",
]
