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

from backend.vocabulary import STATS
from workers.fisher.position import PositionMoments

Params = dict[str, torch.Tensor]


def _safe_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, 0 where den is 0 (there 0 <= num <= den makes num 0 too: 0/0, no other case)."""
    return (num / den).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass
class MomentSums:
    """Sums over positions of every base quantity (one position: the position's own values).

    Absent entries are zero by construction (mean shifts on-policy, policy gradients without a
    reward). Sums of squares are only materialized from the second position on: for one position
    they are the squares of the first moments, and not storing them keeps two P-sized arrays free.
    """

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    sums: dict[str, Params] = field(default_factory=dict)
    positions: int = 0
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    _last_square: tuple[str, str, torch.Tensor] | None = field(default=None, repr=False)

    SQUARED = {"mean_shift_sq": "mean_shift", "common_sq": "common"}

    def add(self, m: PositionMoments) -> None:
        """Fold one position in (the caller may drop ``m`` afterwards)."""
        self._last_square = None
        on_policy = m.kbar_mu is m.kbar_p
        self.dtype = m.hidden.dtype
        self.device = m.hidden.device
        if self.positions == 1:
            self._materialize_squares()
        track_squares = self.positions >= 1
        for name in self.names:
            kmu, kp, f = m.kbar_mu[name], m.kbar_p[name], m.fisher[name]
            if not m.fisher_zero:  # a one-hot mu adds nothing: keep no P-sized zeros
                self._add("fisher", name, f)
            if not on_policy:
                shift = kmu - kp
                self._add("mean_shift", name, shift)
                self._add("fisher_p", name, m.fisher_p[name])
                if track_squares:
                    self._add("mean_shift_sq", name, shift.square())
                    self._add("kbar_mu_sq", name, kmu.square())
            self._add("common", name, kp)
            if track_squares:
                self._add("common_sq", name, kp.square())
            if m.policy_grad is not None:
                assert m.reward_std is not None
                self._add("policy_grad", name, m.policy_grad[name])
                if not m.fisher_zero:
                    self._add("bound", name, m.reward_std * f.clamp_min(0).sqrt())
        self.positions += 1

    def _materialize_squares(self) -> None:
        for name in self.names:
            for key, base in self.SQUARED.items():
                value = self._get(base, name)
                if value is not None:
                    self._add(key, name, value.square())
            shift = self._get("mean_shift", name)
            if shift is not None:
                self._add("kbar_mu_sq", name, (self.sums["common"][name] + shift).square())

    def _add(self, key: str, name: str, value: torch.Tensor) -> None:
        table = self.sums.setdefault(key, {})
        # the first position's tensors are taken as they are: callers hand over fresh moments
        table[name] = table[name] + value if name in table else value

    def _get(self, key: str, name: str) -> torch.Tensor | None:
        value = self.sums.get(key, {}).get(name)
        if value is None and self.positions == 1 and key in self.SQUARED:
            # formed on demand for one position; the last one is kept, as the stats of one tensor
            # (uncentered, raw, rho, their totals) ask for the same square several times in a row
            if self._last_square is not None and self._last_square[:2] == (key, name):
                return self._last_square[2]
            base = self.sums.get(self.SQUARED[key], {}).get(name)
            value = None if base is None else base.square()
            self._last_square = None if value is None else (key, name, value)
            return value
        if value is None and self.positions == 1 and key == "kbar_mu_sq" and "mean_shift" in self.sums:
            return (self.sums["common"][name] + self.sums["mean_shift"][name]).square()
        return value

    def _common_sq(self, name: str) -> torch.Tensor:
        value = self._get("common_sq", name)
        if value is None:  # every position adds the common component, so this means nothing was added
            raise ValueError("no position has been added")
        return value

    @property
    def has_reward(self) -> bool:
        return "policy_grad" in self.sums

    @property
    def has_mean_shift(self) -> bool:
        return "mean_shift" in self.sums

    def identically_zero(self, stat: str) -> bool:
        """True when a stat is zero by construction (no computation needed to know it)."""
        if stat == "mean_shift":
            return not self.has_mean_shift
        if stat == "policy_grad":
            return not self.has_reward
        if stat in ("fisher", "bound"):  # no position had a Fisher: every one had a one-hot mu
            return stat not in self.sums
        return False

    def alias(self, stat: str) -> str:
        """The stat this one equals exactly (uncentered is fisher on-policy)."""
        return "fisher" if stat == "uncentered" and not self.has_mean_shift else stat

    def stat(self, stat: str, name: str) -> torch.Tensor:
        """One stat for one parameter tensor."""
        if stat not in STATS:
            raise KeyError(f"unknown stat {stat!r}; choose from {', '.join(STATS)}")
        if self.identically_zero(stat):
            return self._zeros(name)
        fisher = self.sums["fisher"][name] if "fisher" in self.sums else self._zeros(name)
        if stat == "fisher":
            return fisher
        if stat == "uncentered":
            shift_sq = self._get("mean_shift_sq", name)
            return fisher if shift_sq is None else fisher + shift_sq
        if stat == "raw":
            kbar_mu_sq = self._get("kbar_mu_sq", name)
            return fisher + (self._common_sq(name) if kbar_mu_sq is None else kbar_mu_sq)
        if stat == "rho":
            fisher_p = self._get("fisher_p", name)
            fisher_p = fisher if fisher_p is None else fisher_p
            common_sq = self._common_sq(name)
            return _safe_ratio(common_sq, fisher_p + common_sq)
        return self.sums[stat][name]  # mean_shift, common, policy_grad, bound

    def _zeros(self, name: str) -> torch.Tensor:
        return torch.zeros(self.shapes[name], dtype=self.dtype, device=self.device)

    def iter_stat(self, stat: str) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names:
            yield name, self.stat(stat, name)
