"""What the dashboard reads of one position: p and mu, the C_mu spectrum, the LM head's rows.

Every number a figure shows is formed here, by the engine, from the position's own tensors: the
output-layer row quantities follow exactly from mu, p, the reward, ||h||^2 and the logit map's
g'(l_c) (row c of the head has kappa_{(c,k),a} = 1[a=c] g'(l_c) h_k), so the frontend only draws.
Token texts come from a ``decode`` callable so this module stays free of tokenizers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from workers.fisher.response import PositionRecord
from workers.fisher.sampler import entropy

Decode = Callable[[int], str]
TOP_TOKENS = 20
BOUND_TOKENS = (1, 2, 5, 10, 20)


def token_entry(decode: Decode, token_id: int) -> dict:
    return {"id": int(token_id), "text": decode(int(token_id))}


def distribution_summary(q: torch.Tensor) -> dict:
    return {"entropy": entropy(q), "support": int((q > 0).sum()), "sum_sq": float(q.square().sum())}


class HeadRows:
    """Per-row sums over k of the LM head's closed forms at one position (row c, H = ||h||^2).

    fisher: g_c^2 H mu_c (1 - mu_c); fisher_p: the same under p (on-policy); shift_sq: g_c^2 H
    (mu_c - p_c)^2; policy_grad: the norm of the row's gradient |mu_c (r_c - rbar)| g_c ||h||; bound:
    std(r) sqrt(fisher), the norm of the row's Cauchy-Schwarz bound.
    """

    def __init__(
        self,
        h: torch.Tensor,
        head_scale: torch.Tensor,
        p: torch.Tensor,
        mu: torch.Tensor,
        reward: torch.Tensor | None = None,
        reward_mean: float | None = None,
        reward_std: float | None = None,
    ) -> None:
        self.h_sq = float(h.square().sum())
        self.head_scale, self.p, self.mu = head_scale, p, mu
        scale_sq = head_scale.square()  # [V] g'(l)^2
        self.fisher = self.h_sq * scale_sq * mu * (1 - mu)
        self.fisher_p = self.h_sq * scale_sq * p * (1 - p)
        self.shift_sq = self.h_sq * scale_sq * (mu - p).square()
        self.reward, self.reward_mean, self.reward_std = reward, reward_mean, reward_std
        self.total = float(self.fisher.sum())

    @staticmethod
    def of(record: PositionRecord, reward: torch.Tensor | None) -> HeadRows:
        return HeadRows(
            record.h, record.head_scale, record.p, record.mu, reward, record.reward_mean, record.reward_std
        )

    def entry(self, c: int) -> dict:
        out = {
            "row_fisher": float(self.fisher[c]),
            "row_fisher_p": float(self.fisher_p[c]),
            "row_shift_sq": float(self.shift_sq[c]),
        }
        out.update(self.reward_entry(c))
        return out

    def reward_entry(self, c: int) -> dict:
        """The row's policy gradient and bound; null without a reward."""
        if self.reward is None or self.reward_mean is None or self.reward_std is None:
            return {"row_policy_grad": None, "row_bound": None}
        centered = float(self.reward[c]) - self.reward_mean
        gradient = abs(float(self.mu[c]) * centered) * float(self.head_scale[c]) * math.sqrt(self.h_sq)
        return {
            "row_policy_grad": gradient,
            "row_bound": self.reward_std * math.sqrt(max(float(self.fisher[c]), 0.0)),
        }

    def concentration_bound(self) -> list[dict]:
        """Part 2, section 1: the share of the output-layer Fisher outside the m likeliest rows, against
        (mass outside) / (1 - sum mu^2). The bound is stated for a plain linear head (g' = 1)."""
        mu = self.mu
        order = torch.argsort(mu, descending=True)
        denominator = 1 - float(mu.square().sum())
        linear = bool((self.head_scale == 1).all())
        bounds = []
        for m in BOUND_TOKENS:
            inside = order[:m]
            kept = float(self.fisher[inside].sum())
            outside_mass = float(mu.sum() - mu[inside].sum())
            bounds.append(
                {
                    "top_tokens": m,
                    "share_outside": 1 - kept / self.total if self.total > 0 else 0.0,
                    "bound": outside_mass / denominator if denominator > 0 and linear else None,
                }
            )
        return bounds


def position_summary(record: PositionRecord, index: int, decode: Decode, reward: torch.Tensor | None) -> dict:
    p, mu = record.p, record.mu
    rows = HeadRows.of(record, reward)
    top = torch.topk(torch.maximum(p, mu), min(TOP_TOKENS, p.numel())).indices.tolist()
    top_rows = torch.topk(rows.fisher, min(TOP_TOKENS, p.numel())).indices.tolist()
    target = chi2 = None
    if record.target_id is not None:
        py = float(p[record.target_id])
        target = {**token_entry(decode, record.target_id), "p": py, "mu": float(mu[record.target_id])}
        chi2 = 1 / py - 1 if py > 0 else math.inf
    return {
        "index": index,
        "context_length": record.context_length,
        "target": target,
        "p": {
            "top": [
                {
                    **token_entry(decode, a),
                    "p": float(p[a]),
                    "mu": float(mu[a]),
                    "reward": float(reward[a]) if reward is not None else 0.0,
                    **rows.entry(a),
                }
                for a in top
            ],
            **distribution_summary(p),
        },
        "mu": distribution_summary(mu),
        "spectrum": _spectrum(record),
        "output_layer": {
            "h_norm_sq": rows.h_sq,
            "total": rows.total,
            "logit_map": not bool((record.head_scale == 1).all()),
            "rows": [
                {
                    **token_entry(decode, c),
                    "mu": float(mu[c]),
                    "fisher": float(rows.fisher[c]),
                    "share": float(rows.fisher[c]) / rows.total if rows.total > 0 else 0.0,
                }
                for c in top_rows
            ],
            "concentration_bound": rows.concentration_bound(),
        },
        "totals": record.moments_totals,
        "reward": None
        if record.reward_mean is None
        else {"mean": record.reward_mean, "std": record.reward_std},
        "chi2": chi2,
        "directions": record.directions,
        "kept_share": record.kept_share,
    }


def _spectrum(record: PositionRecord) -> dict | None:
    """C_mu's spectrum; None in a response's first partial where only its most probable rows were read."""
    spectrum = record.spectrum
    if spectrum is None:
        return None
    lam = spectrum.eigenvalues.clamp_min(0)
    return {
        "eigenvalues": lam.tolist(),
        "trace": float(lam.sum()),
        "numerical_rank": spectrum.numerical_rank,
        "effective_rank": spectrum.effective_rank,
        "participation_ratio": spectrum.participation_ratio,
        "rank_bound": max(record.support - 1, 0),
        "uncentered_eigenvalues": spectrum.uncentered_eigenvalues.clamp_min(0).tolist(),
    }
