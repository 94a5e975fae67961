"""Pooled views: block sums of a parameter tensor on a bounded grid, for heatmaps.

A 49152 x 576 embedding cannot travel to a browser; its block sums on at most 128 x 128 blocks can,
and sums (unlike means) stay comparable across tensors and add up to the tensor's total.
"""

from __future__ import annotations

import torch


def block_edges(size: int, blocks: int) -> list[int]:
    blocks = max(1, min(blocks, size))
    return [round(i * size / blocks) for i in range(blocks + 1)]


def pooled_view(value: torch.Tensor, max_rows: int = 128, max_cols: int = 128) -> dict:
    """{"shape", "row_edges", "col_edges", "values"}: block sums; 1-D tensors become one row."""
    array = value.detach().cpu()
    if array.dim() == 1:
        array = array[None, :]
    elif array.dim() > 2:
        array = array.reshape(array.shape[0], -1)
    rows = block_edges(array.shape[0], max_rows)
    cols = block_edges(array.shape[1], max_cols)
    row_block = torch.repeat_interleave(torch.arange(len(rows) - 1), torch.diff(torch.tensor(rows)))
    col_block = torch.repeat_interleave(torch.arange(len(cols) - 1), torch.diff(torch.tensor(cols)))
    by_rows = array.new_zeros(len(rows) - 1, array.shape[1], dtype=torch.float64)
    by_rows.index_add_(0, row_block, array.to(torch.float64))
    pooled = by_rows.new_zeros(len(rows) - 1, len(cols) - 1).index_add_(1, col_block, by_rows)
    return {
        "shape": [len(rows) - 1, len(cols) - 1],
        "row_edges": rows,
        "col_edges": cols,
        "values": pooled.to(torch.float32).numpy(),
    }
