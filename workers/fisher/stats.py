"""The per-parameter stats of DESIGN.md section 2, derived from base moments.

Base moments (fisher, fisher_p, kbar_mu, kbar_p, policy_grad) are what the direction pass computes;
every reported stat is a cheap elementwise function of them, formed one tensor at a time so that no
more than the base moments are ever held for the whole model.

Along a response the sums over positions are kept (F = sum_t fisher, M = sum_t mean_shift, and the
sums of squares the uncentered and raw moments need), and rho is the ratio of sums.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from workers.fisher.position import PositionMoments

STATS = ("fisher", "uncentered", "raw", "mean_shift", "common", "rho", "policy_grad", "bound")
SIGNED_STATS = ("mean_shift", "common", "policy_grad")

Params = dict[str, torch.Tensor]


def _safe_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(den.dtype).tiny), torch.zeros_like(num))


@dataclass
class MomentSums:
    """Sums over positions of every base quantity (one position: the position's own values).

    Absent entries are zero by construction (e.g. mean shifts on-policy).
    """

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    sums: dict[str, Params] = field(default_factory=dict)
    positions: int = 0
    dtype: torch.dtype = torch.float32

    KEYS = ("fisher", "mean_shift", "mean_shift_sq", "kbar_mu_sq", "common", "common_sq", "fisher_p",
            "policy_grad", "bound")

    def add(self, m: PositionMoments) -> None:
        """Fold one position in (the caller may drop ``m`` afterwards)."""
        on_policy = m.kbar_mu is m.kbar_p
        self.dtype = m.hidden.dtype
        for name in self.names:
            kmu, kp, f = m.kbar_mu[name], m.kbar_p[name], m.fisher[name]
            self._add("fisher", name, f)
            if not on_policy:
                shift = kmu - kp
                self._add("mean_shift", name, shift)
                self._add("mean_shift_sq", name, shift.square())
                self._add("kbar_mu_sq", name, kmu.square())
                self._add("fisher_p", name, m.fisher_p[name])
            self._add("common", name, kp)
            self._add("common_sq", name, kp.square())
            if m.policy_grad is not None:
                assert m.reward_std is not None
                self._add("policy_grad", name, m.policy_grad[name])
                self._add("bound", name, m.reward_std * f.clamp_min(0).sqrt())
        self.positions += 1

    def _add(self, key: str, name: str, value: torch.Tensor) -> None:
        table = self.sums.setdefault(key, {})
        # the first position's tensors are taken as they are: callers hand over fresh moments
        table[name] = table[name] + value if name in table else value

    def _get(self, key: str, name: str) -> torch.Tensor | None:
        return self.sums.get(key, {}).get(name)

    @property
    def has_reward(self) -> bool:
        return "policy_grad" in self.sums

    def stat(self, stat: str, name: str) -> torch.Tensor:
        """One stat for one parameter tensor."""
        zero = torch.zeros(self.shapes[name], dtype=self.dtype)

        def get(key: str) -> torch.Tensor:
            value = self._get(key, name)
            return zero if value is None else value

        fisher = get("fisher")
        if stat == "fisher":
            return fisher
        if stat == "uncentered":
            return fisher + get("mean_shift_sq")
        if stat == "raw":
            kbar_mu_sq = self._get("kbar_mu_sq", name)
            return fisher + (get("common_sq") if kbar_mu_sq is None else kbar_mu_sq)
        if stat == "mean_shift":
            return get("mean_shift")
        if stat == "common":
            return get("common")
        if stat == "rho":
            fisher_p = self._get("fisher_p", name)
            fisher_p = fisher if fisher_p is None else fisher_p
            common_sq = get("common_sq")
            return _safe_ratio(common_sq, fisher_p + common_sq)
        if stat == "policy_grad":
            return get("policy_grad")
        if stat == "bound":
            return get("bound")
        raise KeyError(f"unknown stat {stat!r}; choose from {', '.join(STATS)}")

    def iter_stat(self, stat: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self.stat(stat, name)
