"""The ghost form's pair moments M[(r, s), o] = sum_b w_b delta[b, r, o] delta[b, s, o] for r <= s.

Definition (the torch path, ``block_squares.pair_moments_by_products``): the products of every pair of
rows, weighted and summed over the chunk's directions. Here blocks of 4 x 4 pairs are summed over all of
a chunk's directions in registers (a kernel written in LLVM's vectors): pair by pair, M's row was read
and written for every direction, and a loop compiled from Python keeps the sixteen sums in memory.
Tested against the torch forms in tests/test_pair_moments.py.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from workers.fisher.cpu_kernels.arrays import _compiled
from workers.fisher.cpu_kernels.llvm import _VECTOR_BYTES, _copy_vector, _vector_type

# M's pairs in blocks of 4 x 4 rows, one vector of outputs at a time: per direction four rows r and four
# rows s are loaded and their sixteen products added to accumulators that stay in registers for all of
# the chunk's directions. Pair by pair, M's row was loaded and stored for every direction and eight rows
# loaded for four products: this runs about two and a half times as fast. A loop compiled from Python
# gets no such kernel: LLVM keeps the sixteen accumulator rows in memory,
# each behind a run-time overlap check, or does not vectorize the loop at all.
_PAIR_BLOCK = 4
# vectors of outputs copied into the tile together. One vector at a time, the copy read one line from
# each of a chunk's direction rows, each on a page of its own, and waited on them; 8 vectors (512 bytes
# of each row) were the fastest of 1 to 32, and more leave the tile out of the core's cache. Each block
# of pairs runs over the tile's vectors in turn, so that its outputs are adjacent in M's rows
_PAIR_TILE_VECTORS = 8
_PAIR_TILE_BYTES = 512 << 10  # fewer vectors where more rows would not leave the tile in the cache


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
