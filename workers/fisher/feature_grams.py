"""The Gram matrices X X^T (float64) of a forward's recorded features, made once per array.

A first moment's or a Fisher's square total on a matrix use is sum(G * (D D^T)) with G = X X^T of the
use's recorded features (``first_moments.square_sums``, ``block_squares.SquareTotals``): r^2 (o + i)
per use instead of o i. Several uses read one array (q, k and v), and the positions of a response read
from one forward (``CapturedForward.at``) read the first rows of its arrays: the leading r x r block of
the whole array's Gram is a position's own. So a forward keeps one ``FeatureGrams`` that all its
positions share, and each array's Gram is made once for all of them (on SmolLM2, 16 tokens, they were
made again for every position and every statistic).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def memory_key(feature: torch.Tensor) -> tuple:
    """The memory a feature array is read from, whatever its number of rows: arrays with one key hold the
    same values in the rows they share (a context's first rows of a longer forward's array)."""
    return (feature.device, feature.dtype, feature.data_ptr(), feature.stride(), feature.shape[1:])


class FeatureGrams:
    """X X^T in float64 of feature arrays, by ``memory_key``: the Gram of an array's first r rows is read
    as the leading block of the longest one made. Each entry keeps its array, so that its memory is not
    given to another array while the Gram is kept."""

    def __init__(self) -> None:
        self._made: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # key -> (array, its Gram)

    def add(self, features: Iterable[torch.Tensor]) -> None:
        """Make the Grams of the arrays not covered yet (by one of as many rows or more), those of one
        shape in one batched product."""
        missing: dict[tuple, torch.Tensor] = {}
        for feature in features:
            key = memory_key(feature)
            rows = feature.shape[0]
            made = self._made.get(key)
            if made is not None and made[1].shape[0] >= rows:
                continue
            wanted = missing.get(key)
            if wanted is None or wanted.shape[0] < rows:
                missing[key] = feature
        by_shape: dict[tuple, list[tuple[tuple, torch.Tensor]]] = {}
        for key, feature in missing.items():
            by_shape.setdefault((feature.shape, feature.dtype, feature.device), []).append((key, feature))
        for group in by_shape.values():
            stacked = torch.stack([feature for _, feature in group]).double()
            for (key, feature), gram in zip(group, stacked @ stacked.transpose(1, 2), strict=True):
                self._made[key] = (feature, gram)

    def of(self, feature: torch.Tensor) -> torch.Tensor:
        """The Gram of ``feature`` (made by ``add``)."""
        rows = feature.shape[0]
        return self._made[memory_key(feature)][1][:rows, :rows]
