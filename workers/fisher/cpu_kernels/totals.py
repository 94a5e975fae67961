"""Each stat's total over the values its histogram bins, a float64 sum of squares and a sum of extra-term
shares (rho's mean), in one pass: a partial result's summary needs only these.

Definition (the torch path): ``v[(float32 bits of v) >> shift > 0].double().sum()`` per stat,
``(x.double() ** 2).sum()``, and ``terms.extra_share().double().sum()``. Here summed in vector lanes a
block at a time, nothing formed. Tested against them in tests/test_concentration.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch

from workers.fisher.cpu_kernels.arrays import _BINNED_MAX, _common_size, _cut, _extra_share, _flat, _slot
from workers.fisher.cpu_kernels.llvm import _float32_bits
from workers.fisher.cpu_kernels.threads import _in_parts
from workers.fisher.terms import NO_EXTRA_TERM, StatTerms

# values summed apart before they are added to a total: a block of 1024 float32 is one 4 kB page, where
# the hardware's prefetcher stops, so each block's first lines came from memory; past 16384 three
# arrays' blocks no longer stay in the core's cache
_TOTALS_BLOCK = 16384


@numba.njit(nogil=True, cache=True, fastmath={"reassoc"})
def _lane_sum(values, count):  # pragma: no cover - compiled
    # reassociated, so that LLVM sums in vector lanes: a total's order of addition is the compiler's,
    # a float64 sum of float32-rounded values either way
    total = 0.0
    for j in range(count):
        total += values[j]
    return total


@numba.njit(nogil=True, cache=True, fastmath={"reassoc"})
def _binned_sum(base, plus, square, lo, hi, shift):  # pragma: no cover - compiled
    # one stat's values lo..hi as the histogram pass forms them (one add, or a multiply and an add:
    # nothing to reassociate), those in bins > 0, summed in float64 lanes. Views of the block indexed
    # from 0 take vectors (base[lo + j] kept the loop scalar); formed into a buffer and summed apart,
    # the values cost a quarter more
    base_at = base[lo:hi]
    if plus is not None:  # pruned where the argument is None
        plus_at = plus[lo:hi]
    if square is not None:
        square_at = square[lo:hi]
    total = 0.0
    for j in range(hi - lo):
        v = base_at[j]
        if plus is not None:
            v = v + plus_at[j]
        if square is not None:
            v = v + square_at[j] * square_at[j]
        total += np.float64(v) if _float32_bits(np.float32(v)) >> shift > 0 else 0.0  # type: ignore[call-arg]
    return total


@numba.njit(nogil=True, cache=True, fastmath={"reassoc"})
def _square_sum(values, lo, hi):  # pragma: no cover - compiled
    values_at = values[lo:hi]
    total = 0.0
    for j in range(hi - lo):
        total += np.float64(values_at[j]) * np.float64(values_at[j])  # exact for float32 values
    return total


@numba.njit(nogil=True, cache=True, error_model="numpy")  # x / 0 is inf or nan, as in torch
def _totals_into(  # pragma: no cover - compiled
    size,
    a, a_plus, a_square,
    b, b_plus, b_square,
    c, c_plus, c_square,
    q, r, r_plus, r_square,
    shift, out,
):  # fmt: skip
    # Each stat's total over the values its histogram bins (bins > 0), a float64 sum of squares (q) and
    # a sum of extra-term shares (r), in one pass, a block at a time, each sum in vector lanes.
    # Apart from the histograms, whose updates go value by value, this takes about half the time. The
    # shares are formed into a block and summed apart: a reassociated loop may reorder a share's own
    # divide and multiply, and each share is rounded as torch rounds it
    block = np.empty(_TOTALS_BLOCK, np.float64)
    for lo in range(0, size, _TOTALS_BLOCK):
        hi = min(lo + _TOTALS_BLOCK, size)
        if a is not None:
            out[0] += _binned_sum(a, a_plus, a_square, lo, hi, shift)
        if b is not None:
            out[1] += _binned_sum(b, b_plus, b_square, lo, hi, shift)
        if c is not None:
            out[2] += _binned_sum(c, c_plus, c_square, lo, hi, shift)
        if q is not None:
            out[3] += _square_sum(q, lo, hi)
        if r is not None:
            r_at = r[lo:hi]
            if r_plus is not None:
                r_plus_at = r_plus[lo:hi]
            if r_square is not None:
                r_square_at = r_square[lo:hi]
            for j in range(hi - lo):
                if r_plus is not None:
                    e = r_plus_at[j]
                    block[j] = _extra_share(r_at[j] + e, e, False)
                if r_square is not None:
                    e = r_square_at[j]
                    block[j] = _extra_share(r_at[j] + e * e, e, True)
            out[4] += _lane_sum(block, hi - lo)


@dataclass(frozen=True)
class TensorTotals:
    """What ``tensor_totals`` found: each stat's float64 sum over its values in bins > 0 (the values a
    histogram of the stat sums), the float64 sum of squares and the sum of extra-term shares."""

    sums: list[float]
    square_sum: float
    share_sum: float


def tensor_totals(
    summed: Sequence[StatTerms],
    shift: int,
    squared: torch.Tensor | None = None,
    shares: StatTerms | None = None,
) -> TensorTotals:
    """``tensor_pass``'s totals without its histograms, over CPU arrays of one size, in float64.

    Why apart: a partial result's summary needs only totals, and every value's histogram update (a
    load and a store per stat, in order) cost several times the vectorized sums."""
    if len(summed) > _BINNED_MAX:
        raise ValueError(f"at most {_BINNED_MAX} stats are summed in one pass, not {len(summed)}")
    if shares is not None and shares.extra is None:
        raise ValueError(NO_EXTRA_TERM)
    slots: list[tuple[np.ndarray | None, ...]] = [_slot(terms) for terms in summed]
    slots += [(None, None, None)] * (_BINNED_MAX - len(summed))
    slots += [
        (None if squared is None else _flat(squared),),
        (None, None, None) if shares is None else _slot(shares),
    ]
    size = _common_size([array for slot in slots for array in slot])

    def part(lo: int, hi: int) -> np.ndarray:
        out = np.zeros(5, np.float64)
        cut = [_cut(array, lo, hi) for slot in slots for array in slot]
        _totals_into(hi - lo, *cut, shift, out)  # type: ignore[call-arg]  # numba's stub
        return out

    found = np.sum(_in_parts(size, part), axis=0)
    return TensorTotals([float(v) for v in found[: len(summed)]], float(found[3]), float(found[4]))


def square_sum(value: torch.Tensor) -> float:
    """sum of squares of a CPU tensor, each square and the sum in float64."""
    return tensor_totals([], 0, squared=value).square_sum


def extra_share_mean(terms: StatTerms) -> float:
    """The mean of ``terms.extra_share()`` over a CPU tensor, summed in float64, nothing formed."""
    if terms.extra is None:
        raise ValueError(NO_EXTRA_TERM)
    size = terms.base.numel()
    return tensor_totals([], 0, shares=terms).share_sum / size if size else 0.0
