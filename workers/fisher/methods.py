"""How the second moment under a distribution q is formed: exact, truncated, or Monte Carlo.

Each method turns C_q into a *plan*: hidden-space directions with weights (sum_j w_j (d(v_j^T h)/dtheta)^2
is the input-side Fisher), the per-row coefficient of the LM head's closed form (f_{(c,k)} = h_k^2 coef_c,
coef_c = g'(l_c)^2 q_c (1 - q_c) exactly), and, for tied embeddings, one probe direction per prefix
token for the cross term 2 g'(l_c) h_k * [d(probe_c^T h)/dE_{c,k}], probe_c = q_c (j_c - jbar).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.vocabulary import Method, MethodName
from workers.fisher.covariance import OutputCovariance
from workers.fisher.logit_map import LogitJacobian


@dataclass
class SecondMomentPlan:
    vectors: torch.Tensor  # [r, d] float64
    weights: torch.Tensor  # [r] float64
    head_coefficient: torch.Tensor  # [V] float64
    probes: dict[int, torch.Tensor]  # prefix token id -> [d] float64
    kept_share: float  # share of trace(C_q) the directions carry (1 for exact)
    missing_estimate: float  # estimated input-side Fisher the dropped directions would add, as a share
    # the vectors are an orthonormal basis of the whole hidden space (every eigenvector of a full-rank
    # C_q): any vector, a probe's included, is the sum of its coordinates on them
    complete_basis: bool = False
    # a plan cut to its leading directions (``leading``): its probes' rows are summed over the directions
    # kept, from their coordinates, whatever the basis
    probes_on_kept: bool = False

    def directions_reaching(self, share: float) -> int:
        """The fewest leading directions whose kept share (``leading``) is at least ``share`` (all of
        them where the plan as a whole keeps less)."""
        total = float(self.weights.sum())
        if total <= 0 or self.kept_share < share:
            return int(self.vectors.shape[0])
        reached = self.kept_share * torch.cumsum(self.weights, 0) / total >= share
        return int(reached.nonzero()[0, 0]) + 1 if bool(reached.any()) else int(self.vectors.shape[0])

    def leading(self, count: int) -> SecondMomentPlan:
        """The plan cut to its first ``count`` directions (the largest, for exact and truncated): what a
        first chunk of directions gives. A probe's row is summed over the directions kept, from its
        coordinates on them (``probes_on_kept``), as a partial result's is: the tied cross term of those
        directions, with no backward of its own (a probe per context token the sampler draws was half
        of a response's first pass under top-k)."""
        if count >= self.vectors.shape[0]:
            return self
        total = float(self.weights.sum())
        share = float(self.weights[:count].sum()) / total if total > 0 else 1.0
        kept_share = self.kept_share * share
        return SecondMomentPlan(
            vectors=self.vectors[:count],
            weights=self.weights[:count],
            head_coefficient=self.head_coefficient,
            probes=self.probes,
            kept_share=kept_share,
            missing_estimate=(1 - kept_share) / kept_share if kept_share > 0 else 0.0,
            complete_basis=self.complete_basis,
            probes_on_kept=True,
        )


def second_moment_plan(
    q: torch.Tensor,
    covariance: OutputCovariance,
    jacobian: LogitJacobian,
    prefix_tokens: list[int],
    method: Method,
) -> SecondMomentPlan:
    """q: [V] float64; prefix_tokens: table rows of the context with input-side gradient (tied only)."""
    if method.name == MethodName.mc:
        return _monte_carlo_plan(q, covariance, jacobian, prefix_tokens, method)
    rank = covariance.numerical_rank()
    lam = covariance.eigenvalues[:rank]
    keep = rank
    if method.name == MethodName.truncated and rank:
        assert method.fraction is not None
        share = torch.cumsum(lam, 0) / lam.sum()
        target = torch.tensor(method.fraction, dtype=share.dtype, device=share.device)
        keep = int(torch.searchsorted(share, target).item()) + 1
        keep = min(keep, rank)
    # of C_q's trace, where the decomposition is of the part its most probable rows make
    total = (float(lam.sum()) if rank else 0.0) + covariance.rest_trace
    kept_share = float(lam[:keep].sum()) / total if total > 0 else 1.0
    # rows q does not draw have no cross term (q_c = 0)
    probes = {c: q[c] * (jacobian.rows(c) - covariance.mean_row) for c in prefix_tokens if q[c] > 0}
    return SecondMomentPlan(
        vectors=covariance.eigenvectors[:, :keep].T.contiguous(),
        weights=lam[:keep].clone(),
        head_coefficient=jacobian.head_scale().square() * q * (1 - q),
        probes=probes,
        kept_share=kept_share,
        # assumes the dropped directions are seen like the kept ones, per unit of eigenvalue
        missing_estimate=(1 - kept_share) / kept_share if kept_share > 0 else 0.0,
        complete_basis=keep == covariance.eigenvectors.shape[0],
    )


def _monte_carlo_plan(
    q: torch.Tensor,
    covariance: OutputCovariance,
    jacobian: LogitJacobian,
    prefix_tokens: list[int],
    method: Method,
) -> SecondMomentPlan:
    """(1/S) sum_s (kappa_{a_s} - kbar^q)^2 with a_s ~ q: the sampled estimator used in practice."""
    assert method.samples is not None
    generator = torch.Generator(device=q.device).manual_seed(method.seed)
    samples = torch.multinomial(q, method.samples, replacement=True, generator=generator)
    deviations = jacobian.rows(samples) - covariance.mean_row  # [S, d]
    s = float(method.samples)
    counts = torch.bincount(samples, minlength=q.numel()).to(torch.float64)
    head_coefficient = jacobian.head_scale().square() * (counts * (1 - q) ** 2 + (s - counts) * q**2) / s
    probes = {}
    for c in prefix_tokens:
        indicator = (samples == c).to(torch.float64) - q[c]  # [S]
        probes[c] = indicator @ deviations / s
    return SecondMomentPlan(
        vectors=deviations,
        weights=torch.full((method.samples,), 1 / s, dtype=torch.float64, device=q.device),
        head_coefficient=head_coefficient,
        probes=probes,
        kept_share=1.0,
        missing_estimate=0.0,
    )
