"""The sparse_fx operators, registered with torch.library as `triton_op`s (namespace `sparse_fx`).

Each op's body picks its implementation from the device: Triton kernels launched through
`wrap_triton` on CUDA (Inductor then emits their source into its generated code), the reference in
`reference.py` elsewhere. The body is also the op's fake implementation, so it touches shapes only.
See `reference.py` for the exact semantics and shapes of every op.
"""

import hashlib
import pathlib
from typing import Optional

import torch
from torch.library import triton_op

from . import reference as ref


def source_digest(*roots) -> str:
    """16 hex digits of sha256 over the .py files under the folders `roots` ('' where no source is
    on disk): what compile caches key on, so an edit of ours never replays an old graph."""
    try:
        source = b"".join(p.read_bytes() for p in sorted({f for r in roots for f in pathlib.Path(r).rglob("*.py")}))
    except OSError:
        return ""
    return hashlib.sha256(source).hexdigest()[:16] if source else ""


_DIGEST = source_digest(pathlib.Path(__file__).parent)
SOURCE_TAG = f"sparse_fx.lowering-{_DIGEST}" if _DIGEST else ""


def salt_compile_caches() -> None:
    """torch.compile's caches (AOTAutograd's, Inductor's FX graphs) key on the traced graph, where
    these ops are opaque calls: after an edit of an op's body, reference or kernels, a cached graph
    would replay the old code. So the hash of this package's source joins their cache key tag (at
    import, and again by our backend before each compile, should the tag have been reset)."""
    from torch.compiler import config

    if SOURCE_TAG and hasattr(config, "cache_key_tag") and SOURCE_TAG not in config.cache_key_tag:
        config.cache_key_tag = f"{config.cache_key_tag}+{SOURCE_TAG}" if config.cache_key_tag else SOURCE_TAG


salt_compile_caches()


def _kernels():
    """The Triton launchers, imported on first CUDA use (a CPU-only install may lack triton)."""
    from . import kernels

    return kernels


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"sparse_fx: {msg}")


def _check_gqa(q: torch.Tensor, k: torch.Tensor, what: str, one_query: bool = True) -> None:
    if one_query:
        _check(q.dim() == 4 and q.shape[2] == 1, f"{what}: q must be [B, Hq, 1, D] (one decode query), got {tuple(q.shape)}")
    else:
        _check(q.dim() == 4, f"{what}: q must be [B, Hq, T, D], got {tuple(q.shape)}")
    _check(k.dim() == 4, f"{what}: k must be [B, Hkv, L, D], got {tuple(k.shape)}")
    _check(q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3], f"{what}: q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    _check(q.shape[1] % k.shape[1] == 0, f"{what}: query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")


def _check_mask(mask: Optional[torch.Tensor], q: torch.Tensor, length: int, what: str) -> None:
    if mask is None:
        return
    ok = (
        mask.dim() == 4
        and mask.shape[0] in (1, q.shape[0])
        and mask.shape[1] in (1, q.shape[1])
        and mask.shape[2] == q.shape[2]
        and mask.shape[3] == length
    )
    _check(ok, f"{what}: mask must be [B|1, 1|Hq, T, L] = [{q.shape[0]}|1, 1|{q.shape[1]}, {q.shape[2]}, {length}], "
           f"got {tuple(mask.shape)}")
    _check(mask.dtype == torch.bool or mask.is_floating_point(), f"{what}: mask must be bool or float, got {mask.dtype}")


@triton_op("sparse_fx::sparse_decode_attention", mutates_args=())
def sparse_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Softmax attention of q [B,Hq,1,D] over the positions `indices` [B,Hkv,K] (-1 = empty) of
    k/v [B,Hkv,L,D]; query head h reads KV head h // (Hq // Hkv). Returns [B,Hq,1,Dv]."""
    _check_gqa(q, k, "sparse_decode_attention")
    _check(v.shape[:3] == k.shape[:3], f"sparse_decode_attention: v {tuple(v.shape)} must match k {tuple(k.shape)} in [B, Hkv, L]")
    _check(
        indices.dim() == 3 and indices.shape[:2] == k.shape[:2],
        f"sparse_decode_attention: indices must be [B, Hkv, K] = [{k.shape[0]}, {k.shape[1]}, K], got {tuple(indices.shape)}",
    )
    _check(not indices.is_floating_point(), f"sparse_decode_attention: indices must be integer, got {indices.dtype}")
    _check_mask(mask, q, k.shape[2], "sparse_decode_attention")
    if q.is_cuda and _kernels().sparse_decode_attention_supported(q, k, v, indices, scale, mask):
        return _kernels().sparse_decode_attention(q, k, v, indices, scale, mask)
    return ref.sparse_decode_attention(q, k, v, indices, scale, mask)


@triton_op("sparse_fx::few_query_attention", mutates_args=())
def few_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense softmax attention of q [B,Hq,T,D] (a few queries: a verify step) over every position of
    k/v [B,Hkv,L,D]; query head h reads KV head h // (Hq // Hkv). Returns [B,Hq,T,Dv]."""
    _check_gqa(q, k, "few_query_attention", one_query=False)
    _check(v.shape[:3] == k.shape[:3], f"few_query_attention: v {tuple(v.shape)} must match k {tuple(k.shape)} in [B, Hkv, L]")
    _check_mask(mask, q, k.shape[2], "few_query_attention")
    if q.is_cuda and _kernels().few_query_attention_supported(q, k, v, scale, mask):
        return _kernels().few_query_attention(q, k, v, scale, mask)
    return ref.few_query_attention(q, k, v, scale, mask)


@triton_op("sparse_fx::pack_signs", mutates_args=())
def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """[..., 32W] float -> [..., W] int32 sign bits (bit set iff x > 0)."""
    _check(x.shape[-1] % ref.WORD_BITS == 0, f"pack_signs: last dim must be a multiple of 32, got {x.shape[-1]}")
    if x.is_cuda and _kernels().pack_signs_supported(x):
        return _kernels().pack_signs(x)
    return ref.pack_signs(x)


@triton_op("sparse_fx::hamming_scores", mutates_args=())
def hamming_scores(q_sig: torch.Tensor, k_sig: torch.Tensor) -> torch.Tensor:
    """q_sig [B,Hq,W], k_sig [B,Hkv,L,W] -> [B,Hkv,L]: 32W - Hamming, summed over each KV head's query
    heads, in the narrowest integer type that holds the sum (reference.hamming_dtype)."""
    _check(q_sig.dim() == 3 and k_sig.dim() == 4, "hamming_scores: q_sig must be [B, Hq, W] and k_sig [B, Hkv, L, W]")
    _check(q_sig.shape[1] % k_sig.shape[1] == 0 and q_sig.shape[2] == k_sig.shape[3], "hamming_scores: head counts or words disagree")
    if k_sig.is_cuda and _kernels().hamming_scores_supported(q_sig, k_sig):
        return _kernels().hamming_scores(q_sig, k_sig)
    return ref.hamming_scores(q_sig, k_sig)


@triton_op("sparse_fx::signature_write", mutates_args={"cache"})
def signature_write(cache: torch.Tensor, logits: torch.Tensor, pos: torch.Tensor) -> None:
    """cache[:, :, pos] = pack_signs(logits): cache [B,H,L,W] int32, logits [B,H,T,32W], pos [T]."""
    _check(logits.shape[-1] == cache.shape[-1] * ref.WORD_BITS, "signature_write: logits width must be 32 x the cache's words")
    if cache.is_cuda and _kernels().signature_write_supported(cache, logits, pos):
        _kernels().signature_write(cache, logits, pos)
    else:
        ref.signature_write(cache, logits, pos)


def _check_int2(codes: torch.Tensor, params: torch.Tensor, D: int, what: str) -> None:
    _check(codes.dim() == params.dim() == 4 and codes.shape[:3] == params.shape[:3],
           f"{what}: codes [B, H, L, D/16] and params [B, H, L, 2M] must share B, H, L, got "
           f"{tuple(codes.shape)}, {tuple(params.shape)}")
    M2 = params.shape[-1]
    _check(M2 > 0 and M2 % 2 == 0 and D % (M2 // 2) == 0 and codes.shape[-1] * ref.INT2_CODES_PER_WORD == D,
           f"{what}: cache widths do not match the head dim {D} (codes {codes.shape[-1]} words of 16 channels, "
           f"params {M2} = 2 x groups)")


@triton_op("sparse_fx::int2_write", mutates_args={"codes", "params"})
def int2_write(codes: torch.Tensor, params: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> None:
    """Quantise k [B,H,T,D] to INT2 and write codes and params (scales, zeros) at positions pos [T]."""
    _check_int2(codes, params, k.shape[-1], "int2_write")
    if codes.is_cuda and _kernels().int2_write_supported(codes, params, k, pos):
        _kernels().int2_write(codes, params, k, pos)
    else:
        int2_write_reference(codes, params, k, pos)


@torch.library.custom_op("sparse_fx::int2_write_reference", mutates_args={"codes", "params"})
def int2_write_reference(codes: torch.Tensor, params: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> None:
    """reference.int2_write as an opaque call: traced into a compiled graph, its division and
    rounding would be re-expressed by the compiler (reciprocal multiplies, fused ops) and the codes
    would differ from the reference's in the last bit; here they cannot."""
    ref.int2_write(codes, params, k, pos)


@int2_write_reference.register_fake
def _(codes, params, k, pos) -> None:
    return None


@triton_op("sparse_fx::int2_scores", mutates_args=())
def int2_scores(
    q: torch.Tensor, codes: torch.Tensor, params: torch.Tensor, pos: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Prism INT2 scores float32: max over the group of <q, INT2 key>, [B,Hkv,L] for every slot or
    [B,Hkv,N] at the slots `positions` [B,Hkv,N] (-1 empty: -inf); with `pos`, -inf after pos[-1]."""
    _check(q.dim() == 4 and q.shape[2] == 1 and q.shape[1] % codes.shape[1] == 0, "int2_scores: q must be [B, Hq, 1, D] with Hq a multiple of Hkv")
    _check_int2(codes, params, q.shape[-1], "int2_scores")
    _check(positions is None or (positions.dim() == 3 and positions.shape[:2] == codes.shape[:2] and not positions.is_floating_point()),
           f"int2_scores: positions must be integer [B, Hkv, N] = [{codes.shape[0]}, {codes.shape[1]}, N], "
           f"got {None if positions is None else (tuple(positions.shape), positions.dtype)}")
    if q.is_cuda and _kernels().int2_scores_supported(q, codes, params, pos, positions):
        return _kernels().int2_scores(q, codes, params, pos, positions)
    return ref.int2_scores(q, codes, params, pos, positions)


@triton_op("sparse_fx::mass_scores", mutates_args=())
def mass_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: Optional[float] = None,
    mask: Optional[torch.Tensor] = None,
    positions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention mass per candidate [B,Hkv,N] float32 (all L slots, or `positions` [B,Hkv,N])."""
    _check_gqa(q, k, "mass_scores")
    _check_mask(mask, q, k.shape[2], "mass_scores")
    if q.is_cuda and _kernels().mass_scores_supported(q, k, scale, mask, positions):
        return _kernels().mass_scores(q, k, scale, mask, positions)
    return ref.mass_scores(q, k, scale, mask, positions)


def _check_select(pos: torch.Tensor, k: int, sink: int, local: int, batch: int, start: Optional[torch.Tensor], what: str) -> None:
    _check(k > 0 and sink >= 0 and local >= 0, f"{what}: need k > 0, sink >= 0, local >= 0 (got {k}, {sink}, {local})")
    _check(pos.dim() == 1 and pos.shape[0] >= 1, f"{what}: pos must be [T] positions, got {tuple(pos.shape)}")
    _check(start is None or tuple(start.shape) == (batch,), f"{what}: start must be [B] = [{batch}], got {None if start is None else tuple(start.shape)}")


def _check_hash(q_logits, k_sig, pos, k, sink, local, mask, start, what: str) -> None:
    _check(q_logits.dim() == 3 and k_sig.dim() == 4 and q_logits.shape[-1] == ref.WORD_BITS * k_sig.shape[-1],
           f"{what}: q_logits must be [B, Hq, 32W] and k_sig [B, Hkv, L, W], got {tuple(q_logits.shape)}, {tuple(k_sig.shape)}")
    _check(q_logits.shape[1] % k_sig.shape[1] == 0, f"{what}: query heads must be a multiple of KV heads")
    _check_select(pos, k, sink, local, k_sig.shape[0], start, what)
    _check_mask(mask, q_logits[:, :, None], k_sig.shape[2], what)


def _check_mass(mass: float, scores_float: bool, what: str) -> None:
    _check(0 < mass <= 1, f"{what}: mass must be in (0, 1] (the share of attention mass to keep), got {mass}")
    _check(mass == 1 or scores_float, f"{what}: mass < 1 needs float scores (attention masses)")


@triton_op("sparse_fx::select_topk", mutates_args=())
def select_topk(scores: torch.Tensor, pos: torch.Tensor, k: int, sink: int, local: int, mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None, start: Optional[torch.Tensor] = None, mass: float = 1.0) -> torch.Tensor:
    """[B,Hkv,sink+local+k] int32 positions: sink, local window, then the top-k candidates in candidate
    order (-1 empty); ties at the cut spread evenly over the tied candidates. start [B]: each row's first real position.
    mass < 1: the scores are attention masses; of the top-k keep the fewest holding that share of all candidates' mass."""
    _check_select(pos, k, sink, local, scores.shape[0], start, "select_topk")
    _check(positions is None or positions.shape == scores.shape, "select_topk: positions must have the shape of scores")
    _check_mass(mass, scores.is_floating_point(), "select_topk")
    if scores.is_cuda and _kernels().select_topk_supported(scores, pos, k, sink, local, mask, positions, start, mass):
        return _kernels().select_topk(scores, pos, k, sink, local, mask, positions, start, mass=mass)
    return ref.select_topk(scores, pos, k, sink, local, mask, positions, start, mass)


@triton_op("sparse_fx::select_nested", mutates_args=())
def select_nested(scores: torch.Tensor, pos: torch.Tensor, k: int, k_inner: int, sink: int, local: int,
                  mask: Optional[torch.Tensor] = None, start: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(select_topk of the best k, select_topk of the best k_inner <= k within them): a Prism
    proposal's pool and its own budget from one pass over the scores."""
    _check_select(pos, k, sink, local, scores.shape[0], start, "select_nested")
    _check(0 < k_inner <= k, f"select_nested: need 0 < k_inner <= k (got k_inner={k_inner}, k={k})")
    if scores.is_cuda and _kernels().select_topk_supported(scores, pos, k, sink, local, mask, None, start):
        return _kernels().select_topk(scores, pos, k, sink, local, mask, None, start, k_inner=k_inner)
    return ref.select_nested(scores, pos, k, k_inner, sink, local, mask, start)


@triton_op("sparse_fx::mass_select", mutates_args=())
def mass_select(q: torch.Tensor, k: torch.Tensor, scale: Optional[float], mask: Optional[torch.Tensor], positions: torch.Tensor,
                pos: torch.Tensor, budget: int, sink: int, local: int, start: Optional[torch.Tensor] = None,
                mass: float = 1.0) -> torch.Tensor:
    """select_topk of the pool `positions` [B,Hkv,N] by mass_scores (a Prism refined layer), the
    mass never written out; mass < 1 trims the choice to that share of the pool's mass."""
    _check_gqa(q, k, "mass_select")
    _check_mask(mask, q, k.shape[2], "mass_select")
    _check_select(pos, budget, sink, local, q.shape[0], start, "mass_select")
    _check(positions.dim() == 3 and positions.shape[:2] == k.shape[:2],
           f"mass_select: positions must be [B, Hkv, N] = [{k.shape[0]}, {k.shape[1]}, N], got {tuple(positions.shape)}")
    _check_mass(mass, True, "mass_select")
    if q.is_cuda and _kernels().mass_select_supported(q, k, scale, mask, positions, pos, budget, sink, local, start, mass):
        return _kernels().mass_select(q, k, scale, mask, positions, pos, budget, sink, local, start, mass=mass)
    return ref.mass_select(q, k, scale, mask, positions, pos, budget, sink, local, start, mass)


@triton_op("sparse_fx::hash_select", mutates_args=())
def hash_select(q_logits: torch.Tensor, k_sig: torch.Tensor, pos: torch.Tensor, k: int, sink: int, local: int,
                mask: Optional[torch.Tensor] = None, start: Optional[torch.Tensor] = None) -> torch.Tensor:
    """select_topk of the Hamming similarities of the signed query logits [B,Hq,32W] against the
    key signatures [B,Hkv,L,W] (HashAttention's decode selection, scoring fused into the select)."""
    _check_hash(q_logits, k_sig, pos, k, sink, local, mask, start, "hash_select")
    if k_sig.is_cuda and _kernels().hash_select_supported(q_logits, k_sig, pos, k, sink, local, mask, start):
        return _kernels().hash_select(q_logits, k_sig, pos, k, sink, local, mask, start)
    return ref.hash_select(q_logits, k_sig, pos, k, sink, local, mask, start)


@triton_op("sparse_fx::hash_select_nested", mutates_args=())
def hash_select_nested(q_logits: torch.Tensor, k_sig: torch.Tensor, pos: torch.Tensor, k: int, k_inner: int, sink: int,
                       local: int, mask: Optional[torch.Tensor] = None,
                       start: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hash_select's selection nested as select_nested's (a signature proposal's pool and budget)."""
    _check_hash(q_logits, k_sig, pos, k, sink, local, mask, start, "hash_select_nested")
    _check(0 < k_inner <= k, f"hash_select_nested: need 0 < k_inner <= k (got k_inner={k_inner}, k={k})")
    if k_sig.is_cuda and _kernels().hash_select_supported(q_logits, k_sig, pos, k, sink, local, mask, start):
        return _kernels().hash_select(q_logits, k_sig, pos, k, sink, local, mask, start, k_inner=k_inner)
    return ref.hash_select_nested(q_logits, k_sig, pos, k, k_inner, sink, local, mask, start)
