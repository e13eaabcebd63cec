"""sparse_fx.lowering: the custom ops, their torch references and their Triton kernels.

Imports nothing else of sparse_fx; the compiler pass inserts these ops, the runtime sizes their caches.
"""

from . import reference
from .ops import (
    few_query_attention,
    hamming_scores,
    hash_select,
    int2_scores,
    int2_write,
    mass_scores,
    pack_signs,
    select_topk,
    signature_write,
    sparse_decode_attention,
)

__all__ = [
    "reference",
    "few_query_attention",
    "hamming_scores",
    "hash_select",
    "int2_scores",
    "int2_write",
    "mass_scores",
    "pack_signs",
    "select_topk",
    "signature_write",
    "sparse_decode_attention",
]
