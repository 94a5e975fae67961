"""Loops of the math core compiled for the CPU (numba), where torch's ops would pass over memory
several times. GPU tensors take the torch path of the callers, which these loops are tested against:
``compiled_for`` is the one test of which path a tensor's values take, and ``torch_ops_only`` sends
CPU tensors down the GPU's path (tests/test_torch_path.py runs whole analyses both ways).
``largest_sum`` and ``nested_levels`` read CPU copies of a few values, on a GPU too.

- ``tensor_pass`` (``histogram``), ``tensor_totals`` (``square_sum``, ``extra_share_mean``) and
  ``select_grouped`` (``concentration``): up to three stats given as their terms (``StatTerms``) are
  binned, summed or selected, never formed as arrays, each array read once for all of them. Per call,
  torch's bincount takes three passes over its input (min, max, count), needs an int32 index array as
  large as the input, and sums float32 weights in float32 (1% off over 1e8 values); these read each
  value once, allocate nothing of the input's size and sum in float64. The totals (each stat's, a sum
  of squares for signed stats, rho's mean where torch's ratio took five passes) are summed in vectors,
  apart from the histograms, whose updates go value by value; a selection tests a vector of values at
  once for its few chosen bins (``_chosen_lanes``).
- ``largest_sum`` (``concentration``): the need-th largest of a boundary bin's values and the sum of
  the need largest, by a radix selection on their bit patterns where ``np.partition`` was 17 ns a value.
- ``nested_levels`` (the top-q level map): two passes where torch took about five per level.
- ``block_sums`` (pooled views): a stat's block sums from its terms, in one pass; torch's way formed the
  stat, copied it to float64 and summed it twice with index_add_.
- ``pair_moments`` (the ghost form's M with few rows, ``directions``): blocks of 4 x 4 pairs summed
  over all of a chunk's directions in registers (a kernel written in LLVM's vectors); torch's way
  writes and reads back b x pairs x o products.

A large array is cut into one part per torch thread, each compiled loop running without the GIL in a
thread of its own (the summary runs when torch's threads are idle): a histogram of 2.8e7 values went
from 1.54 to 0.75 ns per value on two cores. A pass over many arrays (the summary's tensors) runs them
in threads instead (``each_in_threads``): cut per call, the ~1e6-value tensors of SmolLM2 spent more
time handing parts to an idle thread than the part saved. Torch's ops in that work run on the thread
that calls them (``torch_threads``): a second OpenMP team slowed every later op of the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from workers.fisher.terms import NO_EXTRA_TERM, StatTerms
from workers.fisher.torch_threads import one_torch_thread

_SHARE = np.empty(0, np.bool_)  # ``_block_sums_into``'s switch to shares: a value, where None is off
PART_MIN_VALUES = 1 << 18  # below this a part costs more to hand to a thread than it saves
_Part = TypeVar("_Part")
_Item = TypeVar("_Item")
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0
_pool_lock = threading.Lock()
_thread_state = threading.local()  # busy: this thread runs items of ``each_in_threads``
_torch_only = 0  # > 0 inside ``torch_ops_only``: process-wide, since summaries run in threads


def compiled_for(where: torch.Tensor | torch.device) -> bool:
    """Whether these loops read a tensor (``where``, or one on that device): those in the CPU's memory.
    The one test every caller makes, so that ``torch_ops_only`` reaches all of them."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return device.type == "cpu" and not _torch_only


@contextmanager
def torch_ops_only() -> Iterator[None]:
    """CPU tensors through the callers' torch ops, as a GPU's are: the GPU's code path, run and tested
    on a machine without one. Not for concurrent use with code that should take the compiled loops."""
    global _torch_only
    _torch_only += 1
    try:
        yield
    finally:
        _torch_only -= 1


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
            with one_torch_thread():  # torch's ops in the work: no second OpenMP team (torch_threads)
                take()
        except BaseException:
            failed.set()  # the other threads stop taking items; the error reaches the caller
            raise
        finally:
            _thread_state.busy = False

    def take() -> None:
        while not failed.is_set():
            with taking:
                i = next(order, None)
            if i is None:
                return
            results[i] = work(items[i])

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


@numba.njit(inline="always")
def _ask(array, i):  # pragma: no cover - compiled
    if array is not None:  # pruned where the argument is None
        _prefetch(array, i + _AHEAD)  # type: ignore[call-arg]


@intrinsic
def _trailing_zeros(typingctx, bits):
    """The index of the lowest set bit of an int64 (64 for none): LLVM's cttz, one instruction."""
    if bits != types.int64:
        return None

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

    return types.int64(bits), codegen


# values a selection tests at once, and the chosen bins below a stat's top range it can test them for
_HIT_LANES = 16
HIT_BINS = 8


@intrinsic
def _chosen_lanes(typingctx, base, plus, square, at, shift, bins, top):
    """Bit j set where value at + j of a stat (base + plus, or base + square * square, rounded to float32
    as the scalar loop does) lies in a chosen bin: one of ``bins`` (int32 [HIT_BINS], padded with a
    value no bin has) or any bin >= ``top``. One vector of ``_HIT_LANES`` values: the compare for
    every value, the few chosen ones left to the scalar code."""
    arrays = [a for a in (base, plus, square) if a != types.none]
    if any(not isinstance(a, types.Array) or a.dtype not in (types.float32, types.float64) for a in arrays):
        return None
    wide = any(a.dtype == types.float64 for a in arrays)  # numba's scalar arithmetic widens likewise

    def codegen(context, builder, signature, args):
        element = ir.DoubleType() if wide else ir.FloatType()
        vector = ir.VectorType(element, _HIT_LANES)
        i32 = ir.IntType(32)
        lanes = ir.VectorType(i32, _HIT_LANES)

        def load(k):
            own = ir.VectorType(
                ir.DoubleType() if signature.args[k].dtype == types.float64 else ir.FloatType(), _HIT_LANES
            )
            data = context.make_array(signature.args[k])(context, builder, args[k]).data
            value = builder.load(builder.bitcast(builder.gep(data, [args[3]]), own.as_pointer()), align=4)
            return builder.fpext(value, vector) if own != vector else value

        value = load(0)
        if signature.args[1] != types.none:
            value = builder.fadd(value, load(1))
        if signature.args[2] != types.none:
            extra = load(2)
            value = builder.fadd(value, builder.fmul(extra, extra))  # rounded twice, as the scalar code
        if wide:
            value = builder.fptrunc(value, ir.VectorType(ir.FloatType(), _HIT_LANES))
        undefined = ir.Constant(lanes, ir.Undefined)
        first = ir.Constant(lanes, [0] * _HIT_LANES)

        def splat(scalar):
            return builder.shuffle_vector(
                builder.insert_element(undefined, scalar, ir.Constant(i32, 0)), undefined, first
            )

        # arithmetic shift: a negative value's bin is negative, never chosen (as ``k > 0`` in the loops)
        k = builder.ashr(builder.bitcast(value, lanes), splat(builder.trunc(args[4], i32)))
        hit = builder.icmp_signed(">=", k, splat(builder.trunc(args[6], i32)))
        chosen = context.make_array(signature.args[5])(context, builder, args[5]).data
        for slot in range(HIT_BINS):
            b = builder.load(builder.gep(chosen, [ir.Constant(ir.IntType(64), slot)]))
            hit = builder.or_(hit, builder.icmp_signed("==", k, splat(b)))
        return builder.zext(builder.bitcast(hit, ir.IntType(_HIT_LANES)), ir.IntType(64))

    return types.int64(base, plus, square, at, shift, bins, top), codegen


@numba.njit(nogil=True, cache=True)
def _select_into(  # pragma: no cover - compiled
    size,
    a, a_plus, a_square, a_index, a_out,
    b, b_plus, b_square, b_index, b_out,
    c, c_plus, c_square, c_index, c_out,
    shift, chosen, cursor, hit_bins, hit_tops, vector,
):  # fmt: skip
    # Up to three stats (a, b, c: base, + plus, + square * square; None: switched off), each value in
    # a chosen bin of its stat written where cursor[stat, bin] says. ``vector``: each whole block of
    # _HIT_LANES values is first tested in vectors (``_chosen_lanes``, the chosen bins as ``hit_bins``
    # and ``hit_tops``), and only the values flagged are read again and written. SmolLM2's second
    # summary pass chooses 0.9% of each stat's values: on one core of an AVX2 EPYC its selections
    # took 0.58-0.62 s tested value by value, 0.24-0.27 s this way. Otherwise (and for the last, short
    # block) every value is tested against ``chosen``. Not a two-loop form (values, then writes, per
    # block): it measured 3.5 ns per value against 1.3-2.8 on a 2 GHz EPYC. Written out per stat: a
    # shared inlined helper taking the arrays ran at 40 ns per value
    for lo in range(0, size, _HIT_LANES):
        hi = min(lo + _HIT_LANES, size)
        _ask(a, lo), _ask(a_plus, lo), _ask(a_square, lo), _ask(b, lo), _ask(b_plus, lo), _ask(b_square, lo)
        _ask(c, lo), _ask(c_plus, lo), _ask(c_square, lo)
        a_hits = b_hits = c_hits = (np.int64(1) << (hi - lo)) - 1  # every value tested here
        if vector and hi - lo == _HIT_LANES:
            if a is not None:
                a_hits = _chosen_lanes(a, a_plus, a_square, lo, shift, hit_bins[0], hit_tops[0])  # type: ignore[call-arg]
            if b is not None:
                b_hits = _chosen_lanes(b, b_plus, b_square, lo, shift, hit_bins[1], hit_tops[1])  # type: ignore[call-arg]
            if c is not None:
                c_hits = _chosen_lanes(c, c_plus, c_square, lo, shift, hit_bins[2], hit_tops[2])  # type: ignore[call-arg]
        # the values flagged, lowest first (index order within a bin); a branch per value cost more
        while a is not None and a_hits:
            i = lo + _trailing_zeros(a_hits)  # type: ignore[call-arg]
            a_hits &= a_hits - 1
            v = a[i]
            if a_plus is not None:
                v = v + a_plus[i]
            if a_square is not None:
                v = v + a_square[i] * a_square[i]
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
            if k > 0 and chosen[0, k]:
                at = cursor[0, k]
                if at < a_out.size:  # past the end only with a histogram of other values
                    a_index[at] = i
                    a_out[at] = v
                    cursor[0, k] = at + 1
        while b is not None and b_hits:
            i = lo + _trailing_zeros(b_hits)  # type: ignore[call-arg]
            b_hits &= b_hits - 1
            v = b[i]
            if b_plus is not None:
                v = v + b_plus[i]
            if b_square is not None:
                v = v + b_square[i] * b_square[i]
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
            if k > 0 and chosen[1, k]:
                at = cursor[1, k]
                if at < b_out.size:  # past the end only with a histogram of other values
                    b_index[at] = i
                    b_out[at] = v
                    cursor[1, k] = at + 1
        while c is not None and c_hits:
            i = lo + _trailing_zeros(c_hits)  # type: ignore[call-arg]
            c_hits &= c_hits - 1
            v = c[i]
            if c_plus is not None:
                v = v + c_plus[i]
            if c_square is not None:
                v = v + c_square[i] * c_square[i]
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
            if k > 0 and chosen[2, k]:
                at = cursor[2, k]
                if at < c_out.size:  # past the end only with a histogram of other values
                    c_index[at] = i
                    c_out[at] = v
                    cursor[2, k] = at + 1


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
    # One loop, not values then updates per block: on an AVX-512 EPYC the block form ran at 3.0-3.7 ns
    # per histogram value, this one at 1.0-1.8. On a 2 GHz AVX2 EPYC it had been the other way round
    # (one loop 8.3 ns, blocks 3.4-3.9): the better form is the machine's, and the one measured last is
    # kept (on the AVX2 EPYC of fad5637, binning and summing in one block loop lost: 5.2-6.4 ns per value
    # against 3.8-5.6 for the two passes)
    for i in range(size):
        if i % _LINE_VALUES == 0:
            _ask(a, i), _ask(a_plus, i), _ask(a_square, i), _ask(b, i), _ask(b_plus, i), _ask(b_square, i)
            _ask(c, i), _ask(c_plus, i), _ask(c_square, i)
        if a is not None:
            v = a[i]
            if a_plus is not None:
                v = v + a_plus[i]
            if a_square is not None:
                v = v + a_square[i] * a_square[i]
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]  # numba supplies the context
            k = k if k > 0 else 0  # rounding-level negatives: bin 0, with the zeros
            counts[0, k] += 1
            sums[0, k] += v
        if b is not None:
            v = b[i]
            if b_plus is not None:
                v = v + b_plus[i]
            if b_square is not None:
                v = v + b_square[i] * b_square[i]
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
            k = k if k > 0 else 0
            counts[1, k] += 1
            sums[1, k] += v
        if c is not None:
            v = c[i]
            if c_plus is not None:
                v = v + c_plus[i]
            if c_square is not None:
                v = v + c_square[i] * c_square[i]
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
            k = k if k > 0 else 0
            counts[2, k] += 1
            sums[2, k] += v


# M's pairs in blocks of 4 x 4 rows, one vector of outputs at a time: per direction four rows r and four
# rows s are loaded and their sixteen products added to accumulators that stay in registers for all of
# the chunk's directions. Pair by pair, M's row was loaded and stored for every direction and eight rows
# loaded for four products: 20-34 GFLOP/s on one core of an AVX-512 EPYC, 54-66 this way (SmolLM2's
# 1536, 576 and 192 outputs, 25 directions, 32 rows: 1.81 -> 0.74, 0.45 -> 0.25, 0.17 -> 0.09 ms).
# A loop compiled from Python gets no such kernel: LLVM keeps the sixteen accumulator rows in memory,
# each behind a run-time overlap check, or does not vectorize the loop at all.
_PAIR_BLOCK = 4
# vectors of outputs copied into the tile together. One vector at a time, the copy read one line from
# each of a chunk's direction rows (820 at 5 tokens, 6 kB apart at 1536 outputs), each on a page of its
# own, and waited on them: SmolLM2's ghost moments of one chunk at 5 tokens (164 directions, one core
# of a Xeon) took 51 ms, 42 with tiles of 2 vectors, 30 with 4, 26 with 8, 31 with 16 or 32 (the tile
# no longer in the core's cache). A tile of 8 reads 512 bytes of each row. Each block of pairs runs
# over the tile's vectors in turn, its outputs adjacent in M's rows: at 32 rows (528 pairs, 26
# directions) 15.2-15.6 -> 11.5-14.1 ms for SmolLM2's outputs, at 5 rows 29 -> 30 ms
_PAIR_TILE_VECTORS = 8
_PAIR_TILE_BYTES = 512 << 10  # fewer vectors where more rows would not leave the tile in the cache
_VECTOR_BYTES = 64  # one AVX-512 register (LLVM splits it in two on a CPU with AVX2 only)


def _vector_type(dtype) -> tuple[ir.VectorType, int]:
    """The LLVM vector of ``_VECTOR_BYTES`` of a numba float type, and its elements' alignment."""
    single = dtype == types.float32
    size = 4 if single else 8
    return ir.VectorType(ir.FloatType() if single else ir.DoubleType(), _VECTOR_BYTES // size), size


@intrinsic
def _copy_vector(typingctx, source, source_at, target, target_at):
    """target[target_at : +lanes] = source[source_at : +lanes] (flat arrays) as one vector."""
    if source.dtype not in (types.float32, types.float64):
        return None

    def codegen(context, builder, signature, args):
        vector, align = _vector_type(source.dtype)
        read = context.make_array(signature.args[0])(context, builder, args[0]).data
        write = context.make_array(signature.args[2])(context, builder, args[2]).data
        value = builder.load(builder.bitcast(builder.gep(read, [args[1]]), vector.as_pointer()), align=align)
        builder.store(value, builder.bitcast(builder.gep(write, [args[3]]), vector.as_pointer()), align=align)
        return context.get_dummy_value()

    return types.void(source, source_at, target, target_at), codegen


# the register kernels, one per shape of block (rows r, rows s, on the diagonal): only the last block
# of rows is short, and it holds no pair off the diagonal; an off-diagonal block is short in s only
_PAIR_SHAPES = [(k, k, True) for k in range(1, _PAIR_BLOCK + 1)]
_PAIR_SHAPES += [(_PAIR_BLOCK, k, False) for k in range(1, _PAIR_BLOCK + 1)]


@numba.njit(inline="always")
def _pair_shape_key(height: int, breadth: int, diagonal: bool) -> int:  # pragma: no cover - compiled
    return (height * (_PAIR_BLOCK + 1) + breadth) * 2 + int(diagonal)


@intrinsic
def _pair_block(typingctx, tile, weights, left, right, step, count, out, out_at, out_width, shape):
    """out[out_at[i] + j out_width : +lanes] += sum_{b < count} w_b tile[left + b step + i lanes : +lanes]
    * tile[right + b step + j lanes : +lanes] for the block's i < height, j < breadth (j >= i on the
    diagonal), ``shape`` = ``_pair_shape_key(height, breadth, diagonal)``. ``tile`` (flat): each
    direction's rows, one vector of lanes each, ``step`` apart. The sums stay in registers for all b."""
    if tile.dtype not in (types.float32, types.float64) or out_at.dtype != types.int64:
        return None

    def codegen(context, builder, signature, args):
        vector, align = _vector_type(tile.dtype)
        lanes = vector.count
        i64 = ir.IntType(64)
        values = context.make_array(signature.args[0])(context, builder, args[0]).data
        weight_of = context.make_array(signature.args[1])(context, builder, args[1]).data
        totals = context.make_array(signature.args[6])(context, builder, args[6]).data
        out_rows = context.make_array(signature.args[7])(context, builder, args[7]).data
        left_at, right_at, direction_step, directions = args[2:6]
        out_step = args[8]
        fma_name = f"llvm.fma.v{lanes}f{32 if tile.dtype == types.float32 else 64}"
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3), fma_name)
        zero = ir.Constant(vector, [0.0] * lanes)
        undefined = ir.Constant(vector, ir.Undefined)
        broadcast = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)

        def at(pointer, index):
            return builder.bitcast(builder.gep(pointer, [index]), vector.as_pointer())

        def kernel(height: int, breadth: int, diagonal: bool, done) -> None:
            entries = [(i, j) for i in range(height) for j in range(breadth) if not diagonal or j >= i]
            entry = builder.block
            loop = builder.append_basic_block("pairs.loop")
            store = builder.append_basic_block("pairs.store")
            builder.cbranch(builder.icmp_signed(">", directions, ir.Constant(i64, 0)), loop, store)

            builder.position_at_end(loop)
            b = builder.phi(i64)
            b.add_incoming(ir.Constant(i64, 0), entry)
            sums = {e: builder.phi(vector) for e in entries}
            for phi in sums.values():
                phi.add_incoming(zero, entry)
            offset = builder.mul(b, direction_step)

            def row(start, k):
                index = builder.add(builder.add(start, offset), ir.Constant(i64, k * lanes))
                return builder.load(at(values, index), align=align)

            weight = builder.insert_element(
                undefined, builder.load(builder.gep(weight_of, [b])), ir.Constant(i64, 0)
            )
            weight = builder.shuffle_vector(weight, undefined, broadcast)  # w_b in every lane
            lefts = [builder.fmul(row(left_at, i), weight) for i in range(height)]
            rights = [row(right_at, j) for j in range(breadth)]
            added = {(i, j): builder.call(fma, [lefts[i], rights[j], sums[i, j]]) for i, j in entries}
            following = builder.add(b, ir.Constant(i64, 1))
            last = builder.block
            for e in entries:
                sums[e].add_incoming(added[e], last)
            b.add_incoming(following, last)
            builder.cbranch(builder.icmp_signed("<", following, directions), loop, store)

            builder.position_at_end(store)
            results = {}
            for e in entries:  # LLVM wants a block's phis first
                results[e] = builder.phi(vector)
                results[e].add_incoming(zero, entry)
                results[e].add_incoming(added[e], last)
            row_at = [builder.load(builder.gep(out_rows, [ir.Constant(i64, i)])) for i in range(height)]
            for (i, j), value in results.items():
                pointer = at(totals, builder.add(row_at[i], builder.mul(out_step, ir.Constant(i64, j))))
                builder.store(builder.fadd(builder.load(pointer, align=align), value), pointer, align=align)
            builder.branch(done)

        done = builder.append_basic_block("pairs.done")
        choose = builder.switch(args[9], done)  # a shape not in the list: nothing (never asked)
        for height, breadth, diagonal in _PAIR_SHAPES:
            case = builder.append_basic_block(f"pairs.{height}x{breadth}{'d' if diagonal else ''}")
            key = _pair_shape_key.py_func(height, breadth, diagonal)
            choose.add_case(ir.Constant(args[9].type, key), case)
            builder.position_at_end(case)
            kernel(height, breadth, diagonal, done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return types.void(tile, weights, left, right, step, count, out, out_at, out_width, shape), codegen


@numba.njit(nogil=True, cache=True)
def _pair_moments_into(delta, weights, out):  # pragma: no cover - compiled
    count, rows, width = delta.shape
    lanes = _VECTOR_BYTES // delta.itemsize
    values, totals = delta.reshape(-1), out.reshape(-1)
    first = np.empty(rows, np.int64)  # M's row of the pair (r, r)
    for r in range(rows):
        first[r] = r * rows - r * (r - 1) // 2
    out_at = np.empty(_PAIR_BLOCK, np.int64)  # where a block's row i of pairs starts in ``totals``
    # vectors of outputs of every row and direction, copied together (``_PAIR_TILE_VECTORS``): read in
    # place, rows width apart (6 kB at 1536 outputs) fall into a few cache sets and evict each other
    per_vector = count * rows * lanes  # one vector of every row and direction, in the tile
    vectors = width // lanes
    tile_vectors = max(1, min(_PAIR_TILE_VECTORS, vectors, _PAIR_TILE_BYTES // (per_vector * delta.itemsize)))
    tile = np.empty(tile_vectors * per_vector, delta.dtype)
    for first_vector in range(0, vectors, tile_vectors):
        tiled = min(tile_vectors, vectors - first_vector)
        for k in range(count * rows):
            for u in range(tiled):
                at = k * width + (first_vector + u) * lanes
                _copy_vector(values, at, tile, u * per_vector + k * lanes)  # type: ignore[call-arg]
        for r in range(0, rows, _PAIR_BLOCK):
            height = min(_PAIR_BLOCK, rows - r)
            for s in range(r, rows, _PAIR_BLOCK):
                shape = _pair_shape_key(height, min(_PAIR_BLOCK, rows - s), r == s)
                for u in range(tiled):  # a block's outputs of the tile's vectors are adjacent in M's rows
                    o = (first_vector + u) * lanes
                    for i in range(height):  # the pair (r + i, s + j) is M's row first[r + i] + s + j - r - i
                        out_at[i] = (first[r + i] + s - r - i) * width + o
                    start = u * per_vector
                    _pair_block(
                        tile,
                        weights,
                        start + r * lanes,
                        start + s * lanes,
                        rows * lanes,
                        count,
                        totals,
                        out_at,
                        width,
                        shape,
                    )  # type: ignore[call-arg]
    for o in range(vectors * lanes, width):  # outputs past the last whole vector
        for b in range(count):
            for r in range(rows):
                weighted = weights[b] * delta[b, r, o]
                for s in range(r, rows):
                    out[first[r] + s - r, o] += weighted * delta[b, s, o]


def pair_moments(
    delta: torch.Tensor, weights: torch.Tensor, into: torch.Tensor | None = None
) -> torch.Tensor:
    """[pairs, o]: sum_b w_b delta[b, r, o] delta[b, s, o] for the pairs r <= s in row-major order, in
    delta's dtype (as torch's matrix-vector product sums them); added into ``into`` (earlier chunks'
    moments, returned) where it is the loop's dtype: no new array to zero and add (at 32 tokens on
    SmolLM2 those were a third of the loop's own time)."""
    count, rows, width = delta.shape
    values = _compiled(delta.detach()).contiguous()
    weights = weights.detach().to(values.dtype).contiguous()
    if into is not None and into.dtype == values.dtype and into.is_contiguous():
        _pair_moments_into(values.numpy(), weights.numpy(), into.numpy())
        return into
    out = torch.zeros(rows * (rows + 1) // 2, width, dtype=values.dtype)
    _pair_moments_into(values.numpy(), weights.numpy(), out.numpy())
    out = out.to(delta.dtype)
    return out if into is None else into.add_(out)


@numba.njit(inline="always", error_model="numpy")  # x / 0 is inf or nan, as in torch
def _extra_share(whole, extra, squared):  # pragma: no cover - compiled
    # the share of ``whole`` (base + extra, or base + extra * extra) that its extra term carries, in the
    # arrays' dtype and rounded as ``StatTerms.extra_share`` rounds it: extra / whole first (times
    # extra again when squared); 0 where it is not finite (0/0: a zero sum has zero terms)
    part = extra / whole
    if squared:
        part = part * extra
    return np.float64(part) if np.isfinite(part) else 0.0


@numba.njit(nogil=True, cache=True, error_model="numpy")  # x / 0 is inf or nan, as in torch
def _block_sums_into(  # pragma: no cover - compiled
    a, a_plus, a_square, share, width, row_edges, col_edges, grid
):
    # A stat (a: base, + plus, + square * square; None: no such term; ``share`` not None: the extra
    # term's share of that sum instead, as ``StatTerms.extra_share`` rounds it) as rows of ``width``
    # values: each row block's column sums in float64 (a loop over columns, which the compiler
    # vectorizes), then those sums per column block, in the order torch's index_add_ over rows and then
    # columns adds them. Views of each row indexed from 0 take vectors: a[at + j] kept the loop scalar
    # (the embedding table's rows, one core of a Xeon: 1.41-1.76 -> 0.27-0.52 ns per value, the same
    # sums bit for bit)
    column = np.empty(width, np.float64)
    for rb in range(row_edges.size - 1):
        column[:] = 0.0
        for i in range(row_edges[rb], row_edges[rb + 1]):
            at = i * width
            row = a[at : at + width]
            if a_plus is not None:  # pruned where the argument is None
                plus = a_plus[at : at + width]
            if a_square is not None:
                square = a_square[at : at + width]
            for j in range(width):
                v = row[j]
                if a_plus is not None:
                    v = v + plus[j]
                if a_square is not None:
                    v = v + square[j] * square[j]
                if share is None:  # pruned: the argument's type decides
                    column[j] += np.float64(v)
                elif a_plus is not None:
                    column[j] += _extra_share(v, plus[j], False)
                elif a_square is not None:
                    column[j] += _extra_share(v, square[j], True)
        for cb in range(col_edges.size - 1):
            total = 0.0
            for j in range(col_edges[cb], col_edges[cb + 1]):
                total += column[j]
            grid[rb, cb] = total


def block_sums(
    terms: StatTerms, width: int, row_edges: Sequence[int], col_edges: Sequence[int], share: bool = False
) -> np.ndarray:
    """float64 [row blocks, column blocks]: the sums of a stat of CPU arrays (``StatTerms``, not formed;
    ``share``: its ``extra_share()``, rho's form) seen as rows of ``width`` values over the blocks the
    edges give. One pass, one core: the caller runs tensors in threads."""
    if share and terms.extra is None:
        raise ValueError(NO_EXTRA_TERM)
    a, a_plus, a_square = _slot(terms)
    if a.size != (row_edges[-1] if len(row_edges) else 0) * width or (
        len(col_edges) and col_edges[-1] != width
    ):
        raise ValueError("the block edges do not cover the stat's rows and columns")
    grid = np.zeros((max(0, len(row_edges) - 1), max(0, len(col_edges) - 1)), np.float64)
    rows, cols = np.asarray(row_edges, np.int64), np.asarray(col_edges, np.int64)
    _block_sums_into(a, a_plus, a_square, _SHARE if share else None, width, rows, cols, grid)
    return grid


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


def _compiled(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in a dtype the loops are compiled for: bfloat16 and float16 widen to float32 exactly
    (numpy has no bfloat16), so their bins, which are float32 bit patterns, are the same."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def _flat(tensor: torch.Tensor) -> np.ndarray:
    return _compiled(tensor.detach()).reshape(-1).contiguous().numpy()


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


def _common_size(arrays: Sequence[np.ndarray | None]) -> int:
    """The one size of a pass's arrays (0 for none)."""
    present = [array for array in arrays if array is not None]
    size = present[0].size if present else 0
    if any(array.size != size for array in present):
        raise ValueError("the arrays of one pass differ in size")
    return size


# values summed apart before they are added to a total. One core of a 2-core Xeon, 2.8e7 values of
# three stats, each stat's values formed into a float64 buffer and summed apart: 1.87 ns per value with
# blocks of 1024 (4 kB of float32, one page: the hardware's prefetcher stops at its end, and each
# block's first lines came from memory), 1.31-1.41 with 8192, 1.32 with 16384, 1.5 with 32768 (three
# arrays' blocks no longer stay in the core's cache); blocks of 16384 summed as they are formed
# (``_binned_sum``): 1.01-1.16
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
    # the values cost 1.32 ns where this takes 1.01-1.16 (the block sizes' measurements above)
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
    # SmolLM2's light summary (on-policy, two threads): 0.30-0.58 s when its totals came from the
    # histogram pass, 0.16-0.23 s in blocks of 1024 (one core of an AVX2 EPYC, 2.8e7 values: 1.57 ns
    # per value, 3.36 in the histogram pass); on a 2-core Xeon 0.17-0.19 s so, 0.13-0.14 s now. The
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


def _cut(array: np.ndarray | None, lo: int, hi: int) -> np.ndarray | None:
    return None if array is None else array[lo:hi]


_BINNED_MAX = 3  # the summary's curve stats: the Fisher, the uncentered and the raw Fisher


def _slot(terms: StatTerms) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(base, the extra term added, the extra term added squared): one of the last two is None."""
    base = _flat(terms.base)
    if terms.extra is None:
        return base, None, None
    extra = _flat(terms.extra)
    return (base, None, extra) if terms.squared else (base, extra, None)


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
    12 us a call on small ones (SmolLM2: 37 ms of the summary), this a few passes of ~1 ns."""
    if not 1 <= need <= values.size:
        raise ValueError(f"need {need} of {values.size} values")
    if values.dtype != np.float64:
        raise ValueError(f"the values must be float64, not {values.dtype}")
    value, above_sum, above = _largest_into(np.ascontiguousarray(values), need)
    return float(value), float(above_sum) + (need - int(above)) * float(value)


def square_sum(value: torch.Tensor) -> float:
    """sum of squares of a CPU tensor, each square and the sum in float64."""
    return tensor_totals([], 0, squared=value).square_sum


def extra_share_mean(terms: StatTerms) -> float:
    """The mean of ``terms.extra_share()`` over a CPU tensor, summed in float64, nothing formed."""
    if terms.extra is None:
        raise ValueError(NO_EXTRA_TERM)
    size = terms.base.numel()
    return tensor_totals([], 0, shares=terms).share_sum / size if size else 0.0


def histogram(terms: StatTerms, shift: int, n_bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 counts and sums per bin of a stat on the CPU (bin = float32 bits >> shift, < 0 -> 0)."""
    found = tensor_pass([terms], shift, n_bins)
    return found.counts[0], found.sums[0]


def _hit_bins(chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
    """``chosen`` (bool [stats, bins]) as ``_chosen_lanes`` tests it: each stat's chosen bins below its
    top range (int32 [stats, HIT_BINS], padded with a value no bin has), the top range's first bin
    (the bin count where the last bin is not chosen), and whether every stat's bins fit."""
    bins = np.full((chosen.shape[0], HIT_BINS), -(1 << 30), np.int32)
    tops = np.empty(chosen.shape[0], np.int64)
    fits = True
    for k, row in enumerate(chosen):
        not_chosen = np.flatnonzero(~row)
        tops[k] = not_chosen[-1] + 1 if not_chosen.size else 0
        below = np.flatnonzero(row[: tops[k]])
        fits = fits and below.size <= HIT_BINS
        bins[k, : min(below.size, HIT_BINS)] = below[:HIT_BINS]
    return bins, tops, fits


def select_grouped(
    binned: Sequence[StatTerms], shift: int, ranges: Sequence[tuple[np.ndarray, np.ndarray]]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each of up to three stats of CPU arrays of one size: (flat indices, float64 values) of its
    values in chosen bins (> 0), grouped by bin: bin b's values go to [starts[b], ends[b]) of that
    stat's ``ranges``, in index order (starts[b] = -1: not chosen). The ranges come from a histogram of
    the same values, which is checked. One pass over the arrays the stats share, in one part: the
    summary runs tensors in threads, and a part could not know where its values of a bin start."""
    if len(binned) > _BINNED_MAX or len(ranges) != len(binned):
        raise ValueError(f"one range pair per stat, and at most {_BINNED_MAX} stats in one pass")
    chosen = np.zeros((_BINNED_MAX, ranges[0][0].size if ranges else 1), dtype=np.bool_)
    cursor = np.zeros(chosen.shape, np.int64)
    slots: list[tuple[np.ndarray | None, ...]] = []
    for k, (terms, (starts, ends)) in enumerate(zip(binned, ranges, strict=True)):
        size = int(ends[-1])  # ends count the chosen values up to each bin
        chosen[k], cursor[k] = starts >= 0, starts
        slots.append((*_slot(terms), np.empty(size, np.int64), np.empty(size, np.float64)))
    slots += [(None,) * 5] * (_BINNED_MAX - len(slots))
    (a, a_plus, a_square, a_index, a_out), (b, b_plus, b_square, b_index, b_out) = slots[:2]
    c, c_plus, c_square, c_index, c_out = slots[2]
    size = _common_size([array for slot in slots for array in slot[:3]])
    _select_into(
        size,
        a, a_plus, a_square, a_index, a_out,
        b, b_plus, b_square, b_index, b_out,
        c, c_plus, c_square, c_index, c_out,
        shift, chosen, cursor, *_hit_bins(chosen),
    )  # fmt: skip
    found = []
    for k, (_, ends) in enumerate(ranges):
        if not np.array_equal(cursor[k][chosen[k]], ends[chosen[k]]):
            raise ValueError("the histogram is not the selected values' own: its counts differ")
        index, values = slots[k][3:]
        found.append((torch.from_numpy(index), torch.from_numpy(values)))
    return found
