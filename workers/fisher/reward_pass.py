"""A new reward on an analysis already made: the policy gradient and its bound, without the Fisher.

Of every per-parameter moment only two depend on the reward r over next tokens (docs/design.md §2):
  policy_grad_i = sum_t Cov_mu_t(r, kappa_i) = sum_t g_t^T u_i, g_t = sum_a mu_a (r_a - rbar_t) j_a,
one backward direction per position, and
  bound_i = sum_t std_mu_t(r) sqrt(fisher_t,i),
a sum over positions of the reward's standard deviation times a reward-free array. So an analysis keeps
the parts of sqrt(fisher_t) its summaries read (``FisherRoots``: per tensor its sum, and its pooled
view), and the Fisher's top-q membership (``top_sets.levels_at``) for the overlap; a reward
change then costs one direction per position (``policy_gradient_pass``) instead of the whole analysis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from backend.vocabulary import Sampler
from workers.fisher.capture import CapturedForward
from workers.fisher.cpu_kernels import each_in_threads
from workers.fisher.directions import LinearGroup, backprop_directions
from workers.fisher.logit_map import logit_jacobian
from workers.fisher.pooling import pooled_view_and_total
from workers.fisher.position import HeadLayout, HeadTerms, PositionMoments, head_rows
from workers.fisher.response import SequenceForward
from workers.fisher.stats import square_total

Params = dict[str, torch.Tensor]


@dataclass
class FisherRoots:
    """Per position t, of sqrt(fisher_t) (clamped at 0, as the bound takes it): each tensor's sum and its
    pooled view on a ``grid`` of at most rows x cols blocks (the grid the analysis's views use)."""

    grid: tuple[int, int]
    totals: list[dict[str, float]] = field(default_factory=list)
    pooled: list[dict[str, np.ndarray]] = field(default_factory=list)
    any_fisher: bool = False  # some position's mu has two tokens or more (else every Fisher is 0)

    def observe(self, moments: PositionMoments) -> None:
        """One position's moments, before the running sums take them over."""
        self.any_fisher |= not moments.fisher_zero
        names = list(moments.fisher)

        def roots(name: str) -> tuple[dict, float]:  # read in one pass, the roots never formed
            return pooled_view_and_total(moments.fisher[name], *self.grid, root=True)

        found = each_in_threads(roots, names, [moments.fisher[name].numel() for name in names])
        self.totals.append({name: total for name, (_, total) in zip(names, found, strict=True)})
        self.pooled.append({name: view["values"] for name, (view, _) in zip(names, found, strict=True)})

    def bound_totals(self, stds: list[float], name: str) -> float:
        return sum(std * totals[name] for std, totals in zip(stds, self.totals, strict=True))

    def bound_view(self, stds: list[float], name: str) -> np.ndarray:
        out = np.zeros_like(self.pooled[0][name], dtype=np.float64)
        for std, pooled in zip(stds, self.pooled, strict=True):
            out += std * pooled[name].astype(np.float64)
        return out.astype(np.float32)


@dataclass
class RewardPosition:
    """What one position's summary reads of a reward: mu's mean and std of r, and the head rows' inputs."""

    p: torch.Tensor  # [V] float64
    mu: torch.Tensor  # [V] float64
    h: torch.Tensor  # [d]
    head_scale: torch.Tensor  # [V] float64
    reward_mean: float
    reward_std: float
    policy_grad_sq: float


@dataclass
class RewardPass:
    policy_grad: Params  # summed over positions, parameter-shaped
    positions: list[RewardPosition]


def policy_gradient_pass(
    model: nn.Module,
    prefix_ids: torch.Tensor,
    continuation_ids: torch.Tensor,
    sampler: Sampler,
    reward: torch.Tensor,
    engine_model: nn.Module | None = None,
    *,
    memory_budget_bytes: int,
    progress: Callable[[float], None] | None = None,
) -> RewardPass:
    """The policy gradient Cov_mu(r, kappa) at every position of ``analyze_sequence``'s, summed: the
    same logits, sampler and head closed form, with the reward's direction as the only backward."""
    layout = HeadLayout.of(model)
    forward = SequenceForward.run(model, prefix_ids, continuation_ids, sampler, engine_model)
    summed: Params = {}
    positions: list[RewardPosition] = []
    for t in range(forward.positions):
        p, mu = forward.distributions(t)
        capture = forward.capture(t)
        at, gradient = _position_gradient(
            layout, head_rows(model), capture, p, mu, reward, memory_budget_bytes
        )
        del capture
        for name, value in gradient.items():  # the first position's arrays become the sums
            if name in summed:
                summed[name].add_(value)
            else:
                summed[name] = value
        positions.append(at)
        if progress is not None:
            progress((t + 1) / forward.positions)
    return RewardPass(summed, positions)


def _position_gradient(
    layout: HeadLayout,
    rows: torch.Tensor,
    capture: CapturedForward,
    p: torch.Tensor,
    mu: torch.Tensor,
    reward: torch.Tensor,
    memory_budget_bytes: int,
) -> tuple[RewardPosition, Params]:
    """One position's policy gradient (parameter-shaped) and what its summary reads of the reward."""
    position = capture.length - 1
    h = capture.hidden[position].detach()
    jacobian = logit_jacobian(capture, position, rows)
    reward_mean = float(mu @ reward)
    centered = mu * (reward - reward_mean)
    reward_std = float((mu @ (reward - reward_mean).square()).sqrt())
    direction = LinearGroup("policy_grad", jacobian.combine(centered))
    results = backprop_directions(
        capture, position, [], [direction], [], memory_budget_bytes=memory_budget_bytes
    )
    head = HeadTerms(layout, h, jacobian.head_scale())
    gradient = head.first_moment(results.linears.get("policy_grad"), centered).dense()
    square = square_total(list(gradient.values()))
    at = RewardPosition(p, mu, h.to(torch.float64), jacobian.head_scale(), reward_mean, reward_std, square)
    return at, gradient
