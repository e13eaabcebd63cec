"""Random decode layers for the kernel benches (kernel_step.py, kernel_tuning.py): one shape's
queries, K/V caches, side caches written by our own ops, the mask a static cache passes, and the
dense SDPA step they are measured against; and the bytes a sparse step must read at the least."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from sparse_fx.lowering import ops as _ops  # noqa: F401  (registers torch.ops.sparse_fx)

OPS = torch.ops.sparse_fx
WRITE_CHUNK = 1 << 15  # positions per side-cache write while filling (bounds the temporaries)


class Layers:
    """`nl` distinct decode layers (so that replays do not find the last layer's data in L2) of
    batch B, cache length L, filled to `filled` (default L): q, k, v per layer, 32-bit LSH
    signatures and INT2 keys (group 32) of the filled positions, a bool mask and the query's
    position. `q_logits` also draws per layer [B, hq, 32] query signature logits. bf16 on CUDA,
    fp32 elsewhere (the CPU interpreter)."""

    def __init__(self, B: int, L: int, nl: int, dev: torch.device, hq: int, hkv: int, d: int,
                 filled: int | None = None, q_logits: bool = False):
        filled = L if filled is None else filled
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
        g = torch.Generator(device=dev).manual_seed(B * 7919 + L)
        self.B, self.L, self.filled, self.nl = B, L, filled, nl
        self.q = [torch.randn(B, hq, 1, d, generator=g, device=dev, dtype=dt) for _ in range(nl)]
        if q_logits:
            self.qlog = [torch.randn(B, hq, 32, generator=g, device=dev, dtype=dt) for _ in range(nl)]
        self.k = [torch.randn(B, hkv, L, d, generator=g, device=dev, dtype=dt) for _ in range(nl)]
        self.v = [torch.randn(B, hkv, L, d, generator=g, device=dev, dtype=dt) for _ in range(nl)]
        self.proj = torch.randn(d, 32, generator=g, device=dev, dtype=dt)  # LSH planes
        self.pos = torch.tensor([filled - 1], device=dev)
        self.mask = torch.zeros(B, 1, 1, L, dtype=torch.bool, device=dev)
        self.mask[..., :filled] = True
        self.sig, self.int2 = [], []
        for i in range(nl):
            sig = torch.zeros(B, hkv, L, 1, dtype=torch.int32, device=dev)
            codes = torch.zeros(B, hkv, L, d // 16, dtype=torch.int32, device=dev)
            params = torch.zeros(B, hkv, L, 2 * (d // 32), dtype=torch.float16, device=dev)
            for s in range(0, filled, WRITE_CHUNK):
                e = min(filled, s + WRITE_CHUNK)
                p = torch.arange(s, e, device=dev)
                OPS.signature_write(sig, self.k[i][:, :, s:e] @ self.proj, p)
                OPS.int2_write(codes, params, self.k[i][:, :, s:e], p)
            self.sig.append(sig)
            self.int2.append((codes, params))

    def dense(self) -> list[torch.Tensor]:
        """Dense decode attention of every layer over its whole cache (SDPA, GQA, unmasked; pick the
        backend with `sdpa_kernel`, or time every one with `dense_times`)."""
        return [F.scaled_dot_product_attention(self.q[i], self.k[i], self.v[i], enable_gqa=True) for i in range(self.nl)]

    def dense_times(self, time_fn, cpu: bool = False) -> dict[str, float]:
        """ms per layer of `dense` under each SDPA backend that takes the shape (flash, cudnn,
        efficient; math on the CPU), timed by time_fn(fn) -> ms. The backends differ at decode:
        in a compiled 128K decode step SDPA picked cuDNN at 467 us a layer where flash takes
        550-570 here (bench/NOTES.md), so a ratio against one backend alone can flatter us."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        out, want = {}, None
        for name in ("MATH",) if cpu else DENSE_BACKENDS:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                try:
                    got = self.dense()
                except RuntimeError:  # this backend does not take the shape, or is not built
                    continue
                # the first backend that runs is the reference (math would repeat K/V over the query
                # heads: tens of GB at 128K, batch 16); one that disagrees with it is not timed
                want = want or got
                if not all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(got, want)):
                    print(f"dense_times: SDPA {name} differs from {next(iter(out))} at B={self.B}, L={self.L}: not timed")
                    continue
                out[name.split("_")[0].lower()] = time_fn(self.dense) / self.nl
        if not out:
            raise RuntimeError(f"no SDPA backend of {DENSE_BACKENDS} runs dense decode attention at B={self.B}, L={self.L}")
        return out


DENSE_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")  # the dense baselines timed


def fastest(times: dict[str, float]) -> tuple[str, float]:
    """(backend, ms) of the fastest entry of `Layers.dense_times`: the benches' dense."""
    name = min(times, key=times.get)
    return name, times[name]


def int2_key_bytes(head_dim: int) -> int:
    """Bytes of a key's INT2 copy: 2-bit codes, an fp16 scale and zero per 32 channels (a 16-byte
    record at D = 128: one 32-byte sector of codes and one of params when gathered)."""
    return head_dim // 4 + 4 * (head_dim // 32)


def step_floor_bytes(plan: str, rows: int, filled: int, kept: int, pool: int, head_dim: int,
                     refined_kept: float | None = None) -> float:
    """Bytes one sparse layer's decode step must read at the least (prism-g<G>: the average over its
    group of one proposal and G - 1 refined layers): what its scores read — 32-bit signatures
    (hash, a prism-g4-hash proposal), INT2 codes with fp16 scale and zero per 32 channels (a prism-g4
    proposal), the pool's K rows (a refined layer; -int2refine: the pool's INT2 codes and scales) —
    and the `kept` selected K/V rows. rows: batch x KV heads; refined_kept: the rows a refined layer
    gathers, when an adaptive budget keeps fewer."""
    gathered = rows * kept * 2 * 2 * head_dim
    if plan == "hash":
        return rows * filled * 4 + gathered
    m = re.fullmatch(r"prism-g(\d+)(-hash)?(-int2refine)?", plan)
    if m is None:
        raise ValueError(f"step_floor_bytes: no bytes model for plan {plan!r} (hash, prism-g<G>[-hash][-int2refine])")
    group = int(m.group(1))
    int2 = int2_key_bytes(head_dim)
    scanned = 4 if m.group(2) else int2  # signatures, or INT2
    proposal = rows * filled * scanned + gathered
    rescored = int2 if m.group(3) else 2 * head_dim  # a pool key's INT2 copy, or its K row
    refined = rows * pool * rescored + (gathered if refined_kept is None else rows * refined_kept * 2 * 2 * head_dim)
    return (proposal + (group - 1) * refined) / group
