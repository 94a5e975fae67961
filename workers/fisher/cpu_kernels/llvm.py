"""LLVM helpers the compiled loops share (numba intrinsics): a float32's bit pattern, a prefetch, the
lowest set bit, and one vector's copy. Each is one instruction where the Python-level loop would take
several, or none (a prefetch)."""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


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
    updates leave the hardware prefetcher behind: asked for ahead, a pass takes 40% less time.
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
