"""The top-q level map: for nested sets of sizes k_1 < k_2 < ..., each coordinate's smallest set.

Definition (``workers.fisher.masks.top_q_levels``): a coordinate is in set l when its value exceeds the
l-th threshold, or equals it and is among the first ties (in index order) that complete k_l. Here two
passes where torch took about five per level. Tested in tests/test_fisher_identities.py and
tests/test_study.py.

``threshold_levels``: the map by thresholds alone (``workers.fisher.top_sets.levels_at``: a coordinate
at or above a set's threshold is in it, ties and all), one pass where torch's searchsorted and masks
took five (1.9 s of a SmolLM2 analysis's kept arrays for reward changes). Tested in tests/test_top_sets.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numba
import numpy as np
import torch

from workers.fisher.cpu_kernels.arrays import _flat
from workers.fisher.cpu_kernels.llvm import _AHEAD, _LINE_VALUES, _prefetch
from workers.fisher.cpu_kernels.threads import _in_parts

# where the first values equal to each threshold lie, kept per part by the strict pass: a set's ties
# are then placed without a pass of their own, unless more of them are needed than a part kept
TIES_KEPT = 64


@numba.njit(nogil=True, cache=True)
def _strict_levels_into(
    values, thresholds, levels, above, ties, tie_at, offset
):  # pragma: no cover - compiled
    lowest = thresholds[thresholds.size - 1]
    for i in range(values.size):
        if i % _LINE_VALUES == 0:
            _prefetch(values, i + _AHEAD)  # type: ignore[call-arg]
        v = max(values[i], 0.0)
        if v < lowest:  # in no set and tied with no threshold: most values, one comparison
            continue
        for level in range(thresholds.size):  # thresholds do not increase: the first one v exceeds
            if v > thresholds[level]:
                levels[i] = level + 1
                for larger in range(level, thresholds.size):
                    above[larger] += 1
                break
            if v == thresholds[level]:
                if ties[level] < tie_at.shape[1]:
                    tie_at[level, ties[level]] = offset + i
                ties[level] += 1


@numba.njit(nogil=True, cache=True)
def _threshold_levels_into(values, ascending, levels):  # pragma: no cover - compiled
    # how many thresholds v is at or above (all of them for NaN, where searchsorted puts it), as a level
    count = ascending.size
    for i in range(values.size):
        v = values[i]
        reached = count
        if v == v:
            reached = 0
            while reached < count and ascending[reached] <= v:
                reached += 1
        levels[i] = 0 if reached == 0 or v <= 0 else count + 1 - reached


def threshold_levels(values: torch.Tensor, ascending: torch.Tensor) -> torch.Tensor:
    """uint8 shaped like ``values`` (on the CPU): ``top_sets.levels_at`` of the thresholds ``ascending``
    (in the values' dtype, as that compares them), in one pass cut into parts per thread."""
    flat = _flat(values)
    thresholds = _flat(ascending)  # widened with the values where they are bfloat16: the same order
    levels = np.empty(flat.size, np.uint8)
    _in_parts(flat.size, lambda lo, hi: _threshold_levels_into(flat[lo:hi], thresholds, levels[lo:hi]))
    return torch.from_numpy(levels).reshape(values.shape)


@numba.njit(nogil=True, cache=True)
def _tie_levels_into(values, thresholds, levels, remaining):  # pragma: no cover - compiled
    left = remaining.sum()
    for i in range(values.size):
        v = max(values[i], 0.0)
        for level in range(thresholds.size):
            if remaining[level] > 0 and v == thresholds[level]:
                remaining[level] -= 1
                left -= 1
                if levels[i] == 0 or levels[i] > level + 1:  # the smallest set it is in
                    levels[i] = level + 1
        if left == 0:
            return


def nested_levels(
    chunks: Callable[[], Iterator[torch.Tensor]], total: int, ks: list[int], values: list[float]
) -> torch.Tensor:
    """uint8 [total]: ``workers.fisher.masks.top_q_levels``'s level map from its thresholds (``values``,
    not increasing) and set sizes ``ks``: one compiled pass, which also notes where the first values
    tied with each threshold lie, and a second one (read only as far as the ties that complete each
    set) only where a set needs more ties than were noted. The map lives on the CPU whatever the
    chunks' device: GPU chunks are read there."""
    thresholds = np.asarray(values, np.float64)
    levels = np.zeros(total, np.uint8)
    if not ks:  # no set: every coordinate is outside all of them (the strict pass reads the last threshold)
        return torch.from_numpy(levels)
    above = np.zeros(len(ks), np.int64)
    parts: list[tuple[np.ndarray, np.ndarray]] = []  # (ties, where the first ones lie), in index order
    offset = 0
    for chunk in chunks():
        flat, mine = _flat(chunk.cpu()), levels[offset : offset + chunk.numel()]

        def part(lo: int, hi: int, flat=flat, mine=mine, offset=offset) -> tuple:
            counts, ties = np.zeros(len(ks), np.int64), np.zeros(len(ks), np.int64)
            tie_at = np.empty((len(ks), TIES_KEPT), np.int64)
            _strict_levels_into(flat[lo:hi], thresholds, mine[lo:hi], counts, ties, tie_at, offset + lo)
            return counts, ties, tie_at

        for counts, ties, tie_at in _in_parts(flat.size, part):
            above += counts
            parts.append((ties, tie_at))
        offset += flat.size
    remaining = np.maximum(np.asarray(ks, np.int64) - above, 0)
    placed = _first_ties(parts, remaining)
    if placed is not None:
        for level, at in enumerate(placed):  # a tie keeps a smaller set it is already in
            current = levels[at]
            levels[at] = np.where((current == 0) | (current > level + 1), level + 1, current)
        return torch.from_numpy(levels)
    offset = 0
    for chunk in chunks():
        if remaining.max() == 0:
            break
        flat = _flat(chunk.cpu())
        _tie_levels_into(flat, thresholds, levels[offset : offset + flat.size], remaining)
        offset += flat.size
    return torch.from_numpy(levels)


def _first_ties(parts: list[tuple[np.ndarray, np.ndarray]], needed: np.ndarray) -> list[np.ndarray] | None:
    """For each level, where its first ``needed`` ties lie (in index order), from the parts' notes; None
    when a part had more ties than it noted before enough of them were found."""
    placed = []
    for level, need in enumerate(needed.tolist()):
        found: list[np.ndarray] = []
        for ties, tie_at in parts:
            if need == 0:
                break
            noted = min(int(ties[level]), TIES_KEPT)
            if noted < min(int(ties[level]), need):
                return None
            found.append(tie_at[level, : min(noted, need)])
            need -= min(noted, need)
        if need:
            return None
        placed.append(np.concatenate(found) if found else np.empty(0, np.int64))
    return placed
