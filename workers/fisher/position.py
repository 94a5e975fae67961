"""Every per-parameter moment at one position s, computed without one backward per token.

Outside the LM head kappa_{i,a} = w_a^T u_i, so
  fisher_i   = u_i^T C_mu u_i              (eigen-directions of C_mu, squared per layer),
  kbar^q_i   = wbar_q^T u_i                (one direction each: q = mu, q = p),
  policy_grad_i = g^T u_i, g = sum_a mu_a (r_a - rbar) w_a.
The LM head is closed form (kappa_{(c,k),a} = 1[a=c] h_k); a tied embedding adds its input-side
terms and the cross term 2 mu_c h_k (w_c - wbar)^T u_{(c,k)}.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workers.fisher.capture import (
    CapturedForward,
    UnsupportedArchitecture,
    capture_forward,
    model_part,
    module_weight,
)
from workers.fisher.covariance import OutputCovariance, output_covariance
from workers.fisher.directions import EmbeddingRowProbe, LinearGroup, SquareGroup, backprop_directions
from workers.fisher.methods import Method, SecondMomentPlan, second_moment_plan

Params = dict[str, torch.Tensor]


@dataclass
class PositionInputs:
    """What defines one position: the context ids and the distributions over its next token."""

    context_ids: torch.Tensor  # [t] long
    p: torch.Tensor  # [V] float64, the model's softmax
    mu: torch.Tensor  # [V] float64, the sampler
    reward: torch.Tensor | None  # [V] float64 reward over next tokens, or None
    on_policy: bool  # mu == p by construction (the sampler's config, not a float comparison)


@dataclass
class PositionMoments:
    """Base per-parameter moments at one position (name -> tensor shaped like the parameter).

    fisher: Var_mu[kappa]; fisher_p: Var_p[kappa] (the same dict on-policy); kbar_mu, kbar_p: mean
    sensitivities; policy_grad: Cov_mu(r, kappa) when a reward is given.
    """

    fisher: Params
    fisher_p: Params
    kbar_mu: Params
    kbar_p: Params
    policy_grad: Params | None
    hidden: torch.Tensor  # [d] h(s)
    cov_mu: OutputCovariance
    cov_p: OutputCovariance
    plan_mu: SecondMomentPlan
    reward_mean: float | None = None
    reward_std: float | None = None


@dataclass
class HeadLayout:
    """Where the LM head lives among the named parameters, and whether it is the input embedding."""

    head_name: str
    embedding_name: str
    tied: bool
    names: list[str]
    shapes: dict[str, tuple[int, ...]]

    @staticmethod
    def of(model: nn.Module) -> HeadLayout:
        head = model_part(model, "get_output_embeddings")
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise UnsupportedArchitecture("the LM head must be a bias-free nn.Linear (z = W h)")
        for attr in ("final_logit_softcapping", "logit_scale"):
            if getattr(model.config, attr, None) not in (None, 1, 1.0):
                raise UnsupportedArchitecture(f"models with {attr} are not supported")
        embedding = module_weight(model_part(model, "get_input_embeddings"))
        names, shapes = [], {}
        head_name = embedding_name = ""
        for name, param in model.named_parameters():
            names.append(name)
            shapes[name] = tuple(param.shape)
            if param is head.weight:
                head_name = name
            if param is embedding:
                embedding_name = name
        return HeadLayout(head_name, embedding_name, head.weight is embedding, names, shapes)


def head_rows(model: nn.Module) -> torch.Tensor:
    return module_weight(model_part(model, "get_output_embeddings")).detach()


def _head_term(coefficient: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """[V, d] = coefficient_c * h_k (first moments) — squares pass h*h."""
    return torch.outer(coefficient.to(h.dtype), h)


def position_moments(
    model: nn.Module,
    inputs: PositionInputs,
    method: Method,
    capture: CapturedForward | None = None,
    memory_budget_bytes: int = 1 << 30,
    progress: Callable[[float], None] | None = None,
) -> PositionMoments:
    layout = HeadLayout.of(model)
    capture = capture or capture_forward(model, inputs.context_ids)
    _check_coverage(capture, layout)
    position = capture.length - 1
    h = capture.hidden[position].detach()
    dtype = h.dtype
    head = head_rows(model)
    on_policy = inputs.on_policy
    prefix_tokens = sorted({int(t) for t in inputs.context_ids.tolist()}) if layout.tied else []

    cov_mu = output_covariance(head, inputs.mu)
    cov_p = cov_mu if on_policy else output_covariance(head, inputs.p)
    plan_mu = second_moment_plan(inputs.mu, cov_mu, head, prefix_tokens, method)
    plans = {"fisher": plan_mu}
    if not on_policy:
        plans["fisher_p"] = second_moment_plan(inputs.p, cov_p, head, prefix_tokens, method)

    squares = [SquareGroup(name, plan.vectors, plan.weights) for name, plan in plans.items()]
    linears = [LinearGroup("kbar_mu", cov_mu.mean_row)]
    if not on_policy:
        linears.append(LinearGroup("kbar_p", cov_p.mean_row))
    reward_mean = reward_std = None
    centered_reward = None
    if inputs.reward is not None:
        reward_mean = float(inputs.mu @ inputs.reward)
        centered_reward = inputs.reward - reward_mean
        reward_std = float((inputs.mu @ centered_reward.square()).sqrt())
        linears.append(LinearGroup("policy_grad", (inputs.mu * centered_reward) @ head.to(torch.float64)))
    probes = [
        EmbeddingRowProbe(f"{name}:{c}", c, vector)
        for name, plan in plans.items()
        for c, vector in plan.probes.items()
    ]
    results = backprop_directions(
        capture,
        position,
        squares,
        linears,
        probes,
        memory_budget_bytes=memory_budget_bytes,
        progress=progress,
    )

    def assemble(input_side: Params | None, head_value: torch.Tensor) -> Params:
        out: Params = {}
        for name in layout.names:
            value = (input_side or {}).get(name)
            value = (
                torch.zeros(layout.shapes[name], dtype=dtype, device=h.device)
                if value is None
                else value.to(dtype)
            )
            if name == layout.head_name:
                value = value + head_value
            out[name] = value
        return out

    hh = h * h
    second: dict[str, Params] = {}
    for name, plan in plans.items():
        params = assemble(results.squares.get(name), _head_term(plan.head_coefficient, hh))
        for c in plan.probes:  # tied cross term, rows of prefix tokens only
            row = results.probes.get(f"{name}:{c}")
            if row is not None:
                params[layout.head_name][c] += 2 * h * row.to(dtype)
        second[name] = params
    kbar_mu = assemble(results.linears.get("kbar_mu"), _head_term(inputs.mu, h))
    kbar_p = kbar_mu if on_policy else assemble(results.linears.get("kbar_p"), _head_term(inputs.p, h))
    policy_grad = None
    if centered_reward is not None:
        policy_grad = assemble(results.linears.get("policy_grad"), _head_term(inputs.mu * centered_reward, h))
    return PositionMoments(
        fisher=second["fisher"],
        fisher_p=second.get("fisher_p", second["fisher"]),
        kbar_mu=kbar_mu,
        kbar_p=kbar_p,
        policy_grad=policy_grad,
        hidden=h,
        cov_mu=cov_mu,
        cov_p=cov_p,
        plan_mu=plan_mu,
        reward_mean=reward_mean,
        reward_std=reward_std,
    )


def _check_coverage(capture: CapturedForward, layout: HeadLayout) -> None:
    seen: set[str] = {layout.head_name}
    for module in capture.modules:
        for suffix in ("weight", "bias"):
            if isinstance(getattr(module.module, suffix, None), torch.Tensor):
                name = f"{module.name}.{suffix}"
                if name in seen and name != layout.head_name:
                    raise UnsupportedArchitecture(f"module {module.name} runs more than once per forward")
                seen.add(name)
    missing = [n for n in layout.names if n not in seen]
    if missing:
        raise UnsupportedArchitecture(
            f"parameters outside linear/embedding/norm modules are not supported: {', '.join(missing[:5])}"
        )
