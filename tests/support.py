"""Helpers shared by the test modules (test modules never import each other): tiny models of every
decoder family, a toy decoder written in every SDPA call form, the op tests' devices, inputs and
poisoned allocations, contracts written out in plain Python, and small plan options.

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (small shapes: the
interpreter is slow); with CUDA the same op tests run on the GPU, plus the `gpu`-marked ones at real
shapes. Outputs and kernel scratch are poisoned (NaN / a sentinel) before the kernels write, so an
element a kernel forgets to write, or scratch it reads before writing, shows up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from hypothesis import HealthCheck, settings  # noqa: E402

from sparse_fx import Plan, methods  # noqa: E402
from sparse_fx.api import sparse_state  # noqa: E402
from sparse_fx.lowering import reference as ref  # noqa: E402
from sparse_fx.runtime.caches import KVShape  # noqa: E402
from sparse_fx.runtime.encoders import apply_head_mlp  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]  # the repository

# ---------------------------------------------------------------- op tests: devices, inputs, poison


CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]
SENTINEL = -777_777_777
FAST = settings(deadline=None, max_examples=8, suppress_health_check=list(HealthCheck))
MORE = settings(deadline=None, max_examples=25 if CUDA else 12, suppress_health_check=list(HealthCheck))
MASK_KINDS = ["none", "bool", "bool-head", "inf", "min", "inf-head"]


@contextlib.contextmanager
def poisoned():
    """torch.empty / empty_like hand out NaN- or sentinel-filled memory while the kernels allocate."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        elif t.dtype in (torch.int16, torch.int32, torch.int64):
            t.fill_(SENTINEL % 2**15 if t.dtype == torch.int16 else SENTINEL)
        elif t.dtype == torch.uint8:
            t.fill_(0xA5)
        return t

    torch.empty = lambda *a, **kw: fill(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: fill(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def make_mask(kind: str, B: int, Hq: int, L: int, g, dtype=torch.float32, now: int | None = None):
    """SDPA masks of every form the ops accept: None, bool [B,1,1,L], bool per head, additive with
    -inf, additive with finfo.min (Hugging Face's), per-head additive; small finite biases too."""
    if kind == "none":
        return None
    heads = Hq if kind.endswith("head") else 1
    keep = torch.rand(B, heads, 1, L, generator=g) > 0.25
    if now is not None:
        keep[..., now + 1 :] = False
    if kind.startswith("bool"):
        return keep.to(DEV)
    fill = float("-inf") if kind.startswith("inf") else torch.finfo(dtype).min
    m = torch.zeros(B, heads, 1, L).masked_fill(~keep, fill)
    m = m + 0.1 * torch.randn(B, heads, 1, L, generator=g) * keep
    return m.to(dtype).to(DEV)


# ---------------------------------------------------------------- decoder families


# family -> (config class name, model class name, extra config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": None}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    # forms with local layers: their sliding-window layers must stay dense, visibly
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8}),
    # chunked local layers (one in two here) beside global ones, and mixture-of-experts MLPs
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {"head_dim": 16, "attention_chunk_size": 8,
                                                         "no_rope_layer_interval": 2, "num_local_experts": 2,
                                                         "intermediate_size_mlp": 128}),
    # multi-head latent attention: the cache holds compressed latents; q/k heads 48 + 16 wide, v 32
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
        "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "num_key_value_heads": 4}),
}


def tiny_model(family: str, layers: int = 4, heads: int = 4, kv_heads: int = 2, seed: int = 0, **overrides):
    """A random-initialised eval-mode model of `family` with head dim 16, SDPA attention, fp32."""
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    fields = dict(
        vocab_size=128,
        hidden_size=heads * 16,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
    )
    fields.update(extra)
    fields.update(overrides)
    config_class = getattr(transformers, config_name)
    if not hasattr(config_class(), "num_key_value_heads"):
        del fields["num_key_value_heads"]  # e.g. GPT-NeoX: no GQA; a stray field would misstate the KV heads
    config = config_class(**fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()


# ---------------------------------------------------------------- a toy decoder in every call form


FORMS = ("repeat_kv", "enable_gqa", "aten", "repeat_interleave", "unsqueeze", "setitem")
MASKS = ("bool", "float_inf", "float_min", "none", "causal", "flat", "bias")


class ToyAttention(nn.Module):
    def __init__(self, hq: int, hkv: int, d: int, form: str, mask_form: str, dropout: float, scale):
        super().__init__()
        self.hq, self.hkv, self.d, self.form, self.mask_form, self.scale = hq, hkv, d, form, mask_form, scale
        self.dropout_on = dropout > 0  # a bool, so Dynamo specialises it (HF passes a literal 0.0 in eval)
        self.q = nn.Linear(hq * d, hq * d, bias=False)
        self.k = nn.Linear(hq * d, hkv * d, bias=False)
        self.v = nn.Linear(hq * d, hkv * d, bias=False)

    def forward(self, x, k_cache, v_cache, pos):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.hq, self.d).transpose(1, 2)
        k = self.k(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        v = self.v(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        if self.form == "setitem":
            k_cache[:, :, pos] = k
            v_cache[:, :, pos] = v
        else:
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
        L, G = k_cache.shape[2], self.hq // self.hkv
        mask = self._mask(pos, L, x.dtype)
        causal = self.mask_form == "causal"
        dropout = 0.1 if self.dropout_on else 0.0
        if self.form == "enable_gqa":
            return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=causal, scale=self.scale, enable_gqa=True)
        if self.form == "repeat_interleave":
            kk, vv = k_cache.repeat_interleave(G, dim=1), v_cache.repeat_interleave(G, dim=1)
        elif self.form == "unsqueeze":
            kk = k_cache.unsqueeze(2).expand(B, self.hkv, G, L, self.d).reshape(B, self.hq, L, self.d)
            vv = v_cache.unsqueeze(2).expand(B, self.hkv, G, L, self.d).reshape(B, self.hq, L, self.d)
        else:  # Hugging Face's repeat_kv
            kk = k_cache[:, :, None, :, :].expand(B, self.hkv, G, L, self.d).reshape(B, self.hq, L, self.d)
            vv = v_cache[:, :, None, :, :].expand(B, self.hkv, G, L, self.d).reshape(B, self.hq, L, self.d)
        if self.form == "aten":
            return torch.ops.aten.scaled_dot_product_attention(q, kk, vv, mask, dropout, causal, scale=self.scale)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.scale)

    def _mask(self, pos, L, dtype):
        if self.mask_form in ("none", "causal"):
            return None
        seen = torch.arange(L, device=pos.device)[None, None, None, :] <= pos[None, None, :, None]  # [1,1,T,L]
        if self.mask_form == "bool":
            return seen
        if self.mask_form == "flat":  # a 2-D mask: SDPA broadcasts it, the sparse path does not take it
            return seen[0, 0]
        neg = float("-inf") if self.mask_form == "float_inf" else torch.finfo(dtype).min
        out = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, neg)
        if self.mask_form == "bias":  # ALiBi-style additive bias on top of the causal mask
            out = out - 0.05 * (pos[None, None, :, None] - torch.arange(L)[None, None, None, :]).abs().to(dtype)
        return out


class ToyDecoder(nn.Module):
    """x [B, T, hidden], pos [T] -> [B, T, hidden]; owns a static KV cache per layer."""

    def __init__(self, layers=3, hq=4, hkv=2, d=16, batch=1, max_len=64, form="repeat_kv", mask="bool",
                 dropout=0.0, scale=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(num_hidden_layers=layers, model_type=f"toy-{form}-{mask}", head_dim=d)
        self.layers = nn.ModuleList(ToyAttention(hq, hkv, d, form, mask, dropout, scale) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(hq * d, hq * d) for _ in range(layers))
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.zeros(batch, hkv, max_len, d))
            self.register_buffer(f"v{i}", torch.zeros(batch, hkv, max_len, d))
        self.eval()

    def forward(self, x, pos):
        for i, (attn, proj) in enumerate(zip(self.layers, self.proj)):
            a = attn(x, getattr(self, f"k{i}"), getattr(self, f"v{i}"), pos)
            x = x + proj(a.transpose(1, 2).reshape(x.shape))
        return x

    def reset(self):
        for b in self.buffers():
            b.zero_()


# ---------------------------------------------------------------- plan options


def options_for(plan: str, **options) -> dict:
    """`options` without those the plan's method does not take (a method owns its options), so one
    set of small-shape options serves a parametrised list of plans."""
    method = methods.get(Plan.parse(plan).method)
    takes = {*Plan.__dataclass_fields__, *(f.name for f in dataclasses.fields(method.options))}
    return {k: v for k, v in options.items() if k in takes or k not in _plan_options()}


def _plan_options() -> set[str]:
    """Every plan option of any method (anything else, e.g. backend, passes through)."""
    return {*Plan.__dataclass_fields__, *(f.name for m in methods.registered() for f in dataclasses.fields(m.options))}


# ---------------------------------------------------------------- shared steps and contracts


def step_through(model, ids, prefill, cache):
    """Prefill, then decode one token at a time; after the first decode step nothing may recompile."""
    out = []
    with torch.no_grad():
        out.append(model(ids[:, :prefill], past_key_values=cache).logits)
        out.append(model(ids[:, prefill : prefill + 1], past_key_values=cache).logits)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t in range(prefill + 1, ids.shape[1]):
                out.append(model(ids[:, t : t + 1], past_key_values=cache).logits)
    return out


def assert_side_caches_match_the_keys(model, cache, n):
    """Every side-cache slot a selection may read (0..n-1) equals its recomputation from the stored keys."""
    state = sparse_state(model)
    for layer, role in enumerate(state.roles):
        keys = cache.layers[layer].keys
        specs = state.method.side_cache(role, KVShape.of(keys), state.plan)
        if not specs:
            assert state.side_caches.of_layer(layer) == []
            continue
        side = state.side_caches.layer(layer, KVShape.of(keys), specs)
        assert {"signatures", "codes"} & set(side), f"layer {layer}: {sorted(side)}"
        if "signatures" in side:
            enc = state.layer_encoders(layer, KVShape.of(keys))
            expect = ref.pack_signs(apply_head_mlp(keys[:, :, :n], *enc.key.params()))
            assert torch.equal(side["signatures"][:, :, :n], expect), f"layer {layer} signatures"
        if "codes" in side:
            c, prm = ref.int2_quantize(keys[:, :, :n], state.plan.options.int2_group)
            assert torch.equal(side["codes"][:, :, :n], c) and torch.equal(side["params"][:, :, :n], prm), f"layer {layer} INT2"


SMALL = dict(budget=6, sink=2, local=3, rho=2.0, int2_group=8)


def generate(model, ids, n, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                              **kwargs)


PREFILL, STEPS = 24, 6


def run(model, seed=1, steps=STEPS, hidden=64):
    """Prefill PREFILL tokens then decode `steps` single tokens; outputs of every call."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, PREFILL + steps, hidden, generator=g)
    outs = []
    with torch.no_grad():
        outs.append(model(x[:, :PREFILL], torch.arange(PREFILL)))
        for t in range(PREFILL, PREFILL + steps):
            outs.append(model(x[:, t : t + 1], torch.tensor([t])))
    return outs


COVER = dict(budget=40, sink=2, local=3)  # cover every filled slot (at most 30) but not the 64-slot cache


def select_contract(scores, pos, k, sink, local, mask=None, positions=None, start=None) -> torch.Tensor:
    """select_topk written out row by row in plain Python."""
    scores, pos = scores.cpu(), pos.cpu()
    B, Hkv, N = scores.shape
    now = int(pos[-1])
    readable = ref.valid_positions(None if mask is None else mask.cpu(), B, Hkv, mask.shape[-1] if mask is not None else N)
    out = torch.full((B, Hkv, sink + local + k), -1, dtype=torch.int32)
    for b in range(B):
        first = 0 if start is None else int(start[b])
        for h in range(Hkv):
            def ok(p):
                return 0 <= p <= now and (mask is None or bool(readable[b, h, p]))

            window = [first + j if ok(first + j) and first + j <= now else -1 for j in range(sink)]
            window += [p if ok(p) and p >= first + sink else -1 for p in range(now - local + 1, now + 1)]
            out[b, h, : sink + local] = torch.tensor(window, dtype=torch.int32)
            cands = []
            for i in range(N):
                p = i if positions is None else int(positions[b, h, i])
                s = scores[b, h, i].item()
                if p < first + sink or p > now - local or not ok(p):
                    continue
                if isinstance(s, float) and (s != s or s == float("-inf")):
                    continue
                cands.append((_key(s), i, p))
            chosen = [p for _, _, p in _spread_top(cands, k)]
            out[b, h, sink + local : sink + local + len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def _key(x) -> int:
    """The ranking key of one score, from the contract (not from the reference code)."""
    if isinstance(x, int):
        return x
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    ordered = bits | 0x80000000 if bits < 0x80000000 else bits ^ 0xFFFFFFFF
    return ordered >> 16


def _spread_top(cands, k):
    """The k best of (key, index, position) triples, in index order, ties spread evenly."""
    if not cands or k <= 0:
        return []
    need = min(k, len(cands))
    t = sorted((c[0] for c in cands), reverse=True)[need - 1]
    ties = sorted(c for c in cands if c[0] == t)  # same key: index order
    m = need - sum(c[0] > t for c in cands)
    taken = {ties[j][1] for j in range(len(ties)) if (j + 1) * m // len(ties) > j * m // len(ties)}
    return [c for c in sorted(cands, key=lambda c: c[1]) if c[0] > t or c[1] in taken]


TRAIN_SMALL = dict(context=400, queries=24, top=8, steps=60, batch_queries=8, batch_keys=200, lr=3e-3, seed=0)
