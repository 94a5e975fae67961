"""Draw a response y ~ mu token by token: the sequences the essays' statements are about.

Why the engine's own sampler rather than ``generate``: the response must come from exactly the mu
the analysis uses (temperature, top-k, top-p in HF's order, the bf16 engine's logits or the uniform
distribution, all in float64 by ``workers.fisher.sampler``), and the same seed must give the same ids
on every machine: draws use a seeded CPU generator on the float64 distribution moved to the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.vocabulary import SamplerKind
from workers.fisher.sampler import Sampler, sampler_distribution


@torch.no_grad()
def _next_logits(model: nn.Module, ids: torch.Tensor, past) -> tuple[torch.Tensor, object]:
    out = model(input_ids=ids[None], cache=past, use_cache=True)
    return out.logits[0, -1], out.cache


def sample_continuation(
    model: nn.Module,
    prefix_ids: torch.Tensor,
    sampler: Sampler,
    seed: int,
    max_tokens: int,
    stop_ids: set[int],
    engine_model: nn.Module | None = None,
) -> list[int]:
    """Up to ``max_tokens`` ids drawn from mu after ``prefix_ids`` [t]; stops after a stop id."""
    if sampler.kind == SamplerKind.data:
        raise ValueError("the data sampler is one-hot on given tokens: there is nothing to sample")
    generator = torch.Generator().manual_seed(seed)
    drawn: list[int] = []
    step, past, engine_past = prefix_ids, None, None
    for _ in range(max_tokens):
        logits, past = _next_logits(model, step, past)
        engine_logits = None
        if engine_model is not None:
            engine_logits, engine_past = _next_logits(engine_model, step, engine_past)
        mu = sampler_distribution(sampler, logits, engine_logits)
        token = int(torch.multinomial(mu.cpu(), 1, generator=generator))
        drawn.append(token)
        if token in stop_ids:
            break
        step = torch.tensor([token], device=prefix_ids.device)
    return drawn


def stop_ids(model) -> set[int]:
    """The model's end-of-sequence ids (config and generation config; int or list in either)."""
    found: set[int] = set()
    for config in (model.config, getattr(model, "generation_config", None)):
        value = getattr(config, "eos_token_id", None)
        found |= {int(v) for v in (value if isinstance(value, list) else [value]) if v is not None}
    return found
