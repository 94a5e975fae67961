"""A tensor's top coordinates on the CPU (``cpu_kernels.largest_indices``) against their definition, a
sort: the k largest values or magnitudes, NaN first, ties toward the lower index; cut in parts per
thread or whole; and the same candidates as the torch path (a GPU's) where no two values tie."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.fisher import cpu_kernels, top_sets
from workers.fisher.cpu_kernels import threads as cpu_threads


def _sorted_indices(values: torch.Tensor, k: int, magnitude: bool) -> list[int]:
    keys = values.double().reshape(-1)
    keys = keys.abs() if magnitude else keys
    keys = torch.where(keys.isnan(), torch.inf, keys).numpy()
    order = np.lexsort((np.arange(keys.size), -keys))  # larger first, then the lower index
    return order[:k].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [True, False])
@pytest.mark.parametrize("parts", [False, True])
def test_the_largest_indices_are_a_sorts(monkeypatch, dtype, magnitude, parts):
    if parts:  # a part per thread, the best of each merged
        monkeypatch.setattr(cpu_threads, "PART_MIN_VALUES", 100)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    generator = torch.Generator().manual_seed(7)
    values = torch.randn(5_003, generator=generator).to(dtype)
    values[::7] = values[3]  # ties, of the largest among them
    values[100:150] = 0.0
    values[11], values[4000] = float("nan"), -float("inf")
    for k in (0, 1, 50, 5_003, 6_000):
        found = cpu_kernels.largest_indices(values, k, magnitude).tolist()
        assert found == _sorted_indices(values, k, magnitude), k


def test_fewer_nonzero_values_than_asked_are_filled_with_the_first_zeros():
    values = torch.zeros(3, 40)
    values[1, 5], values[2, 0] = -2.0, 1.0
    assert cpu_kernels.largest_indices(values, 4, magnitude=True).tolist() == [45, 80, 0, 1]


@pytest.mark.parametrize("signed", [True, False])
def test_the_candidates_are_the_torch_paths(signed):
    values = torch.randn(300, 70, generator=torch.Generator().manual_seed(3))
    compiled = top_sets.top_candidates("w", values, signed)
    with cpu_kernels.torch_ops_only():
        assert compiled == top_sets.top_candidates("w", values, signed)
    assert len(compiled) == top_sets.TOP_COORDINATES


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("parts", [False, True])
def test_the_levels_at_thresholds_are_the_torch_paths(monkeypatch, dtype, parts):
    """``levels_at`` on the CPU (one compiled pass) gives torch's searchsorted levels: values tied with a
    threshold are in its set, 0 and negatives in none, NaN and inf in the smallest."""
    if parts:
        monkeypatch.setattr(cpu_threads, "PART_MIN_VALUES", 100)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    generator = torch.Generator().manual_seed(8)
    values = torch.rand(40, 25, generator=generator, dtype=torch.float64).to(dtype)
    named = [float(values[3, 4]), float(values[7, 1]), 0.5]  # two tied with values, q ascending
    named.sort(reverse=True)
    values[0, :4] = torch.tensor([0.0, -1.0, torch.inf, -torch.inf], dtype=dtype)
    values[1, 0] = torch.nan
    got = top_sets.levels_at(values, named)
    with cpu_threads.torch_ops_only():
        want = top_sets.levels_at(values, named)
    assert got.dtype == torch.uint8 and got.shape == values.shape
    assert torch.equal(got, want)
    assert got[3, 4] > 0 and got[7, 1] > 0 and got[0, 0] == 0 and got[0, 1] == 0 and got[0, 2] == 1
    assert got[1, 0] == 1 and set(got.unique().tolist()) == {0, 1, 2, 3}
