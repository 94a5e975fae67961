"""The two forms of a block's squares, timed on SmolLM2-135M's block shapes (one run, not a test).

For a matrix block with r rows (context tokens), b directions and an [o, i] weight, prints the time of
the direct form (per-direction gradients in tiles of output rows, squared and summed in cache), of the
ghost form (M = sum_b w_b delta_b delta_b^T per output, then pairs r <= s against the features), each
as a multiple of 2 b r o i at the matmul rate measured in the same run, and which one the engine's
cost model picks. ``DIRECT_ELEMENTWISE_FLOPS`` in ``backend/square_forms.py`` is read off this.

    .venv/bin/python benchmarks/bench_squares.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.square_forms import prefers_ghost  # noqa: E402
from workers.fisher.block_squares import (  # noqa: E402
    direct_squares,
    ghost_moments,
    ghost_squares,
)
from workers.throughput import measure  # noqa: E402

SHAPES = [(576, 576), (1536, 576), (576, 1536)]  # (out, in): q/o, gate/up, down


def _time(fn, *args, repeat: int = 3) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def _ghost(x: torch.Tensor, delta: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return ghost_squares(ghost_moments(delta, weights), x)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rate = measure("cpu", size=2048) if dtype == torch.float32 else None
    if rate is None:
        a = torch.randn(1024, 1024, dtype=dtype)
        rate = 2 * 1024**3 / _time(torch.matmul, a, a)
    print(f"matmul rate {rate / 1e9:.1f} GFLOP/s ({args.dtype})")
    print(f"{'b':>4} {'r':>4} {'o x i':>11} {'direct':>9} {'ghost':>9}  picked")
    print("(times as multiples of 2 b r o i at that rate)")
    for directions in (20, 256):
        for rows in (5, 12, 28, 64):
            for out, inp in SHAPES:
                x = torch.randn(rows, inp, dtype=dtype)
                delta = torch.randn(directions, rows, out, dtype=dtype)
                weights = torch.rand(directions, dtype=dtype)
                floor = 2 * directions * rows * out * inp / rate
                direct = _time(direct_squares, x, delta, weights) / floor
                ghost = _time(_ghost, x, delta, weights) / floor
                picked = "ghost" if prefers_ghost(directions, rows, out, inp) else "direct"
                print(f"{directions:>4} {rows:>4} {out:>5}x{inp:<5} {direct:>9.2f} {ghost:>9.2f}  {picked}")


if __name__ == "__main__":
    main()
