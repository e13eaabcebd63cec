"""Triton kernels for the sparse_fx ops (CUDA path; tested on CPU under TRITON_INTERPRET=1).

Each op has a launcher with the reference's signature (same outputs, dtypes, in-place writes) and a
`*_supported(...)` predicate over devices, shapes and dtypes only. `lowering/ops.py` calls the
launcher when the predicate accepts (CUDA tensors, or CPU tensors under the interpreter), else the
reference. Launchers use `torch.library.wrap_triton`, allocate with `torch.empty`, and size their
grids from shapes, so the ops trace under torch.compile and capture under CUDA graphs. Importing
the package also memoises torch's per-call-site analysis of the kernels (`access_memo`).
"""

from . import access_memo

from .few_query_attention import few_query_attention, few_query_attention_supported
from .gather_attention import sparse_decode_attention, sparse_decode_attention_supported
from .int2 import int2_scores, int2_scores_supported, int2_write, int2_write_supported
from .mass import mass_scores, mass_scores_supported
from .select import hash_select, hash_select_supported, mass_select, mass_select_supported, select_topk, select_topk_supported
from .signatures import (
    hamming_scores,
    hamming_scores_supported,
    pack_signs,
    pack_signs_supported,
    signature_write,
    signature_write_supported,
)

access_memo.install()

__all__ = [
    "few_query_attention",
    "few_query_attention_supported",
    "hash_select",
    "hash_select_supported",
    "hamming_scores",
    "hamming_scores_supported",
    "int2_scores",
    "int2_scores_supported",
    "int2_write",
    "int2_write_supported",
    "mass_scores",
    "mass_scores_supported",
    "mass_select",
    "mass_select_supported",
    "pack_signs",
    "pack_signs_supported",
    "select_topk",
    "select_topk_supported",
    "signature_write",
    "signature_write_supported",
    "sparse_decode_attention",
    "sparse_decode_attention_supported",
]
