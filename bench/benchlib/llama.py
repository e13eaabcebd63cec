"""The model of the end-to-end benches (decode_speed.py, decode_tp.py, profile_step.py,
compile_time.py): the Llama-3.1-8B shape with random bf16 weights and a static cache of random
keys and values (decode speed depends on neither's values), SDPA with `enable_gqa` as the dense
baseline's attention, and the time of its decode steps."""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch

from .timing import compile_phases

LLAMA_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072 + 4096,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
)


# A Llama small enough for CPU smoke runs of the benches (same code paths, seconds not hours)
TINY = dict(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False)


def build_model(layers: int, device="cuda", **shape):
    """The Llama-3.1-8B shape with `layers` layers (and any other `shape` overrides), random bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_8B, "num_hidden_layers": layers, **shape})
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention function: SDPA with enable_gqa=True (no repeat_kv) even when a mask is given."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def random_static_cache(model, batch: int, filled: int, room: int, device="cuda"):
    """A StaticCache of max length filled + room whose first `filled` slots hold random K/V; sized
    as Hugging Face sizes it (a tensor-parallel rank's heads only)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=filled + room)
    cache.early_initialization(batch, *model._get_static_cache_init_shape(), torch.bfloat16, device)
    g = torch.Generator(device).manual_seed(0)
    for layer in cache.layers:
        layer.keys[:, :, :filled].normal_(generator=g)
        layer.values[:, :, :filled].normal_(generator=g)
        layer.cumulative_length.fill_(filled)
    return cache


SETTLE = 0.01  # warm-up windows go on until two in a row agree this closely (relative)
MAX_SETTLE = 5  # ... or this many have run


class Decoded(NamedTuple):
    """What `time_decode` measured."""

    step: float  # seconds a step: the median of the timed windows
    first: float  # seconds of the first call (a compile included)
    phases: dict  # torch.compile's phases in the first call
    windows: list  # seconds a step in each timed window
    settling: list  # seconds a step in each warm-up window, until two in a row agreed

    def windows_ms(self) -> dict:
        """The windows for a result row, ms a step: `windows_step_ms` (timed) and `settling_step_ms`."""
        return dict(windows_step_ms=[w * 1e3 for w in self.windows], settling_step_ms=[w * 1e3 for w in self.settling])


def time_decode(forward, cache, batch: int, steps: int, warmup: int, windows: int = 3) -> Decoded:
    """Single-token decode steps on the cache's device (CUDA events there; the wall clock on a CPU):
    the first call, `warmup - 1` more, then windows of `steps` steps until two in a row agree within
    SETTLE (the first timed window after a compile used to run 5% slow at batch 1: bench/NOTES.md),
    then `windows` timed windows, whose median is the step."""
    device = cache.layers[0].keys.device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ids = torch.randint(0, 128, (batch, 1), device=device)  # any tokens: the step's cost does not depend on them

    def window() -> float:
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            forward(ids, past_key_values=cache, use_cache=True).logits.argmax(-1)
        if not cuda:
            return (time.perf_counter() - t0) / steps
        end.record()
        sync()
        return start.elapsed_time(end) / 1e3 / steps

    with torch.no_grad():
        before = compile_phases()
        t0 = time.perf_counter()
        forward(ids, past_key_values=cache, use_cache=True)
        sync()
        first = time.perf_counter() - t0
        phases = compile_phases(since=before)
        for _ in range(warmup - 1):
            forward(ids, past_key_values=cache, use_cache=True)
        settling = [window()]
        while len(settling) < MAX_SETTLE:
            settling.append(window())
            if abs(settling[-1] - settling[-2]) <= SETTLE * settling[-2]:
                break
        timed = [window() for _ in range(windows)]
    return Decoded(statistics.median(timed), first, phases, timed, settling)
