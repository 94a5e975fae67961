"""The global top-q coordinates of a statistic: nested sets, one level per q, ties broken by index.

Why levels rather than one mask per q: the sets for q = 0.1% < 1% < 5% < 10% are nested, so one byte
per coordinate (0: in none, l: in the l-th smallest set and every larger one) holds them all. Two
analyses of the same parameters are compared set against set from these bytes (overlap, Jaccard:
``backend.compare``), and a Fisher mask for training is the level map cut at one q. Coordinates are
numbered in the order of ``names``, each tensor flattened; a set of density q holds exactly ceil(q P)
coordinates: all above the k-th largest value, and of those equal to it the ones with the smallest index.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from workers.fisher import cpu_kernels
from workers.fisher.concentration import Threshold, histogram, thresholds

Values = Callable[[], Iterator[torch.Tensor]]  # every tensor of the statistic, in order, when called


def top_q_levels(
    values: Values, total: int, fractions: Sequence[float], known: Sequence[float] | None = None
) -> tuple[torch.Tensor, list[Threshold]]:
    """uint8 [total]: level l (1-based, ``fractions`` ascending) for the coordinates in the top q_l set and
    not in a smaller one, 0 for the rest; and each set's threshold (the k-th largest value, exact).

    ``known``: the thresholds, when a concentration pass already found them (saves two passes). The
    values are non-negative (a Fisher, a magnitude); rounding-level negatives count as 0.
    """
    if known is None:
        named = thresholds(histogram(values()), values, fractions)
    else:
        named = [
            Threshold(max(1, math.ceil(q * total)), value, float("nan"))
            for q, value in zip(fractions, known, strict=True)
        ]
    ks, values_at = [t.k for t in named], [t.value for t in named]
    return cpu_kernels.nested_levels(values, total, ks, values_at), named
