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
