"""Brute-force references: one backward pass per vocabulary token, straight from the definitions.

kappa_{i,a} = d z_a / d theta_i for every token a, then every moment is an explicit sum over a.
Only for tiny models (cost V backward passes, memory V x P); the tests compare the fast engine to it
in float64, and the benchmark extrapolates its cost.

Many architectures cast to float32 inside their own code (HF's RMSNorm, Gemma's ``x.float()``, eager
attention's softmax), so a float64 model is float64 only where nobody casts. ``float64_throughout``
keeps those casts in float64 for both the engine and the reference: the same function, computed at
one precision, so the two can be compared at float64 tolerance without editing the model.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_NARROW = (torch.float32, torch.float16, torch.bfloat16)
_TensorBase = torch._C.TensorBase


class float64_throughout(TorchFunctionMode):  # noqa: N801  (used as a context manager)
    """Within the block, a cast of float64 data to a narrower float (``.float()``, ``.to(float32)``,
    ``dtype=float32`` next to a float64 tensor) stays float64. Constants built from nothing keep
    whatever dtype the model asks for; they are the same numbers for every computation compared."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        wide = any(
            isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in tree_leaves((args, kwargs))
        )
        if wide:
            if func in (_TensorBase.float, _TensorBase.half, _TensorBase.bfloat16):
                return args[0]
            args = tuple(torch.float64 if isinstance(a, torch.dtype) and a in _NARROW else a for a in args)
            if kwargs.get("dtype") in _NARROW:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


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
    """Every per-parameter stat of docs/design.md §2 from explicit sums over tokens."""
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
