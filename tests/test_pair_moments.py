"""The ghost form's pair moments on the CPU (a compiled kernel of register blocks) against torch's
products, in both float dtypes (outside the float64-throughout modules, which would keep float64)."""

from __future__ import annotations

import pytest
import torch

from workers.fisher import cpu_kernels
from workers.fisher.block_squares import pair_moments_by_products


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("count", "rows", "width"),
    [(25, 32, 48), (6, 7, 37), (5, 1, 16), (3, 10, 19), (1, 5, 5), (4, 4, 32), (9, 33, 64), (7, 5, 403)],
)
def test_compiled_pair_moments_against_products(dtype, count, rows, width):
    """The CPU's register blocks of pairs (4 x 4, short ones at the last rows, the diagonal's upper
    half), the tiles of vectors (the last one short: 403 outputs) and the outputs past the last whole
    vector against every pair's products summed by torch, added into the earlier chunks' moments as
    the direction pass does."""
    generator = torch.Generator().manual_seed(count * 1000 + rows * 10 + width)
    delta = torch.randn(count, rows, width, generator=generator, dtype=torch.float64)
    weights = torch.rand(count, generator=generator, dtype=torch.float64)
    earlier = torch.randn(rows * (rows + 1) // 2, width, generator=generator, dtype=torch.float64)
    want = earlier + pair_moments_by_products(delta, weights)
    got = cpu_kernels.pair_moments(delta.to(dtype), weights.to(dtype), earlier.to(dtype))
    assert got.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * max(count, 1))
