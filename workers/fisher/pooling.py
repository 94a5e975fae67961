"""Pooled views: block sums of a parameter tensor on a bounded grid, for heatmaps.

A 49152 x 576 embedding cannot travel to a browser; its block sums on at most 128 x 128 blocks can,
and sums (unlike means) stay comparable across tensors and add up to the tensor's total.
"""

from __future__ import annotations

import numpy as np
import torch


def block_edges(size: int, blocks: int) -> list[int]:
    blocks = max(1, min(blocks, size))
    return [round(i * size / blocks) for i in range(blocks + 1)]


def pooled_view(value: torch.Tensor, max_rows: int = 128, max_cols: int = 128) -> dict:
    """{"shape", "row_edges", "col_edges", "values"}: block sums; 1-D tensors become one row."""
    array = value.detach().to(torch.float64).numpy()
    if array.ndim == 1:
        array = array[None, :]
    elif array.ndim > 2:
        array = array.reshape(array.shape[0], -1)
    rows = block_edges(array.shape[0], max_rows)
    cols = block_edges(array.shape[1], max_cols)
    pooled = np.add.reduceat(np.add.reduceat(array, rows[:-1], axis=0), cols[:-1], axis=1)
    return {"shape": [len(rows) - 1, len(cols) - 1], "row_edges": rows, "col_edges": cols,
            "values": pooled.astype(np.float32)}
