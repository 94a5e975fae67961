"""Loops of the math core compiled for the CPU (numba), where torch's ops would pass over memory
several times. GPU tensors take the torch path of the callers, which these loops are tested against.

- ``histogram``, ``select_grouped`` (``concentration``): a stat given as its terms (``StatTerms``) is summed
  value by value, never formed as an array. Per call, torch's bincount takes three passes over its
  input (min, max, count), needs an int32 index array as large as the input, and sums float32 weights in
  float32 (1% off over 1e8 values); these read each value once, allocate nothing of the input's size and
  sum in float64.
- ``square_sum`` (the totals of signed stats): float64 without a squared array.
- ``extra_share_mean`` (rho's mean per tensor): one pass where torch's ratio took five.
- ``nested_levels`` (the top-q level map): two passes where torch took about five per level.
- ``pair_moments`` (the ghost form's M with few rows, ``directions``): each direction's rows are read
  once, from cache, for all of their pairs; torch's way writes and reads back b x pairs x o products.

A large array is cut into one part per torch thread, each compiled loop running without the GIL in a
thread of its own (the summary runs when torch's threads are idle): a histogram of 2.8e7 values went
from 1.54 to 0.75 ns per value on two cores. A pass over many arrays (the summary's tensors) runs them
in threads instead (``each_in_threads``): cut per call, the ~1e6-value tensors of SmolLM2 spent more
time handing parts to an idle thread than the part saved.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from workers.fisher.terms import NO_EXTRA_TERM, StatTerms

# a stat is base, base + extra or base + extra * extra (``StatTerms``), summed here as torch would
_BASE, _PLUS, _PLUS_SQUARE = 0, 1, 2
PART_MIN_VALUES = 1 << 18  # below this a part costs more to hand to a thread than it saves
_Part = TypeVar("_Part")
_Item = TypeVar("_Item")
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0
_pool_lock = threading.Lock()
_thread_state = threading.local()  # busy: this thread runs items of ``each_in_threads``


def _busy() -> bool:
    return getattr(_thread_state, "busy", False)


def _in_parts(size: int, work: Callable[[int, int], _Part]) -> list[_Part]:
    """``work(lo, hi)`` over [0, size) cut into parts, one per torch thread, this thread doing the first;
    one part inside ``each_in_threads``, whose threads are all busy already."""
    count = 1 if _busy() else max(1, min(torch.get_num_threads(), size // PART_MIN_VALUES))
    if count == 1:
        return [work(0, size)]
    bounds = [size * k // count for k in range(count + 1)]
    pool = _thread_pool(count - 1)
    others = [pool.submit(work, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)]
    return [work(bounds[0], bounds[1]), *(future.result() for future in others)]


def each_in_threads(
    work: Callable[[_Item], _Part], items: Sequence[_Item], sizes: Sequence[int]
) -> list[_Part]:
    """``[work(item) for item in items]``, the items shared among torch's threads (this one included),
    largest ``sizes`` first so that no thread is left with a large one at the end.

    Why: the summary's passes call these loops once per tensor and stat; a thread that takes whole
    tensors from a queue stays busy, where cutting each call in parts woke an idle thread for every
    call (two threads were 1.2x one on SmolLM2's 272 tensors). ``work`` must not depend on the order
    in which items run: callers combine the results in the items' order. Nested calls run in order.
    """
    threads = min(torch.get_num_threads(), len(items))
    if threads <= 1 or _busy():
        return [work(item) for item in items]
    order = iter(sorted(range(len(items)), key=lambda i: -sizes[i]))
    results: list[_Part | None] = [None] * len(items)
    taking = threading.Lock()
    failed = threading.Event()

    def run() -> None:
        _thread_state.busy = True
        try:
            while not failed.is_set():
                with taking:
                    i = next(order, None)
                if i is None:
                    return
                results[i] = work(items[i])
        except BaseException:
            failed.set()  # the other threads stop taking items; the error reaches the caller
            raise
        finally:
            _thread_state.busy = False

    helpers = [_thread_pool(threads - 1).submit(run) for _ in range(threads - 1)]
    try:
        run()
    finally:
        for helper in helpers:  # every helper is done before the caller goes on (or sees an error)
            helper.exception()
    for helper in helpers:
        helper.result()
    return results  # type: ignore[return-value]  # every slot is filled when no thread failed


def _thread_pool(threads: int) -> ThreadPoolExecutor:
    """The pool, grown when torch's thread count is raised. A replaced pool is not shut down: a caller
    may still be submitting to it; its threads exit once it is collected."""
    global _pool, _pool_threads
    with _pool_lock:
        if _pool is None or _pool_threads < threads:
            _pool, _pool_threads = ThreadPoolExecutor(threads, thread_name_prefix="fisher-kernels"), threads
        return _pool


@intrinsic
def _float32_bits(typingctx, value):
    """The int32 bit pattern of a float32 (an LLVM bitcast: no memory round trip)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(types.float32), codegen


@intrinsic
def _prefetch(typingctx, array, index):
    """Ask for the cache line of ``array[index]`` (LLVM's prefetch: never faults, even past the end).

    Why: the stats these loops read were written long before (cold), and the loops' scattered
    updates leave the hardware prefetcher behind: 2.45 -> 1.47 ns per value on 8.85e5-value arrays.
    """

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        int32 = ir.IntType(32)
        prefetch = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte, int32, int32, int32])
        )
        # read, keep in all cache levels, data cache
        flags = [ir.Constant(int32, 0), ir.Constant(int32, 3), ir.Constant(int32, 1)]
        builder.call(prefetch, [builder.bitcast(builder.gep(data, [args[1]]), byte), *flags])
        return context.get_dummy_value()

    return types.void(array, index), codegen


_AHEAD = 256  # values ahead of the loop that are asked for
# one request per 64-byte line of float32 (every other line of float64, whose neighbour the hardware
# fetches with it)
_LINE_VALUES = 16
_BLOCK = 256  # values per block of the two-loop kernels (their buffers stay in L1)


@numba.njit(nogil=True, cache=True)
def _histogram_into(base, extra, mode, shift, counts, sums):  # pragma: no cover - compiled
    # two loops per block: the values and bins first, then the scattered updates. In one loop the
    # updates ran at 8.3 ns per value on a 2 GHz EPYC, apart 3.4-3.9 (the same updates, in the same order)
    bins = np.empty(_BLOCK, np.int32)
    values = np.empty(_BLOCK, np.float64)
    for start in range(0, base.size, _BLOCK):
        count = min(_BLOCK, base.size - start)
        for j in range(count):
            i = start + j
            v = base[i]  # written out in each loop: a shared inlined helper compiled 6x slower
            if mode == _PLUS:
                v = v + extra[i]
            elif mode == _PLUS_SQUARE:
                v = v + extra[i] * extra[i]
            b = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]  # numba supplies the context
            bins[j] = b if b > 0 else 0  # rounding-level negatives: bin 0, with the zeros
            values[j] = v
        for j in range(count):
            counts[bins[j]] += 1
            sums[bins[j]] += values[j]


@numba.njit(nogil=True, cache=True)
def _select_grouped(base, extra, mode, shift, chosen, cursor, index, out):  # pragma: no cover - compiled
    # cursor[b]: where chosen bin b's next value goes. One loop, unlike the histogram's two: few values
    # are chosen, and the two loops measured 3.5 ns per value against 1.3-2.8
    for i in range(base.size):
        if i % _LINE_VALUES == 0:
            _prefetch(base, i + _AHEAD)  # type: ignore[call-arg]
            if mode != _BASE:
                _prefetch(extra, i + _AHEAD)  # type: ignore[call-arg]
        v = base[i]
        if mode == _PLUS:
            v = v + extra[i]
        elif mode == _PLUS_SQUARE:
            v = v + extra[i] * extra[i]
        b = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
        if b > 0 and chosen[b]:
            at = cursor[b]
            if at < out.size:  # past the end only with a histogram of other values
                index[at] = i
                out[at] = v
                cursor[b] = at + 1


@numba.njit(nogil=True, cache=True)
def _square_sum(values):  # pragma: no cover - compiled
    total = 0.0
    for i in range(values.size):
        if i % _LINE_VALUES == 0:
            _prefetch(values, i + _AHEAD)  # type: ignore[call-arg]
        total += np.float64(values[i]) * np.float64(values[i])
    return total


@numba.njit(nogil=True, cache=True, error_model="numpy")  # x / 0 is inf or nan, as in torch
def _extra_share_sum(base, extra, squared):  # pragma: no cover - compiled
    total = 0.0
    for i in range(base.size):
        if i % _LINE_VALUES == 0:
            _prefetch(base, i + _AHEAD)  # type: ignore[call-arg]
            _prefetch(extra, i + _AHEAD)  # type: ignore[call-arg]
        e = extra[i]
        whole = base[i] + e * e if squared else base[i] + e
        share = e / whole * e if squared else e / whole  # as StatTerms.extra_share, rounding included
        if np.isfinite(share):  # 0/0 -> 0: a zero sum has zero terms
            total += share
    return total


@numba.njit(nogil=True, cache=True)
def _pair_moments_into(delta, weights, out):  # pragma: no cover - compiled
    count, rows, width = delta.shape
    weighted = np.empty(width, delta.dtype)
    for b in range(count):
        pair = 0
        for r in range(rows):
            for o in range(width):
                weighted[o] = weights[b] * delta[b, r, o]
            for s in range(r, rows):
                total, row = out[pair], delta[b, s]
                for o in range(width):
                    total[o] += weighted[o] * row[o]
                pair += 1


def pair_moments(delta: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[pairs, o]: sum_b w_b delta[b, r, o] delta[b, s, o] for the pairs r <= s in row-major order, in
    delta's dtype (as torch's matrix-vector product sums them)."""
    count, rows, width = delta.shape
    values = _compiled(delta.detach()).contiguous()
    out = torch.zeros(rows * (rows + 1) // 2, width, dtype=values.dtype)
    weights = weights.detach().to(values.dtype).contiguous()
    _pair_moments_into(values.numpy(), weights.numpy(), out.numpy())
    return out.to(delta.dtype)


@numba.njit(nogil=True, cache=True)
def _strict_levels_into(values, thresholds, levels, above):  # pragma: no cover - compiled
    for i in range(values.size):
        if i % _LINE_VALUES == 0:
            _prefetch(values, i + _AHEAD)  # type: ignore[call-arg]
        v = max(values[i], 0.0)
        for level in range(thresholds.size):  # thresholds do not increase: the first one v exceeds
            if v > thresholds[level]:
                levels[i] = level + 1
                for larger in range(level, thresholds.size):
                    above[larger] += 1
                break


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
    not increasing) and set sizes ``ks``, in two compiled passes (the first read cold, the second only
    as far as the ties that complete each set) instead of a few torch passes per level. The map lives
    on the CPU whatever the chunks' device: GPU chunks are read there."""
    thresholds = np.asarray(values, np.float64)
    levels = np.zeros(total, np.uint8)
    above = np.zeros(len(ks), np.int64)
    offset = 0
    for chunk in chunks():
        flat, mine = _flat(chunk.cpu()), levels[offset : offset + chunk.numel()]

        def part(lo: int, hi: int, flat=flat, mine=mine) -> np.ndarray:
            counts = np.zeros(len(ks), np.int64)
            _strict_levels_into(flat[lo:hi], thresholds, mine[lo:hi], counts)
            return counts

        above += sum(_in_parts(flat.size, part))
        offset += flat.size
    remaining = np.maximum(np.asarray(ks, np.int64) - above, 0)
    offset = 0
    for chunk in chunks():
        if remaining.max() == 0:
            break
        flat = _flat(chunk.cpu())
        _tie_levels_into(flat, thresholds, levels[offset : offset + flat.size], remaining)
        offset += flat.size
    return torch.from_numpy(levels)


def _compiled(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in a dtype the loops are compiled for: bfloat16 and float16 widen to float32 exactly
    (numpy has no bfloat16), so their bins, which are float32 bit patterns, are the same."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def _flat(tensor: torch.Tensor) -> np.ndarray:
    return _compiled(tensor.detach()).reshape(-1).contiguous().numpy()


def square_sum(value: torch.Tensor) -> float:
    """sum of squares of a CPU tensor, each square and the sum in float64."""
    flat = _flat(value)
    return float(sum(_in_parts(flat.size, lambda lo, hi: _square_sum(flat[lo:hi]))))


def extra_share_mean(terms: StatTerms) -> float:
    """The mean of ``terms.extra_share()`` over a CPU tensor, summed in float64, nothing formed."""
    if terms.extra is None:
        raise ValueError(NO_EXTRA_TERM)
    base, extra, _ = _arrays(terms)
    squared = terms.squared
    total = sum(_in_parts(base.size, lambda lo, hi: _extra_share_sum(base[lo:hi], extra[lo:hi], squared)))
    return total / base.size if base.size else 0.0


def _arrays(terms: StatTerms) -> tuple[np.ndarray, np.ndarray, int]:
    """base, extra (base again when there is none: never read) and the mode, flat."""
    base = _flat(terms.base)
    if terms.extra is None:
        return base, base, _BASE
    extra = _flat(terms.extra)
    return base, extra, _PLUS_SQUARE if terms.squared else _PLUS


def histogram(terms: StatTerms, shift: int, n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 counts and sums per bin of a stat on the CPU (bin = float32 bits >> shift, < 0 -> 0)."""
    base, extra, mode = _arrays(terms)

    def part(lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        counts, sums = np.zeros(n_bins, np.int64), np.zeros(n_bins, np.float64)
        _histogram_into(base[lo:hi], extra[lo:hi], mode, shift, counts, sums)
        return counts, sums

    parts = _in_parts(base.size, part)
    counts, sums = parts[0]
    for more_counts, more_sums in parts[1:]:
        counts += more_counts
        sums += more_sums
    return torch.from_numpy(counts.astype(np.float64)), torch.from_numpy(sums)


def select_grouped(
    terms: StatTerms, shift: int, starts: np.ndarray, ends: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat indices, float64 values) of a stat's values on the CPU in chosen bins (> 0), grouped by bin:
    bin b's values go to [starts[b], ends[b]) in index order (starts[b] = -1: not chosen). The ranges
    come from a histogram of the same values, which is checked. One pass, in one part: the summary runs
    tensors in threads, and a part could not know where its values of a bin start."""
    base, extra, mode = _arrays(terms)
    size = int(ends[-1])  # ends count the chosen values up to each bin
    index, values = np.empty(size, np.int64), np.empty(size, np.float64)
    cursor = starts.copy()
    chosen = starts >= 0
    _select_grouped(base, extra, mode, shift, chosen, cursor, index, values)
    if not np.array_equal(cursor[chosen], ends[chosen]):
        raise ValueError("the histogram is not the selected values' own: its counts differ")
    return torch.from_numpy(index), torch.from_numpy(values)
