"""Loops of the math core compiled for the CPU (numba), where torch's ops would pass over memory
several times. GPU tensors take the torch path of the callers, which these loops are tested against.

- ``histogram``, ``select`` (``concentration``): a stat given as its terms (``StatTerms``) is summed
  value by value, never formed as an array. Per call, torch's bincount takes three passes over its
  input (min, max, count), needs an int32 index array as large as the input, and sums float32 weights in
  float32 (1% off over 1e8 values); these read each value once, allocate nothing of the input's size and
  sum in float64.
- ``square_sum`` (the totals of signed stats): float64 without a squared array.

One thread: a second one on two cores measured slower (torch's own threads hold the other core).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from workers.fisher.terms import StatTerms

# a stat is base, base + extra or base + extra * extra (``StatTerms``), summed here as torch would
_BASE, _PLUS, _PLUS_SQUARE = 0, 1, 2


@intrinsic
def _float32_bits(typingctx, value):
    """The int32 bit pattern of a float32 (an LLVM bitcast: no memory round trip)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@numba.njit(nogil=True, cache=True)
def _histogram_into(base, extra, mode, shift, counts, sums):  # pragma: no cover - compiled
    for i in range(base.size):
        v = base[i]  # written out in each loop: a shared inlined helper compiled 6x slower
        if mode == _PLUS:
            v = v + extra[i]
        elif mode == _PLUS_SQUARE:
            v = v + extra[i] * extra[i]
        b = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]  # numba supplies the context
        if b < 0:  # rounding-level negatives: bin 0, with the zeros
            b = 0
        counts[b] += 1
        sums[b] += v


@numba.njit(nogil=True, cache=True)
def _select(base, extra, mode, shift, wanted, at_most):  # pragma: no cover - compiled
    index = np.empty(at_most, np.int64)
    out = np.empty(at_most, np.float64)
    out_bins = np.empty(at_most, np.int32)
    j = 0
    for i in range(base.size):
        v = base[i]
        if mode == _PLUS:
            v = v + extra[i]
        elif mode == _PLUS_SQUARE:
            v = v + extra[i] * extra[i]
        b = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
        if b > 0 and wanted[b]:
            index[j] = i
            out[j] = v
            out_bins[j] = b
            j += 1
    return index[:j], out[:j], out_bins[:j]


@numba.njit(nogil=True, cache=True)
def _square_sum(values):  # pragma: no cover - compiled
    total = 0.0
    for i in range(values.size):
        total += np.float64(values[i]) * np.float64(values[i])
    return total


def square_sum(value: torch.Tensor) -> float:
    """sum of squares of a CPU tensor, each square and the sum in float64."""
    return float(_square_sum(value.detach().reshape(-1).contiguous().numpy()))


def _arrays(terms: StatTerms) -> tuple[np.ndarray, np.ndarray, int]:
    """base, extra (base again when there is none: never read) and the mode, flat."""
    base = terms.base.detach().reshape(-1).contiguous().numpy()
    if terms.extra is None:
        return base, base, _BASE
    extra = terms.extra.detach().reshape(-1).contiguous().numpy()
    return base, extra, _PLUS_SQUARE if terms.squared else _PLUS


def histogram(terms: StatTerms, shift: int, n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 counts and sums per bin of a stat on the CPU (bin = float32 bits >> shift, < 0 -> 0)."""
    counts = np.zeros(n_bins, np.int64)
    sums = np.zeros(n_bins, np.float64)
    _histogram_into(*_arrays(terms), shift, counts, sums)
    return torch.from_numpy(counts.astype(np.float64)), torch.from_numpy(sums)


def select(
    terms: StatTerms, shift: int, wanted: torch.Tensor, at_most: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat indices, float64 values, bins) of a stat's values on the CPU whose bin (> 0) is ``wanted``
    (bool per bin); ``at_most``: how many there are (a histogram of the stat says), so one pass."""
    index, values, bins = _select(*_arrays(terms), shift, wanted.numpy(), at_most)
    return torch.from_numpy(index), torch.from_numpy(values), torch.from_numpy(bins)
