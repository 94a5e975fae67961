"""Block sums of a stat (pooled views): the sum of each block of rows and columns of a tensor seen as a
matrix, in float64, from the stat's terms without forming it.

Definition (the torch path): ``pooling.block_sums_with_torch``, two index_add_ over the formed stat in
float64. Here one pass; the same sums bit for bit (tests/test_torch_path.py, tests/test_engine.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np

from workers.fisher.cpu_kernels.arrays import _extra_share, _slot
from workers.fisher.terms import NO_EXTRA_TERM, StatTerms

_SHARE = np.empty(0, np.bool_)  # ``_block_sums_into``'s switches (shares, roots): a value, where None is off


@numba.njit(nogil=True, cache=True, error_model="numpy")  # x / 0 is inf or nan, as in torch
def _block_sums_into(  # pragma: no cover - compiled
    a, a_plus, a_square, share, root, width, row_edges, col_edges, grid
):
    # A stat (a: base, + plus, + square * square; None: no such term; ``share`` not None: the extra
    # term's share of that sum instead, as ``StatTerms.extra_share`` rounds it; ``root`` not None: its
    # square root in its dtype, correctly rounded, 0 where it is negative) as rows of ``width`` values:
    # each row block's column sums in float64 (a loop over columns, which the compiler
    # vectorizes), then those sums per column block, in the order torch's index_add_ over rows and then
    # columns adds them. Views of each row indexed from 0 take vectors: a[at + j] kept the loop scalar
    # (three to five times slower, the same sums bit for bit)
    column = np.empty(width, np.float64)
    for rb in range(row_edges.size - 1):
        column[:] = 0.0
        for i in range(row_edges[rb], row_edges[rb + 1]):
            at = i * width
            row = a[at : at + width]
            if a_plus is not None:  # pruned where the argument is None
                plus = a_plus[at : at + width]
            if a_square is not None:
                square = a_square[at : at + width]
            for j in range(width):
                v = row[j]
                if a_plus is not None:
                    v = v + plus[j]
                if a_square is not None:
                    v = v + square[j] * square[j]
                if root is not None:
                    if v < 0:  # NaN stays NaN, as in clamp_min; a float32 zero keeps a float32 v float32
                        v = np.float32(0.0)
                    v = np.sqrt(v)
                if share is None:  # pruned: the argument's type decides
                    column[j] += np.float64(v)
                elif a_plus is not None:
                    column[j] += _extra_share(v, plus[j], False)
                elif a_square is not None:
                    column[j] += _extra_share(v, square[j], True)
        for cb in range(col_edges.size - 1):
            total = 0.0
            for j in range(col_edges[cb], col_edges[cb + 1]):
                total += column[j]
            grid[rb, cb] = total


def block_sums(
    terms: StatTerms,
    width: int,
    row_edges: Sequence[int],
    col_edges: Sequence[int],
    share: bool = False,
    root: bool = False,
) -> np.ndarray:
    """float64 [row blocks, column blocks]: the sums of a stat of CPU arrays (``StatTerms``, not formed;
    ``share``: its ``extra_share()``, rho's form; ``root``: its square root, clamped at 0 first and
    correctly rounded) seen as rows of ``width`` values over the blocks the edges give. One pass, one
    core: the caller runs tensors in threads."""
    if share and terms.extra is None:
        raise ValueError(NO_EXTRA_TERM)
    a, a_plus, a_square = _slot(terms)
    if a.size != (row_edges[-1] if len(row_edges) else 0) * width or (
        len(col_edges) and col_edges[-1] != width
    ):
        raise ValueError("the block edges do not cover the stat's rows and columns")
    grid = np.zeros((max(0, len(row_edges) - 1), max(0, len(col_edges) - 1)), np.float64)
    rows, cols = np.asarray(row_edges, np.int64), np.asarray(col_edges, np.int64)
    switches = (_SHARE if share else None, _SHARE if root else None)
    _block_sums_into(a, a_plus, a_square, *switches, width, rows, cols, grid)
    return grid
