"""How the loops see their inputs: a stat's terms (``StatTerms``) as flat numpy arrays, cut into parts,
and the share of a sum its extra term carries, rounded as ``StatTerms.extra_share`` rounds it."""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import torch

from workers.fisher.terms import StatTerms

_BINNED_MAX = 3  # the summary's curve stats: the Fisher, the uncentered and the raw Fisher


def _compiled(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in a dtype the loops are compiled for: bfloat16 and float16 widen to float32 exactly
    (numpy has no bfloat16), so their bins, which are float32 bit patterns, are the same."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def _flat(tensor: torch.Tensor) -> np.ndarray:
    return _compiled(tensor.detach()).reshape(-1).contiguous().numpy()


def _common_size(arrays: Sequence[np.ndarray | None]) -> int:
    """The one size of a pass's arrays (0 for none)."""
    present = [array for array in arrays if array is not None]
    size = present[0].size if present else 0
    if any(array.size != size for array in present):
        raise ValueError("the arrays of one pass differ in size")
    return size


def _cut(array: np.ndarray | None, lo: int, hi: int) -> np.ndarray | None:
    return None if array is None else array[lo:hi]


def _slot(terms: StatTerms) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(base, the extra term added, the extra term added squared): one of the last two is None."""
    base = _flat(terms.base)
    if terms.extra is None:
        return base, None, None
    extra = _flat(terms.extra)
    return (base, None, extra) if terms.squared else (base, extra, None)


@numba.njit(inline="always")
def _stat_value(base, plus, square, i):  # pragma: no cover - compiled
    # value i of a stat's terms (``_slot``: base + plus, or base + square * square, or base alone), in
    # the order StatTerms.formed rounds it; inlined where called, each pattern of Nones compiled apart
    v = base[i]
    if plus is not None:
        v = v + plus[i]
    if square is not None:
        v = v + square[i] * square[i]
    return v


@numba.njit(inline="always", error_model="numpy")  # x / 0 is inf or nan, as in torch
def _extra_share(whole, extra, squared):  # pragma: no cover - compiled
    # the share of ``whole`` (base + extra, or base + extra * extra) that its extra term carries, in the
    # arrays' dtype and rounded as ``StatTerms.extra_share`` rounds it: extra / whole first (times
    # extra again when squared); 0 where it is not finite (0/0: a zero sum has zero terms)
    part = extra / whole
    if squared:
        part = part * extra
    return np.float64(part) if np.isfinite(part) else 0.0
