"""Pooled views: block sums of a parameter tensor on a bounded grid, for heatmaps.

A 49152 x 576 embedding cannot travel to a browser; its block sums on at most 128 x 128 blocks can,
and sums (unlike means) stay comparable across tensors and add up to the tensor's total.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from workers.fisher import cpu_kernels
from workers.fisher.terms import StatTerms


@functools.cache
def block_edges(size: int, blocks: int) -> tuple[int, ...]:
    """Where the blocks of ``size`` start and end, at most ``blocks`` of them, sizes differing by one at
    most (cached: every view of every stat asks for the same few)."""
    blocks = max(1, min(blocks, size))
    return tuple(round(i * size / blocks) for i in range(blocks + 1))


def grid_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor as the matrix its view pools: 1-D as one row, more than 2-D as rows by dim 0."""
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def pooled_cells(shape: tuple[int, ...], max_rows: int, max_cols: int) -> int:
    """How many values a tensor's pooled view holds, known before it is pooled."""
    rows, cols = grid_shape(shape)
    return (len(block_edges(rows, max_rows)) - 1) * (len(block_edges(cols, max_cols)) - 1)


def pooled_bytes(shapes: Iterable[tuple[int, ...]], max_rows: int, max_cols: int, stats: int) -> int:
    """What the pooled views of ``stats`` stats of tensors of these shapes hold (float32 values)."""
    return 4 * stats * sum(pooled_cells(shape, max_rows, max_cols) for shape in shapes)


def pooled_grid(
    shapes: Sequence[tuple[int, ...]], max_rows: int, max_cols: int, max_bytes: int, stats: int
) -> tuple[int, int]:
    """The grid (rows, cols) halved until the views fit ``max_bytes``: a function of the shapes alone,
    so the views are pooled once, and the grid is known before the analysis runs."""
    while pooled_bytes(shapes, max_rows, max_cols, stats) > max_bytes and max_rows * max_cols > 4:
        max_rows, max_cols = max(1, max_rows // 2), max(1, max_cols // 2)
    return max_rows, max_cols


def pooled_view(
    value: torch.Tensor | StatTerms, max_rows: int = 128, max_cols: int = 128, share: bool = False
) -> dict:
    """{"shape", "row_edges", "col_edges", "values"}: float64 block sums, sent as float32.

    ``value``: the stat, or its terms (``StatTerms``), which on the CPU are read in one compiled pass
    without forming the stat (SmolLM2's views of every stat: 2.0 s with torch's float64 copy and two
    index_add_ per tensor). ``share``: the view of the terms' ``extra_share()`` (rho), formed the same
    way (SmolLM2's rho: 0.21 s formed by torch's ops first).
    """
    return pooled_view_and_total(value, max_rows, max_cols, share)[0]


def pooled_view_and_total(
    value: torch.Tensor | StatTerms,
    max_rows: int = 128,
    max_cols: int = 128,
    share: bool = False,
    root: bool = False,
) -> tuple[dict, float]:
    """``pooled_view`` and the tensor's total, the float64 sum of its block sums: one pass for both
    (a float64 ``sum`` of a float32 tensor besides took 0.6 s per response position on SmolLM2).
    ``root``: of the values' square roots, clamped at 0 first (``clamp_min(0).sqrt()``); on the CPU
    without forming them, each root correctly rounded (torch's vectorized one may differ in its last bit)."""
    terms = value if isinstance(value, StatTerms) else StatTerms(value.detach())
    rows, cols = grid_shape(tuple(terms.base.shape))
    row_edges, col_edges = block_edges(rows, max_rows), block_edges(cols, max_cols)
    if cpu_kernels.compiled_for(terms.base):
        pooled = cpu_kernels.block_sums(terms, cols, row_edges, col_edges, share, root)
    else:
        values = terms.extra_share() if share else terms.formed()
        values = values.clamp_min(0).sqrt() if root else values
        pooled = block_sums_with_torch(values.reshape(rows, cols), row_edges, col_edges).cpu().numpy()
    view = {
        "shape": list(pooled.shape),
        "row_edges": list(row_edges),
        "col_edges": list(col_edges),
        "values": pooled.astype(np.float32),
    }
    return view, float(pooled.sum())


def zero_view(shape: tuple[int, ...], max_rows: int = 128, max_cols: int = 128) -> dict:
    """The pooled view of a stat that is zero by construction, formed from the shape alone."""
    rows, cols = grid_shape(shape)
    row_edges, col_edges = block_edges(rows, max_rows), block_edges(cols, max_cols)
    return {
        "shape": [len(row_edges) - 1, len(col_edges) - 1],
        "row_edges": list(row_edges),
        "col_edges": list(col_edges),
        "values": np.zeros((len(row_edges) - 1, len(col_edges) - 1), dtype=np.float32),
    }


def block_sums_with_torch(matrix: torch.Tensor, row_edges, col_edges) -> torch.Tensor:
    """float64 block sums by torch's ops: the GPU's path (tested against the compiled one on the CPU)."""
    device = matrix.device
    row_block = torch.repeat_interleave(torch.arange(len(row_edges) - 1), torch.diff(torch.tensor(row_edges)))
    col_block = torch.repeat_interleave(torch.arange(len(col_edges) - 1), torch.diff(torch.tensor(col_edges)))
    by_rows = matrix.new_zeros(len(row_edges) - 1, matrix.shape[1], dtype=torch.float64)
    by_rows.index_add_(0, row_block.to(device), matrix.to(torch.float64))
    return by_rows.new_zeros(len(row_edges) - 1, len(col_edges) - 1).index_add_(
        1, col_block.to(device), by_rows
    )
