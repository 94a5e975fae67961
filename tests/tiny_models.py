"""Tiny random Llamas in float64 for brute-force comparisons (sdpa attention, exact RMSNorm).

HF's LlamaRMSNorm computes in float32 even inside a float64 model, which would stall any comparison
near 1e-7; the tiny models swap it for one that keeps the input's dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


class ExactRMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _swap_norms(model: nn.Module) -> None:
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm"):
                setattr(module, child_name, ExactRMSNorm(child.weight, child.variance_epsilon))


def tiny_llama(
    tied: bool = True,
    vocab: int = 37,
    hidden: int = 16,
    layers: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # non-trivial norm weights so their sensitivities are tested
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.5)
    _swap_norms(model)
    return model.eval()


def tiny_qwen2(seed: int = 0, dtype: torch.dtype = torch.float64) -> Qwen2ForCausalLM:
    """A Llama-like model whose q/k/v projections carry biases: the engine must cover those too."""
    config = Qwen2Config(
        vocab_size=29,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)
    _swap_norms(model)
    return model.eval()
