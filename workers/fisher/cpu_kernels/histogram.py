"""Histograms of up to three stats in one pass over the arrays they share (the summary's first pass).

Definition (the torch path, ``concentration.histogram``): per bin b = (float32 bits of v) >> shift
(negative -> 0), the count and the float64 sum of the values v of each stat. torch's bincount takes three
passes over its input, needs an int32 index array as large as the input and sums float32 weights in
float32; this reads each value once and sums in float64. Tested against it in tests/test_concentration.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import torch

from workers.fisher.cpu_kernels.arrays import _BINNED_MAX, _common_size, _cut, _slot, _stat_value
from workers.fisher.cpu_kernels.llvm import _LINE_VALUES, _ask, _float32_bits
from workers.fisher.cpu_kernels.threads import _in_parts
from workers.fisher.terms import StatTerms


@numba.njit(nogil=True, cache=True)
def _tensor_pass_into(  # pragma: no cover - compiled
    size,
    a,
    a_plus,
    a_square,
    b,
    b_plus,
    b_square,
    c,
    c_plus,
    c_square,
    shift,
    counts,
    sums,
):
    # Up to three histograms (stats a, b, c: base, + plus, + square * square) in one pass over the
    # arrays they share. An argument that is None is a part switched off: numba compiles each pattern
    # of Nones apart, with its branches removed. The updates of each part are those of a pass of its
    # own, in the same order, so the sums do not depend on what else is computed with them.
    # One loop, not values then updates per block: which form is faster differs between CPUs (on
    # AVX-512 this one by two to three times, on an older AVX2 core the other), and binning and summing
    # in one block loop lost to two passes on both
    for i in range(size):
        if i % _LINE_VALUES == 0:
            _ask(a, i), _ask(a_plus, i), _ask(a_square, i), _ask(b, i), _ask(b_plus, i), _ask(b_square, i)
            _ask(c, i), _ask(c_plus, i), _ask(c_square, i)
        if a is not None:
            v = _stat_value(a, a_plus, a_square, i)
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]  # numba supplies the context
            k = k if k > 0 else 0  # rounding-level negatives: bin 0, with the zeros
            counts[0, k] += 1
            sums[0, k] += v
        if b is not None:
            v = _stat_value(b, b_plus, b_square, i)
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
            k = k if k > 0 else 0
            counts[1, k] += 1
            sums[1, k] += v
        if c is not None:
            v = _stat_value(c, c_plus, c_square, i)
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
            k = k if k > 0 else 0
            counts[2, k] += 1
            sums[2, k] += v


@dataclass(frozen=True)
class TensorPass:
    """What ``tensor_pass`` found: float64 counts and sums per bin of each stat (bin = float32 bits >>
    shift, < 0 -> 0)."""

    counts: list[torch.Tensor]
    sums: list[torch.Tensor]


def tensor_pass(binned: Sequence[StatTerms], shift: int, n_bins: int) -> TensorPass:
    """Histograms of up to three stats over CPU arrays of one size, each array read once.

    Why one pass: the summary bins the Fisher, the uncentered and the raw Fisher of every tensor, sums
    of the same stored arrays; apart, each re-read the arrays it shares with the others and paid the
    loop's overhead again.
    """
    if len(binned) > _BINNED_MAX:
        raise ValueError(f"at most {_BINNED_MAX} stats are binned in one pass, not {len(binned)}")
    slots = [_slot(terms) for terms in binned] + [(None, None, None)] * (_BINNED_MAX - len(binned))
    size = _common_size([array for slot in slots for array in slot])

    def part(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        counts, sums = np.zeros((_BINNED_MAX, n_bins), np.int64), np.zeros((_BINNED_MAX, n_bins), np.float64)
        cut = [_cut(array, lo, hi) for slot in slots for array in slot]
        _tensor_pass_into(hi - lo, *cut, shift, counts, sums)  # type: ignore[call-arg]  # numba's stub
        return counts, sums

    parts = _in_parts(size, part)
    counts, sums = parts[0]
    for more_counts, more_sums in parts[1:]:
        counts += more_counts
        sums += more_sums
    found = range(len(binned))
    return TensorPass(
        [torch.from_numpy(counts[k].astype(np.float64)) for k in found],
        [torch.from_numpy(sums[k]) for k in found],
    )


def histogram(terms: StatTerms, shift: int, n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 counts and sums per bin of a stat on the CPU (bin = float32 bits >> shift, < 0 -> 0)."""
    found = tensor_pass([terms], shift, n_bins)
    return found.counts[0], found.sums[0]
