"""A stat that is an elementwise sum of stored arrays: ``base + extra`` or ``base + extra**2``.

Why a type of its own: the uncentered and raw Fisher are such sums (the Fisher plus a sum of squares, or
plus the square of a first moment at one position), and a pass over every coordinate (a histogram, a
selection) can read the stored arrays directly instead of forming a parameter-sized array first.
``formed`` is the one place the sum is computed as an array.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_EXTRA_TERM = "a stat without an extra term has no share of it"


@dataclass(frozen=True)
class StatTerms:
    base: torch.Tensor
    extra: torch.Tensor | None = None  # None: the stat is ``base`` itself
    squared: bool = False  # base + extra * extra

    def formed(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The stat as an array, written into ``out`` when given (``base`` itself when there is no extra)."""
        if self.extra is None:
            return self.base
        if self.squared:
            # the square rounded, then the sum: what the compiled loops compute (addcmul may fuse them)
            return torch.mul(self.extra, self.extra, out=out).add_(self.base)  # type: ignore[arg-type]
        return torch.add(self.base, self.extra, out=out)  # type: ignore[arg-type]

    def extra_share(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """extra_term / (base + extra_term), extra_term = extra (or extra^2), 0 where it is 0/0: the share
        of the stat that its extra term carries (rho is the common component's share of the raw Fisher)."""
        if self.extra is None:
            raise ValueError(NO_EXTRA_TERM)
        # extra / whole first (times extra again when squared): no overflow where whole is denormal
        whole = self.formed(out)
        ratio = torch.div(self.extra, whole, out=whole)
        if self.squared:
            ratio.mul_(self.extra)
        return ratio.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
