"""Which form the exact engine uses for a matrix's squares, and what it costs (torch-free).

One rule for the engine (``workers.fisher.directions`` picks the form per block) and for the cost
estimate (``backend.cost`` prices the form the engine will pick), so the two cannot drift apart. The
direct form forms each direction's gradient ([o, i], 2 r flop per element for r context rows) and squares
and sums it; the ghost form sums M = sum_j w_j delta_j delta_j^T over its pairs r <= s per output and
multiplies them against the feature pairs once per pass.
"""

from __future__ import annotations

# the direct form's squaring and summing per element, in matmul flops (measured on SmolLM2's blocks:
# benchmarks/bench_squares.py)
DIRECT_ELEMENTWISE_FLOPS = 48


def direct_cost(directions: int, rows: int, out: int, inp: int) -> int:
    """Flops of the direct form, counting its squaring and summing per element."""
    return directions * out * inp * (2 * rows + DIRECT_ELEMENTWISE_FLOPS)


def ghost_cost(directions: int, rows: int, out: int, inp: int) -> int:
    """Flops of the ghost form: M's pairs r <= s, then the pairs against the features."""
    return (directions + inp) * out * rows * (rows + 1)


def prefers_ghost(directions: int, rows: int, out: int, inp: int) -> bool:
    """The cheaper form by cost (memory aside)."""
    return ghost_cost(directions, rows, out, inp) < direct_cost(directions, rows, out, inp)


# up to here M's pairs by rows (a compiled kernel, one core, blocks shared among threads) beat a batch of
# tiny Grams (one per output), and keep half the memory ([pairs, o], not [o, r, r]), so that more blocks
# take the ghost form within its budget: at 32 rows two to three times faster, at 64 a tie, and SmolLM2
# exact at 64 tokens a fifth faster with rows up to 64 than with Grams past 32. With the kernel's
# register blocks rows win past 64 too; left at 64 until a long exact prefix is measured with them, as
# the cost model's ghost term was fitted up to 64
GHOST_ROWWISE_MAX_ROWS = 64


def ghost_entries(rows: int) -> int:
    """Entries of M per output as the engine keeps it (``block_squares.ghost_moments``): its pairs r <= s
    up to ``GHOST_ROWWISE_MAX_ROWS`` rows, the whole r x r past them."""
    return rows * (rows + 1) // 2 if rows <= GHOST_ROWWISE_MAX_ROWS else rows * rows
