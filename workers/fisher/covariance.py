"""C_q: the covariance of the logit Jacobian's rows under a next-token distribution q.

For every parameter outside the LM head kappa_{i,a} = j_a^T u_i (j_a = w_a for a plain linear head,
g'(l_a) w_a after an elementwise logit map), so the token Fisher under q is u_i^T C_q u_i with
C_q = sum_a q_a (j_a - jbar)(j_a - jbar)^T. Its eigenvectors are the only output directions a
backward pass needs; its rank is at most (support of q) - 1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workers.fisher.logit_map import ROWS_PER_BLOCK, LogitJacobian


@dataclass
class OutputCovariance:
    """Eigen-decomposition of C_q (float64), descending; or of its part from q's most probable rows
    (``leading_rows_covariance``: ``rows_read`` set), a lower bound of C_q."""

    eigenvalues: torch.Tensor  # [d]
    eigenvectors: torch.Tensor  # [d, d], column j pairs with eigenvalues[j]
    mean_row: torch.Tensor  # [d] jbar = sum_a q_a j_a (over every row, whatever was read)
    support: int  # n = #{a: q_a > 0}
    # the rows the Gram product read, where not q's whole support: then the decomposition is C_S's
    rows_read: int | None = None
    rest_trace: float = 0.0  # trace(C_q) - trace(C_S): what the rows not read carry
    # a response's refining round and its exact pass each record the plans' one C_q: decomposed once
    _uncentered: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # where q draws fewer tokens than d: the centered rows sqrt(q_a) (j_a - jbar) [n, d], C_q = A^T A
    # (``_small_support_covariance``), from which the uncentered spectrum is an n + 1 one
    support_rows: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def whole(self) -> bool:
        """The decomposition is C_q's own (its spectrum, its rank)."""
        return self.rows_read is None

    @property
    def trace(self) -> float:
        """trace(C_q), whichever rows the decomposition read."""
        return float(self.eigenvalues.clamp_min(0).sum()) + self.rest_trace

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
        if self._uncentered is None:
            if self.support_rows is not None:  # B^T B with B = [A; wbar^T]: B B^T's spectrum, then zeros
                rows = torch.cat([self.support_rows, self.mean_row[None]])
                found = torch.linalg.eigvalsh(rows @ rows.T)
                padded = torch.cat([found, found.new_zeros(self.mean_row.numel() - found.numel())])
                self._uncentered = padded.sort(descending=True).values
            else:
                v = self.eigenvectors
                second = (v * self.eigenvalues) @ v.T + torch.outer(self.mean_row, self.mean_row)
                self._uncentered = torch.linalg.eigvalsh(second).flip(0)
        return self._uncentered


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
    mean_row = jacobian.combine(q)
    if sum(rows.numel() for rows, _ in blocks) < width:
        return _small_support_covariance(jacobian, q, mean_row)
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


def leading_rows_covariance(
    jacobian: LogitJacobian, q: torch.Tensor, rows: int, mean_row: torch.Tensor, row_norms: torch.Tensor
) -> OutputCovariance:
    """C_S = sum_{a in S} q_a (j_a - jbar)(j_a - jbar)^T over S, q's ``rows`` most probable tokens,
    centered at q's whole mean ``mean_row``; ``row_norms`` [V] float64: |w_a|^2 of the head's rows.

    C_q - C_S is the same sum over the other rows, positive semi-definite: so sum_{j<k} lambda_j v_j v_j^T
    of C_S is below C_q, its leading directions give a lower bound of the Fisher per parameter, and its
    eigenvalues are lower bounds of C_q's (Weyl). Its trace is completed to C_q's from the rest's sums
    (sum q_a |j_a|^2, sum q_a j_a: no Gram product), so a kept share is one of trace(C_q). Why: a response's
    first pass needs each position's leading directions only, and C_q's V d^2 Gram product was most of
    it on the policy (0.35 s per position on SmolLM2, 2048 rows: 0.01 s)."""
    index = torch.topk(q, rows).indices
    weights = q[index]
    picked = jacobian.rows(index)  # [rows, d]
    centered = (picked - mean_row) * weights.sqrt()[:, None]
    if rows < centered.shape[1]:
        eigenvalues, eigenvectors = _row_space_eigenpairs(centered)
    else:
        ascending, vectors = torch.linalg.eigh(centered.T @ centered)
        eigenvalues, eigenvectors = ascending.flip(0), vectors.flip(1)
    rest = q.clone()
    rest[index] = 0.0
    norms = row_norms if jacobian.scale is None else row_norms * jacobian.scale.square()
    rest_sum = mean_row - weights @ picked  # sum of q_a j_a over the rows not read
    rest_trace = (
        float(rest @ norms) - 2 * float(mean_row @ rest_sum) + float(rest.sum()) * float(mean_row @ mean_row)
    )
    return OutputCovariance(
        eigenvalues=eigenvalues,
        eigenvectors=eigenvectors,
        mean_row=mean_row,
        support=int((q > 0).sum()),
        rows_read=rows,
        rest_trace=max(rest_trace, 0.0),  # rounding below an exact zero
    )


def head_row_norms(weight: torch.Tensor) -> torch.Tensor:
    """|w_a|^2 of every head row, float64 [V], a block of rows at a time."""
    return torch.cat(
        [
            weight[lo : lo + ROWS_PER_BLOCK].to(torch.float64).square().sum(1)
            for lo in range(0, weight.shape[0], ROWS_PER_BLOCK)
        ]
    )


def mean_logit_row(jacobian: LogitJacobian, q: torch.Tensor) -> torch.Tensor:
    """jbar = sum_a q_a j_a [d] (float64) alone: what a first moment needs, without C_q's V d^2 Gram."""
    return jacobian.combine(q)


def mean_logit_rows(jacobians: Sequence[LogitJacobian], qs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``mean_logit_row`` of several positions at once ([n, d] float64), over one head: each block of its
    rows is made float64 once for all of them. Why: a response's positions under a full-support q (p,
    off the policy) each read the whole head, and its float64 copy per position was most of the cost."""
    weight = jacobians[0].weight
    pairs = zip(jacobians, qs, strict=True)
    coefficients = torch.stack([q if j.scale is None else q * j.scale for j, q in pairs])
    rows = torch.zeros(len(qs), weight.shape[1], dtype=torch.float64, device=weight.device)
    for lo in range(0, weight.shape[0], ROWS_PER_BLOCK):
        hi = lo + ROWS_PER_BLOCK
        rows.addmm_(coefficients[:, lo:hi], weight[lo:hi].to(torch.float64))
    return rows


def _small_support_covariance(
    jacobian: LogitJacobian, q: torch.Tensor, mean_row: torch.Tensor
) -> OutputCovariance:
    """C_q = A^T A for q's n < d support rows A = sqrt(q_a) (j_a - jbar), decomposed in A's row space.

    A^T = Q R (Q [d, d] orthogonal, R's first n rows R_n): C_q = Q_n (R_n R_n^T) Q_n^T, so the eigenpairs
    of the n x n R_n R_n^T give C_q's (eigenvectors Q_n U, orthonormal as Q and U are), and Q's other
    d - n columns complete the basis with eigenvalue zero. Why: a top-k sampler's C_q has rank below k,
    and the d x d eigendecompositions (C_q's and the uncentered spectrum's: 75-80 ms a position at
    d = 576, 370-380 ms at 1024, against 6-10 and 25-41 ms here) were most of a top-k position's plans,
    for eigenvalues that are zero but for rounding."""
    index = (q > 0).nonzero()[:, 0]
    rows = (jacobian.rows(index) - mean_row) * q[index].sqrt()[:, None]  # [n, d]
    eigenvalues, eigenvectors = _row_space_eigenpairs(rows)
    return OutputCovariance(
        eigenvalues=eigenvalues,
        eigenvectors=eigenvectors,
        mean_row=mean_row,
        support=rows.shape[0],
        support_rows=rows,
    )


def _row_space_eigenpairs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues [d] (descending) and eigenvectors [d, d] of A^T A for A = ``rows`` [n, d], n < d, from
    the n x n R_n R_n^T (``_small_support_covariance``)."""
    n, width = rows.shape
    basis, triangle = torch.linalg.qr(rows.T, mode="complete")
    eigenvalues, small = torch.linalg.eigh(triangle[:n] @ triangle[:n].T)
    values = torch.cat([eigenvalues, eigenvalues.new_zeros(width - n)])
    vectors = torch.cat([basis[:, :n] @ small, basis[:, n:]], 1)
    order = torch.argsort(values, descending=True, stable=True)  # zeros above a rounding's -1e-17
    return values[order], vectors[:, order]


def _support_blocks(q: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(row indices, weights) of q's support, ROWS_PER_BLOCK at a time."""
    support = q > 0
    index = support.nonzero()[:, 0]
    weights = q[support]
    return [
        (index[lo : lo + ROWS_PER_BLOCK], weights[lo : lo + ROWS_PER_BLOCK])
        for lo in range(0, index.numel(), ROWS_PER_BLOCK)
    ]
