"""C_q: the covariance of the logit Jacobian's rows under a next-token distribution q.

For every parameter outside the LM head kappa_{i,a} = j_a^T u_i (j_a = w_a for a plain linear head,
g'(l_a) w_a after an elementwise logit map), so the token Fisher under q is u_i^T C_q u_i with
C_q = sum_a q_a (j_a - jbar)(j_a - jbar)^T. Its eigenvectors are the only output directions a
backward pass needs; its rank is at most (support of q) - 1.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from workers.fisher.logit_map import LogitJacobian


@dataclass
class OutputCovariance:
    """Eigen-decomposition of C_q (float64), descending."""

    eigenvalues: torch.Tensor  # [d]
    eigenvectors: torch.Tensor  # [d, d], column j pairs with eigenvalues[j]
    mean_row: torch.Tensor  # [d] jbar = sum_a q_a j_a
    support: int  # n = #{a: q_a > 0}

    @property
    def trace(self) -> float:
        return float(self.eigenvalues.clamp_min(0).sum())

    def numerical_rank(self) -> int:
        lam = self.eigenvalues
        top = float(lam[0]) if lam.numel() else 0.0
        if top <= 0:
            return 0
        tol = top * lam.numel() * torch.finfo(torch.float64).eps * 16
        return int((lam > tol).sum())

    def effective_rank(self) -> float:
        """exp of the entropy of lambda / sum lambda."""
        lam = self.eigenvalues.clamp_min(0)
        total = lam.sum()
        if total <= 0:
            return 0.0
        w = lam[lam > 0] / total
        return math.exp(float(-(w * w.log()).sum()))

    def participation_ratio(self) -> float:
        lam = self.eigenvalues.clamp_min(0)
        denom = float((lam * lam).sum())
        return float(lam.sum()) ** 2 / denom if denom > 0 else 0.0

    def uncentered_eigenvalues(self) -> torch.Tensor:
        """Spectrum of C_q + wbar wbar^T (the second moment without centering)."""
        v = self.eigenvectors
        second = (v * self.eigenvalues) @ v.T + torch.outer(self.mean_row, self.mean_row)
        return torch.linalg.eigvalsh(second).flip(0)


# float64 rows per block: a block stays in cache and nothing [V, d] is allocated (1024 was the fastest of
# 256 to 2048 on SmolLM2's head)
ROWS_PER_BLOCK = 1024
# column blocks of the Gram product's lower triangle: 4 do 10/16 of the full product's flops (a quarter
# less time on SmolLM2's head); more make each product too thin to gain
GRAM_COLUMN_BLOCKS = 4


def output_covariance(jacobian: LogitJacobian, q: torch.Tensor) -> OutputCovariance:
    """C_q for the rows of ``jacobian`` and a distribution ``q`` [V] (float64).

    Why float64 for the Gram product even for a float32 model: its rounding would put ~1e-7 x lambda_max
    of noise under every eigenvalue, and the numerical rank (the essays' rank of C_mu) would count it.
    Why in blocks of rows: two float64 copies of a [V, d] head (226 MB each on SmolLM2) cost more in
    first-touch page faults than the product itself.
    """
    blocks = _support_blocks(q)
    width = jacobian.weight.shape[1]
    mean_row = _mean_row(jacobian, blocks, q)
    cov = torch.zeros(width, width, dtype=torch.float64, device=q.device)
    edges = [width * k // GRAM_COLUMN_BLOCKS for k in range(GRAM_COLUMN_BLOCKS + 1)]
    for rows, w in blocks:
        centered = (jacobian.rows(rows) - mean_row) * w.sqrt()[:, None]
        for lo, hi in itertools.pairwise(edges):  # rows lo:hi of the lower triangle
            cov[lo:hi, :hi].addmm_(centered[:, lo:hi].T, centered[:, :hi])
    # eigh reads the lower triangle only; the strict upper one was never computed
    eigenvalues, eigenvectors = torch.linalg.eigh(cov, UPLO="L")
    return OutputCovariance(
        eigenvalues=eigenvalues.flip(0),
        eigenvectors=eigenvectors.flip(1),
        mean_row=mean_row,
        support=int((q > 0).sum()),
    )


def mean_logit_row(jacobian: LogitJacobian, q: torch.Tensor) -> torch.Tensor:
    """jbar = sum_a q_a j_a [d] (float64) alone: what a first moment needs, without C_q's V d^2 Gram."""
    return _mean_row(jacobian, _support_blocks(q), q)


def _support_blocks(q: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(row indices, weights) of q's support, ROWS_PER_BLOCK at a time."""
    support = q > 0
    index = support.nonzero()[:, 0]
    weights = q[support]
    return [
        (index[lo : lo + ROWS_PER_BLOCK], weights[lo : lo + ROWS_PER_BLOCK])
        for lo in range(0, index.numel(), ROWS_PER_BLOCK)
    ]


def _mean_row(
    jacobian: LogitJacobian, blocks: list[tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor
) -> torch.Tensor:
    mean_row = torch.zeros(jacobian.weight.shape[1], dtype=torch.float64, device=q.device)
    for rows, w in blocks:
        mean_row += w @ jacobian.rows(rows)
    return mean_row
