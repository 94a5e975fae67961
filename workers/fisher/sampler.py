"""The sampler mu: the distribution that draws the next token.

HF's order is temperature -> top-k -> top-p, then renormalize. The engine works in float64 so that
``mu == p`` holds exactly on-policy and truncation thresholds are not blurred by rounding.
"""

from __future__ import annotations

import torch

from backend.vocabulary import EngineKind, Sampler, SamplerKind


def model_distribution(logits: torch.Tensor) -> torch.Tensor:
    """p = softmax(z) in float64. logits: [V]."""
    return torch.softmax(logits.to(torch.float64), dim=-1)


def warped_distribution(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float
) -> torch.Tensor:
    """softmax after temperature, top-k and top-p, in HF's order (ties at the k-th logit are kept)."""
    z = logits.to(torch.float64) / temperature
    if top_k is not None and top_k < z.numel():
        kth = torch.topk(z, top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(z, dim=-1)
        order = torch.argsort(probs, descending=True, stable=True)
        sorted_probs = probs[order]
        mass_before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        # keep the smallest set whose total reaches top_p: a token stays if the mass before it is short
        keep_sorted = mass_before < top_p
        keep_sorted[0] = True
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        z = z.masked_fill(~keep, float("-inf"))
    return torch.softmax(z, dim=-1)


def one_hot_distribution(token_id: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    if not 0 <= token_id < vocab_size:
        raise ValueError(f"token id {token_id} is outside the vocabulary [0, {vocab_size})")
    mu = torch.zeros(vocab_size, dtype=torch.float64, device=device)
    mu[token_id] = 1.0
    return mu


def uniform_distribution(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.full((vocab_size,), 1.0 / vocab_size, dtype=torch.float64, device=device)


def sampler_distribution(
    config: Sampler,
    logits: torch.Tensor,
    engine_logits: torch.Tensor | None = None,
    target_id: int | None = None,
) -> torch.Tensor:
    """mu over the vocabulary for one position.

    logits: [V] the model's float32 logits. engine_logits: [V] logits of the bf16 engine (required
    when ``config.engine == bf16``). target_id: the response token at this position, used by the data
    sampler when no fixed data token is given.
    """
    vocab = logits.numel()
    if config.kind == SamplerKind.uniform:
        return uniform_distribution(vocab, logits.device)
    if config.kind == SamplerKind.data:
        token = config.data_token_id if config.data_token_id is not None else target_id
        if token is None:
            raise ValueError("the data sampler needs a data token or a continuation to be one-hot on")
        return one_hot_distribution(token, vocab, logits.device)
    if config.engine == EngineKind.bf16:
        if engine_logits is None:
            raise ValueError("the bf16 engine needs the bf16 logits")
        logits = engine_logits
    return warped_distribution(logits, config.temperature, config.top_k, config.top_p)


def entropy(q: torch.Tensor) -> float:
    nz = q[q > 0]
    return float(-(nz * nz.log()).sum())
