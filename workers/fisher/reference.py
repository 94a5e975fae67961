"""Brute-force references: one backward pass per vocabulary token, straight from the definitions.

kappa_{i,a} = d z_a / d theta_i for every token a, then every moment is an explicit sum over a.
Only for tiny models (cost V backward passes, memory V x P); the tests compare the fast engine to it
in float64, and the benchmark extrapolates its cost.
"""

from __future__ import annotations

import torch
from torch import nn

Params = dict[str, torch.Tensor]


def brute_force_logit_sensitivities(
    model: nn.Module, context_ids: torch.Tensor
) -> tuple[torch.Tensor, Params]:
    """(logits [V], {name: [V, *shape]}) with row a = d z_a / d theta at the last position."""
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    logits = model(input_ids=context_ids[None], use_cache=False).logits[0, -1]  # [V]
    rows: list[list[torch.Tensor]] = [[] for _ in names]
    for a in range(logits.numel()):
        grads = torch.autograd.grad(logits[a], params, retain_graph=True, allow_unused=True)
        for k, (g, p) in enumerate(zip(grads, params, strict=True)):
            rows[k].append(torch.zeros_like(p) if g is None else g)
    return logits.detach(), {n: torch.stack(r) for n, r in zip(names, rows, strict=True)}


def _weighted(q: torch.Tensor, kappa: torch.Tensor) -> torch.Tensor:
    """sum_a q_a kappa[a] for kappa [V, *shape]."""
    return torch.tensordot(q.to(kappa.dtype), kappa, dims=1)


def brute_force_moments(
    kappa: Params, p: torch.Tensor, mu: torch.Tensor, reward: torch.Tensor | None
) -> dict[str, Params]:
    """Every per-parameter stat of DESIGN.md section 2 from explicit sums over tokens."""
    out: dict[str, Params] = {s: {} for s in ("fisher", "uncentered", "raw", "mean_shift", "common", "rho")}
    if reward is not None:
        out["policy_grad"] = {}
        out["bound"] = {}
    for name, k in kappa.items():
        kbar_mu = _weighted(mu, k)
        kbar_p = _weighted(p, k)
        out["fisher"][name] = _weighted(mu, (k - kbar_mu).square())
        out["uncentered"][name] = _weighted(mu, (k - kbar_p).square())
        out["raw"][name] = _weighted(mu, k.square())
        out["mean_shift"][name] = kbar_mu - kbar_p
        out["common"][name] = kbar_p
        second_p = _weighted(p, k.square())
        ratio = kbar_p.square() / second_p
        out["rho"][name] = torch.where(second_p > 0, ratio, torch.zeros_like(ratio))
        if reward is not None:
            rbar = mu @ reward
            centered = (reward - rbar).to(k.dtype)
            out["policy_grad"][name] = _weighted(mu, centered.view(-1, *([1] * (k.dim() - 1))) * k)
            std = (mu @ (reward - rbar).square()).sqrt()
            out["bound"][name] = std.to(k.dtype) * out["fisher"][name].sqrt()
    return out
