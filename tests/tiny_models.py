"""Tiny random causal LMs of every family the engine promises, built from transformers' own classes.

Each model is the library's own module tree from its own config class: nothing is swapped or
patched. Weights are random, norm weights and biases included (a norm weight of ones or a bias of
zeros would hide a wrong form), and the special token ids are moved inside the tiny vocabulary (OPT
and Phi-3 look up ``padding_idx`` rows). Float64 comparisons run inside
``workers.fisher.reference.float64_throughout``, so the models' own float32 casts stay float64.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers as hf
from torch import nn

from backend.settings import Settings

BUDGET = Settings().engine_memory_bytes  # the configured workspace of the engine (backend.workspace)
VOCAB = 37
HIDDEN = 16
PAD_ID = 1  # inside the vocabulary, and used in a test prefix so padding rows are exercised

_DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 2 * HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": PAD_ID,
    "bos_token_id": 2,
    "eos_token_id": 3,
}


@dataclass(frozen=True)
class Family:
    """One architecture: its config and model classes, the config it needs, whether it can tie."""

    config: type
    model: type
    settings: dict = field(default_factory=dict)
    tied_options: tuple[bool, ...] = (True, False)


FAMILIES: dict[str, Family] = {
    "llama": Family(hf.LlamaConfig, hf.LlamaForCausalLM, {"rms_norm_eps": 1e-5}),
    "mistral": Family(hf.MistralConfig, hf.MistralForCausalLM, {"sliding_window": 4}),
    "qwen2": Family(hf.Qwen2Config, hf.Qwen2ForCausalLM),
    "qwen3": Family(hf.Qwen3Config, hf.Qwen3ForCausalLM, {"head_dim": 8}),
    "qwen3_moe": Family(
        hf.Qwen3MoeConfig,
        hf.Qwen3MoeForCausalLM,
        {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 12},
    ),
    "mixtral": Family(
        hf.MixtralConfig, hf.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}
    ),
    "gemma": Family(hf.GemmaConfig, hf.GemmaForCausalLM, {"head_dim": 8}),
    "gemma2": Family(
        hf.Gemma2Config,
        hf.Gemma2ForCausalLM,
        {"head_dim": 8, "final_logit_softcapping": 2.0, "attn_logit_softcapping": 5.0, "sliding_window": 4},
    ),
    "gemma3": Family(hf.Gemma3TextConfig, hf.Gemma3ForCausalLM, {"head_dim": 8, "sliding_window": 4}),
    "olmo2": Family(hf.Olmo2Config, hf.Olmo2ForCausalLM),
    "phi3": Family(hf.Phi3Config, hf.Phi3ForCausalLM),
    "gpt2": Family(
        hf.GPT2Config,
        hf.GPT2LMHeadModel,
        {"n_embd": HIDDEN, "n_layer": 2, "n_head": 4, "n_inner": 2 * HIDDEN, "n_positions": 64},
    ),
    "gpt_neox": Family(hf.GPTNeoXConfig, hf.GPTNeoXForCausalLM, {"rotary_pct": 0.5}),
    "opt": Family(hf.OPTConfig, hf.OPTForCausalLM, {"ffn_dim": 2 * HIDDEN, "word_embed_proj_dim": HIDDEN}),
    "falcon": Family(
        hf.FalconConfig, hf.FalconForCausalLM, {"bias": True, "new_decoder_architecture": False}
    ),
}

# transformers' eager expert loop: one F.linear per expert slice (the engine's fast form); the
# grouped_mm default computes the same function and would go through the generic autograd path
_LOAD_CHOICES = {"experts_implementation": "eager"}


def family_config(family: str, tied: bool, **overrides):
    spec = FAMILIES[family]
    settings = {**_DECODER, **spec.settings, "tie_word_embeddings": tied, **overrides}
    config = spec.config(**settings)
    config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return config


def randomize(model: nn.Module, seed: int) -> None:
    """Every parameter random: matrices N(0, 0.5^2), norm weights around their neutral value, biases."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param.dtype)
            if (
                param.dim() == 1
                and "norm" in name.lower()
                or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
            ):
                # (1 + w) norms (Gemma) are neutral at 0, the others at 1: either way not a no-op
                neutral = 0.0 if torch.all(param == 0) else 1.0
                param.copy_(neutral + 0.3 * noise)
            elif param.dim() == 1:
                param.copy_(0.3 * noise)
            else:
                param.copy_(0.5 * noise)


def tiny_model(
    family: str, tied: bool = False, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides
):
    """A tiny random ``family`` model from its own config class, in eval mode."""
    spec = FAMILIES[family]
    model = spec.model(family_config(family, tied, **overrides)).to(dtype)
    randomize(model, seed)
    tied_now = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied_now == tied, f"{family}: asked tied={tied}, built tied={tied_now}"
    return model.eval()


def tiny_llama(tied: bool = True, seed: int = 0, dtype: torch.dtype = torch.float64, **overrides):
    return tiny_model("llama", tied=tied, seed=seed, dtype=dtype, **overrides)


def tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float64):
    """A Llama-like model whose q/k/v projections carry biases."""
    return tiny_model("qwen2", tied=False, seed=seed, dtype=dtype)


def save_tiny_tokenizer(folder) -> None:
    """The tiny BPE tokenizer (vocab 512) beside a saved model, as ``fisherscope models add`` wants it."""
    from workers.models.fetch import TINY_SPECIAL_TOKEN, TINY_TOKENIZER_PATH

    special = {name: TINY_SPECIAL_TOKEN for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    hf.PreTrainedTokenizerFast(tokenizer_file=str(TINY_TOKENIZER_PATH), **special).save_pretrained(folder)
