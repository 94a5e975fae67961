"""Concentration: the share of a total held by the top q of coordinates, without sorting 10^8 values.

Values are binned by their float32 bit pattern (exponent and the top 4 mantissa bits: 16 bins per
octave, monotone in the value), so one cheap pass gives counts and sums per bin. The named fractions
are then exact: the k-th largest value lies in one known bin, and only that bin's values are sorted.
The full curve interpolates within bins (the exact points bracket it to one bin width, 4.4% in value).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from backend.vocabulary import TOP_FRACTIONS

NAMED_FRACTIONS = TOP_FRACTIONS
MANTISSA_BITS_KEPT = 4  # 16 bins per octave
_SHIFT = 23 - MANTISSA_BITS_KEPT
N_BINS = 1 << (31 - _SHIFT)  # positive float32: sign bit 0


def _bins(values: torch.Tensor) -> torch.Tensor:
    """Monotone bin index (rounding to float32 is monotone too). Zeros, denormals below 2^-126 and
    rounding-level negatives all land in bin 0, which is treated as zero."""
    return (values.float().view(torch.int32) >> _SHIFT).clamp_(min=0)  # int32: bincount takes it as is


@dataclass
class Histogram:
    counts: torch.Tensor  # [N_BINS] float64
    sums: torch.Tensor  # [N_BINS] float64
    total_count: int  # all coordinates, zeros included

    @property
    def total(self) -> float:
        return float(self.sums.sum())


def histogram(chunks: Iterable[torch.Tensor]) -> Histogram:
    """Counts and sums per log bin over non-negative ``chunks``."""
    counts = torch.zeros(N_BINS, dtype=torch.float64)
    sums = torch.zeros(N_BINS, dtype=torch.float64)
    total = 0
    for chunk in chunks:
        flat = chunk.reshape(-1)
        total += flat.numel()
        index = _bins(flat)
        counts += torch.bincount(index, minlength=N_BINS).to("cpu", torch.float64)
        # negatives (rounding) land in bin 0 with the zeros, and bin 0's sum is dropped below
        sums += torch.bincount(index, weights=flat, minlength=N_BINS).to("cpu", torch.float64)
    sums[0] = 0.0
    return Histogram(counts, sums, total)


@dataclass
class Threshold:
    """The k-th largest value and the exact sum of the k largest."""

    k: int
    value: float
    top_sum: float


@dataclass
class ThresholdPlan:
    """For each fraction: k, the bin holding the k-th largest value (None: it is zero), the exact sum
    of the bins above it, and how many values of the boundary bin belong to the top k."""

    rows: list[tuple[int, int | None, float, int]]

    @property
    def bins(self) -> set[int]:
        return {b for _, b, _, _ in self.rows if b is not None}

    def finish(self, members: dict[int, list[torch.Tensor]]) -> list[Threshold]:
        out = []
        for k, b, above_sum, need in self.rows:
            if b is None:
                out.append(Threshold(k, 0.0, above_sum))
                continue
            values = torch.sort(torch.cat(members[b]), descending=True).values
            out.append(Threshold(k, float(values[need - 1]), above_sum + float(values[:need].sum())))
        return out


def plan_thresholds(hist: Histogram, fractions: Iterable[float]) -> ThresholdPlan:
    cum_counts = torch.cumsum(hist.counts.flip(0), 0)
    cum_sums = torch.cumsum(hist.sums.flip(0), 0)
    rows: list[tuple[int, int | None, float, int]] = []
    for q in fractions:
        k = max(1, math.ceil(q * hist.total_count))
        j = int(torch.searchsorted(cum_counts, torch.tensor(float(k), dtype=torch.float64)).item())
        if j >= N_BINS - 1:  # fewer non-zero values than k: the rest are zeros
            rows.append((k, None, float(cum_sums[-1]), 0))
            continue
        above_count = float(cum_counts[j - 1]) if j > 0 else 0.0
        above_sum = float(cum_sums[j - 1]) if j > 0 else 0.0
        rows.append((k, N_BINS - 1 - j, above_sum, k - int(above_count)))
    return ThresholdPlan(rows)


def bin_floor(b: int) -> float:
    """The smallest float32 value of bin ``b`` (bins are monotone: value >= bin_floor(b) iff bin >= b)."""
    return float(torch.tensor(b << _SHIFT, dtype=torch.int32).view(torch.float32))


def collect_bins(chunk: torch.Tensor, wanted: set[int], into: dict[int, list[torch.Tensor]]) -> None:
    """Append the values of ``chunk`` that fall in the ``wanted`` bins.

    One comparison on the values keeps everything at or above the lowest wanted bin; only that subset
    is binned and split.
    """
    if not wanted:
        return
    flat = chunk.reshape(-1)
    values = flat[flat.float() >= bin_floor(min(wanted))]
    bins = _bins(values)
    for b in wanted:
        sel = values[bins == b]
        if sel.numel():
            into.setdefault(b, []).append(sel.to(torch.float64))


def thresholds(
    hist: Histogram, chunks: Callable[[], Iterator[torch.Tensor]], fractions: Iterable[float]
) -> list[Threshold]:
    """Exact top-k sums for k = ceil(q N), one extra pass over the data (only the boundary bins)."""
    plan = plan_thresholds(hist, fractions)
    members: dict[int, list[torch.Tensor]] = {}
    if plan.bins:
        for chunk in chunks():
            collect_bins(chunk, plan.bins, members)
    return plan.finish(members)


def merge(histograms: Iterable[Histogram]) -> Histogram:
    hists = list(histograms)
    return Histogram(
        torch.stack([h.counts for h in hists]).sum(0),
        torch.stack([h.sums for h in hists]).sum(0),
        sum(h.total_count for h in hists),
    )


def concentration_curve(hist: Histogram, points: int = 61) -> tuple[list[float], list[float]]:
    """(q, share of total in the top q), q log-spaced from 1e-6 to 1; interpolated within bins."""
    total = hist.total
    qs = torch.logspace(-6, 0, points, dtype=torch.float64)
    if total <= 0 or hist.total_count == 0:
        return qs.tolist(), [0.0] * points
    counts = hist.counts.flip(0)
    sums = hist.sums.flip(0)
    cum_counts = torch.cumsum(counts, 0)
    cum_sums = torch.cumsum(sums, 0)
    shares = []
    for q in qs.tolist():
        k = q * hist.total_count
        j = int(torch.searchsorted(cum_counts, torch.tensor(k, dtype=torch.float64)).item())
        if j >= N_BINS:
            shares.append(1.0)
            continue
        before_c = float(cum_counts[j - 1]) if j else 0.0
        before_s = float(cum_sums[j - 1]) if j else 0.0
        mean = float(sums[j] / counts[j]) if counts[j] > 0 else 0.0
        shares.append(min(1.0, (before_s + (k - before_c) * mean) / total))
    return qs.tolist(), shares


def named_shares(hist: Histogram, chunks: Callable[[], Iterator[torch.Tensor]]) -> dict[str, float]:
    total = hist.total
    result = {}
    for q, th in zip(NAMED_FRACTIONS, thresholds(hist, chunks, NAMED_FRACTIONS), strict=True):
        result[f"{q:g}"] = th.top_sum / total if total > 0 else 0.0
    return result
