"""Tiny random-initialised configs of decoder families that transformers ships (for tests)."""

from __future__ import annotations

import torch

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
