"""Concentration: the share of a total held by the top q of coordinates, without sorting 10^8 values.

Values are binned by their float32 bit pattern (exponent and the top 4 mantissa bits: 16 bins per
octave, monotone in the value), so one cheap pass gives counts and sums per bin. The named fractions
are then exact: the k-th largest value lies in one known bin, and only that bin's values are sorted.
The full curve interpolates within bins (the exact points bracket it to one bin width, 4.4% in value).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from backend.vocabulary import TOP_FRACTIONS
from workers.fisher import cpu_kernels
from workers.fisher.terms import StatTerms

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

    @staticmethod
    def binned(counts: torch.Tensor, sums: torch.Tensor, total_count: int) -> Histogram:
        """From counts and sums per bin; bin 0's sum (zeros, and negatives from rounding) is dropped."""
        sums[0] = 0.0
        return Histogram(counts, sums, total_count)


Stat = torch.Tensor | StatTerms  # an array, or a sum of arrays binned without being formed


def _terms(chunk: Stat) -> StatTerms:
    return chunk if isinstance(chunk, StatTerms) else StatTerms(chunk)


def histogram(chunks: Iterable[Stat]) -> Histogram:
    """Counts and sums per log bin over non-negative ``chunks`` (sums in float64)."""
    counts = torch.zeros(N_BINS, dtype=torch.float64)
    sums = torch.zeros(N_BINS, dtype=torch.float64)
    total = 0
    for chunk in chunks:
        terms = _terms(chunk)
        total += terms.base.numel()
        if cpu_kernels.compiled_for(terms.base):
            chunk_counts, chunk_sums = cpu_kernels.histogram(terms, _SHIFT, N_BINS)
        else:
            flat = terms.formed().reshape(-1)
            index = _bins(flat)
            chunk_counts = torch.bincount(index, minlength=N_BINS)
            chunk_sums = torch.bincount(index, weights=flat.double(), minlength=N_BINS)
        counts += chunk_counts.to("cpu", torch.float64)
        # negatives (rounding) land in bin 0 with the zeros, and bin 0's sum is dropped below
        sums += chunk_sums.to("cpu", torch.float64)
    return Histogram.binned(counts, sums, total)


def histograms_in_one_pass(binned: list[StatTerms]) -> list[Histogram]:
    """CPU arrays of one tensor: the ``histogram`` of each of ``binned`` (at most three), each array read
    once (``cpu_kernels.tensor_pass``)."""
    found = cpu_kernels.tensor_pass(binned, _SHIFT, N_BINS)
    return [
        Histogram.binned(counts, sums, terms.base.numel())
        for terms, counts, sums in zip(binned, found.counts, found.sums, strict=True)
    ]


def totals_in_one_pass(
    summed: list[Stat], squared: torch.Tensor | None = None, shares: StatTerms | None = None
) -> tuple[list[float], float, float]:
    """CPU arrays of one tensor: each of ``summed``'s float64 total over the values its histogram bins
    (bins > 0: not the zeros, denormals or rounding-level negatives), the sum of squares of ``squared``
    and the sum of ``shares``'s extra-term shares, each array read once (``cpu_kernels.tensor_totals``).
    A histogram's ``total`` is the same sum, added in another order."""
    found = cpu_kernels.tensor_totals([_terms(chunk) for chunk in summed], _SHIFT, squared, shares)
    return found.sums, found.square_sum, found.share_sum


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
            # the need largest of the boundary bin: a selection, not a sort (the bin can hold 1e6 values)
            parts = members[b]
            values = (parts[0] if len(parts) == 1 else torch.cat(parts)).numpy()
            value, top_sum = cpu_kernels.largest_sum(values, need)
            out.append(Threshold(k, value, above_sum + top_sum))
        return out


def plan_thresholds(hist: Histogram, fractions: Iterable[float]) -> ThresholdPlan:
    (plan,) = plans_of([hist], fractions)
    return plan


def plans_of(hists: Sequence[Histogram], fractions: Iterable[float]) -> list[ThresholdPlan]:
    """``plan_thresholds`` of each histogram, in numpy arrays over all of them at once: the summary
    plans every tensor, where a call per tensor spent more time in numpy's per-call cost than in its
    4096 bins."""
    if not hists:
        return []
    count = len(hists)
    # from the top bin down; each row lifted above the one before (counts are exact in float64), so
    # that one searchsorted over the flattened rows finds every row's boundary
    # torch's cumsum: numpy's ran at 3.4 ns per bin (one dependent addition after the other)
    cum_counts = torch.stack([h.counts for h in hists]).flip(1).cumsum(1).numpy()
    cum_sums = torch.stack([h.sums for h in hists]).flip(1).cumsum(1).numpy()
    lift = np.arange(count, dtype=np.float64)[:, None] * (float(cum_counts[:, -1].max()) + 1.0)
    flat = (cum_counts + lift).ravel()
    sizes = np.array([h.total_count for h in hists], np.float64)
    rows: list[list[tuple[int, int | None, float, int]]] = [[] for _ in hists]
    for q in fractions:
        ks = np.maximum(1, np.ceil(q * sizes))
        # per row: the first j whose count of the values from the top reaches k
        found = np.searchsorted(flat, ks + lift[:, 0]) - np.arange(count) * N_BINS
        before = np.maximum(found - 1, 0)
        at = np.arange(count), np.minimum(before, N_BINS - 1)
        above_counts = np.where(found > 0, cum_counts[at], 0.0)
        above_sums = np.where(found > 0, cum_sums[at], 0.0)
        for row, k, j, above_count, above_sum, all_sum in zip(
            rows, ks.tolist(), found.tolist(), above_counts.tolist(), above_sums.tolist(),
            cum_sums[:, -1].tolist(), strict=True,
        ):  # fmt: skip
            if j >= N_BINS - 1:  # fewer non-zero values than k: the rest are zeros
                row.append((int(k), None, all_sum, 0))
            else:
                row.append((int(k), N_BINS - 1 - j, above_sum, int(k) - int(above_count)))
    return [ThresholdPlan(row) for row in rows]


@dataclass(frozen=True)
class BinChoice:
    """Where a selection of one chunk's values puts each chosen bin's values, taken from the chunk's own
    histogram before the chunk is read (so a chunk with none of them need not be formed): bin by bin,
    ascending, and in index order within a bin."""

    starts: np.ndarray  # int64 [N_BINS]: where bin b's values start; -1 where b is not chosen
    ends: np.ndarray  # int64 [N_BINS]: how many chosen values lie in bins <= b

    @staticmethod
    def of(hist: Histogram, wanted: set[int], from_bin: int | None = None) -> BinChoice:
        """The ``wanted`` bins and, with ``from_bin``, every bin at or above it; bin 0 (the zeros) never."""
        (choice,) = BinChoice.each([hist], [wanted], from_bin)
        return choice

    @staticmethod
    def each(
        hists: Sequence[Histogram], wanted: Sequence[set[int]], from_bin: int | None = None
    ) -> list[BinChoice]:
        """``of`` for each histogram and its wanted bins, in numpy arrays over all of them at once (a
        call per tensor spent more in numpy's per-call cost than in the 4096 bins)."""
        if not hists:
            return []
        chosen = np.zeros((len(hists), N_BINS), dtype=bool)
        rows = [row for row, bins in enumerate(wanted) for _ in bins]
        chosen[rows, [b for bins in wanted for b in bins]] = True
        if from_bin is not None:
            chosen[:, max(from_bin, 1) :] = True
        chosen[:, 0] = False
        sizes = np.where(chosen, np.stack([h.counts.numpy() for h in hists]).astype(np.int64), 0)
        ends = np.cumsum(sizes, axis=1)
        starts = np.where(chosen, ends - sizes, -1)
        return [BinChoice(first, last) for first, last in zip(starts, ends, strict=True)]

    @property
    def size(self) -> int:
        return int(self.ends[-1])

    def select(self, chunk: Stat) -> Selection:
        """The chosen values of ``chunk`` (one pass; not read at all when there are none)."""
        (selection,) = select_in_one_pass([chunk], [self])
        return selection

    def select_with_torch(self, terms: StatTerms) -> Selection:
        """``select`` in torch's ops: the GPU's path (tested against the compiled one on the CPU)."""
        flat = terms.formed().reshape(-1)
        bins = _bins(flat)
        index = torch.nonzero(torch.from_numpy(self.starts >= 0).to(flat.device)[bins.long()]).flatten()
        index = index[torch.sort(bins[index], stable=True).indices]  # by bin, in index order within one
        if index.numel() != self.size:
            raise ValueError("the histogram is not the selected values' own: its counts differ")
        return Selection(self, index.cpu(), flat[index].to("cpu", torch.float64))


@dataclass(frozen=True)
class Selection:
    """The values of one chunk in the bins of a ``BinChoice``: flat indices and float64 values."""

    choice: BinChoice
    index: torch.Tensor
    values: torch.Tensor

    def of(self, b: int) -> torch.Tensor:
        """Bin b's values, in index order (none when b was not chosen)."""
        start = int(self.choice.starts[b])
        return self.values[start : int(self.choice.ends[b])] if start >= 0 else self.values[:0]

    def at_or_above(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of the chosen values in bins >= b (b >= 1): the selection's tail."""
        start = int(self.choice.ends[b - 1])
        return self.index[start:], self.values[start:]


def select_in_one_pass(chunks: list[Stat], choices: list[BinChoice]) -> list[Selection]:
    """``choice.select(chunk)`` for each pair, the CPU's chunks (of one size, at most three with values
    chosen) read in one pass; a chunk with no value chosen is not read."""
    found: dict[int, Selection] = {}
    read = [k for k, choice in enumerate(choices) if choice.size]
    terms = {k: _terms(chunks[k]) for k in read}
    on_cpu = [k for k in read if cpu_kernels.compiled_for(terms[k].base)]
    if on_cpu:
        ranges = [(choices[k].starts, choices[k].ends) for k in on_cpu]
        picked = cpu_kernels.select_grouped([terms[k] for k in on_cpu], _SHIFT, ranges)
        found.update({k: Selection(choices[k], *pair) for k, pair in zip(on_cpu, picked, strict=True)})
    found.update({k: choices[k].select_with_torch(terms[k]) for k in read if k not in found})
    empty = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.float64)
    return [found[k] if k in found else Selection(choice, *empty) for k, choice in enumerate(choices)]


def select_bins(
    chunk: Stat, wanted: set[int], from_bin: int | None = None, hist: Histogram | None = None
) -> Selection:
    """The values of ``chunk`` whose bin is in ``wanted`` or, with ``from_bin``, at or above it (bin 0,
    the zeros, never). ``hist``: the chunk's own histogram (without it, one is taken first)."""
    return BinChoice.of(hist if hist is not None else histogram([chunk]), wanted, from_bin).select(chunk)


def collect_bins(chunk: Stat, wanted: set[int], into: dict[int, list[torch.Tensor]]) -> None:
    """Append the values of ``chunk`` that fall in the ``wanted`` bins (as float64)."""
    if not wanted:
        return
    selection = select_bins(chunk, wanted)
    for b in sorted(wanted):
        values = selection.of(b)
        if values.numel():
            into.setdefault(b, []).append(values)


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
