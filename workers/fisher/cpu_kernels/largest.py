"""The need-th largest of positive float64 values and the sum of the need largest (a boundary bin's exact
top-k), by a radix selection on their bit patterns.

Definition: ``v = np.sort(values)[::-1]; (v[need - 1], v[:need].sum())``. ``np.partition`` measured
17 ns per value; this takes a few passes of about 1 ns. Tested against the sort in
tests/test_concentration.py.
"""

from __future__ import annotations

import numba
import numpy as np

_RADIX_BITS = 11  # buckets per round of ``_largest_into``: 2048 counts, in the core's first cache


@numba.njit(nogil=True, cache=True)
def _largest_into(values, need):  # pragma: no cover - compiled
    # Positive float64: their bit patterns, as int64, are in the values' order. The low bits every
    # value has zero are dropped (a float32 value widened has 29), then each round narrows [lo, hi]
    # (patterns, the need-th largest among them) to the one of 2^_RADIX_BITS buckets that holds it:
    # two rounds for the float32 values of one histogram bin
    bits = values.view(np.int64)
    lo, hi, ones = bits[0], bits[0], 0
    for b in bits:
        lo, hi, ones = min(lo, b), max(hi, b), ones | b
    if lo <= 0:  # a zero (+0.0 is pattern 0) or a negative value: their patterns are out of order
        raise ValueError("the values must be positive")
    drop = 0
    while drop < 63 and not (ones >> drop) & 1:
        drop += 1
    lo, hi = lo >> drop, hi >> drop
    above = 0  # values above [lo, hi]
    while lo < hi:
        width = 0
        while (hi - lo) >> width >= 1 << _RADIX_BITS:
            width += 1
        counts = np.zeros(((hi - lo) >> width) + 1, np.int64)
        for b in bits:
            b >>= drop
            if lo <= b <= hi:
                counts[(b - lo) >> width] += 1
        bucket = counts.size - 1
        while above + counts[bucket] < need:
            above += counts[bucket]
            bucket -= 1
        lo, hi = lo + (bucket << width), min(hi, lo + ((bucket + 1) << width) - 1)
    total, value = 0.0, 0.0
    for i in range(values.size):  # the values above the need-th largest, in index order
        b = bits[i] >> drop
        if b > lo:
            total += values[i]
        elif b == lo:
            value = values[i]
    return value, total, above


def largest_sum(values: np.ndarray, need: int) -> tuple[float, float]:
    """(the need-th largest of positive float64 ``values``, the float64 sum of the need largest), ties
    counted as often as they are needed. Why not ``np.partition``: the summary takes this for every
    tensor's and the model's boundary bins; partition measured 17 ns per value on 1e5-1e6 values and
    12 us a call on small ones, this a few passes of ~1 ns."""
    if not 1 <= need <= values.size:
        raise ValueError(f"need {need} of {values.size} values")
    if values.dtype != np.float64:
        raise ValueError(f"the values must be float64, not {values.dtype}")
    value, above_sum, above = _largest_into(np.ascontiguousarray(values), need)
    return float(value), float(above_sum) + (need - int(above)) * float(value)
