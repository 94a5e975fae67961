"""The values of up to three stats in chosen histogram bins (the summary's second pass), grouped by bin.

Definition (the torch path, ``concentration.select_bins``): for each stat, the values v with
(float32 bits of v) >> shift in a chosen bin, with their flat indices, in index order. Here one pass over
the arrays the stats share, testing a vector of values at once for its few chosen bins
(``_chosen_lanes``) and reading again only the values it flags. Tested against the torch path in
tests/test_concentration.py and tests/test_torch_path.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from workers.fisher.cpu_kernels.arrays import _BINNED_MAX, _common_size, _slot, _stat_value
from workers.fisher.cpu_kernels.llvm import _ask, _float32_bits, _trailing_zeros
from workers.fisher.terms import StatTerms

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
    # and ``hit_tops``), and only the values flagged are read again and written: the summary's second
    # pass chooses about 1% of each stat's values, and this takes under half the time of testing them
    # one by one. Otherwise (and for the last, short block) every value is tested against ``chosen``.
    # Not a two-loop form (values, then writes, per block), which was slower. Each stat's value is the
    # shared inlined ``_stat_value`` (as fast as written out); its writes are written out per stat, since
    # a shared helper taking the output arrays and cursor was an order of magnitude slower
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
            v = _stat_value(a, a_plus, a_square, i)
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
            v = _stat_value(b, b_plus, b_square, i)
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
            v = _stat_value(c, c_plus, c_square, i)
            k = _float32_bits(np.float32(v)) >> shift  # type: ignore[call-arg]
            if k > 0 and chosen[2, k]:
                at = cursor[2, k]
                if at < c_out.size:  # past the end only with a histogram of other values
                    c_index[at] = i
                    c_out[at] = v
                    cursor[2, k] = at + 1


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
