"""The indices of a tensor's k largest values, or largest magnitudes, read once.

Definition: ``torch.topk(x.abs() if magnitude else x, k).indices``, NaN counted as the largest (as topk
counts it) and ties broken toward the lower index (topk's order among ties is its own). Why not topk: on
the CPU it took 15 ns per value (62 ms for 4M float32 values, one thread per call on a 2-core Xeon), the
mean shift's top coordinates of Qwen3-0.6B's shape several seconds of a summary. This keeps the k best
in a heap and compares each value with the least of them once. Tested against the sort in
tests/test_top_sets.py.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from workers.fisher.cpu_kernels.arrays import _flat
from workers.fisher.cpu_kernels.threads import _in_parts


@numba.njit(inline="always")
def _before(key_a, index_a, key_b, index_b):  # pragma: no cover - compiled
    # whether (key_a, index_a) ranks before (key_b, index_b): larger key, or the same and lower index
    return key_a > key_b or (key_a == key_b and index_a < index_b)


@numba.njit(inline="always")
def _key(v, magnitude):  # pragma: no cover - compiled
    key = abs(v) if magnitude else v
    return np.inf if key != key else key  # NaN ranks first, as in topk


@numba.njit(nogil=True, cache=True)
def _best_into(values, start, k, magnitude, keys, indices):  # pragma: no cover - compiled
    # keys/indices: a heap of the k best so far, its root the last of them in rank order; a value
    # enters only where it ranks before the root (in index order, a tie with the root never does)
    count = 0
    for i in range(values.size):
        key = _key(values[i], magnitude)
        index = start + i
        if count < k:
            j = count
            count += 1
            while j > 0:
                parent = (j - 1) // 2
                if not _before(keys[parent], indices[parent], key, index):
                    break
                keys[j], indices[j] = keys[parent], indices[parent]
                j = parent
            keys[j], indices[j] = key, index
        elif _before(key, index, keys[0], indices[0]):
            j = 0
            while True:
                child = 2 * j + 1
                if child >= k:
                    break
                right = child + 1  # the later ranked of the two children moves up
                if right < k and _before(keys[child], indices[child], keys[right], indices[right]):
                    child = right
                if not _before(key, index, keys[child], indices[child]):
                    break
                keys[j], indices[j] = keys[child], indices[child]
                j = child
            keys[j], indices[j] = key, index
    return count


def largest_indices(tensor: torch.Tensor, k: int, magnitude: bool) -> torch.Tensor:
    """Indices into ``tensor.reshape(-1)`` of its k largest values (``magnitude``: largest |values|),
    in rank order: each part's k best (a part per thread), then the best k of those."""
    values = _flat(tensor)
    k = min(k, values.size)
    if not k:
        return torch.empty(0, dtype=torch.int64)

    def best(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        keys, indices = np.empty(k, np.float64), np.empty(k, np.int64)
        count = _best_into(values[lo:hi], lo, min(k, hi - lo), magnitude, keys, indices)
        return keys[:count], indices[:count]

    found = _in_parts(values.size, best)
    keys = np.concatenate([part[0] for part in found])
    indices = np.concatenate([part[1] for part in found])
    order = np.lexsort((indices, -keys))[:k]  # larger key first, then the lower index
    return torch.from_numpy(indices[order])
