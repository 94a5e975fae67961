"""Large zeroed arrays recycled between analyses (workers.fisher.recycled): zeros every time, the same
memory once every view of the last loan is gone, never memory that something still reads."""

from __future__ import annotations

import gc

import pytest
import torch

from workers.fisher import recycled


@pytest.fixture
def small_threshold(monkeypatch):
    """Recycle arrays from 4 kB, keep at most 64 kB free, starting from no slots."""
    monkeypatch.setattr(recycled, "RECYCLED_MIN_BYTES", 4096)
    monkeypatch.setattr(recycled, "KEPT_FREE_BYTES", 65536)
    monkeypatch.setattr(recycled, "_slots", [])


def test_small_arrays_and_other_devices_are_plain_new_zeros(small_threshold):
    like = torch.ones(3)
    small = recycled.zeros((10, 10), like)
    assert small.dtype == like.dtype and torch.equal(small, torch.zeros(10, 10))
    assert recycled.kept_bytes() == (0, 0)
    meta = recycled.zeros((1000, 1000), torch.ones(1, device="meta"))
    assert meta.device.type == "meta" and recycled.kept_bytes() == (0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_freed_array_is_lent_again_zeroed(small_threshold, dtype):
    like = torch.ones(1, dtype=dtype)
    first = recycled.zeros((64, 48), like)
    assert first.dtype == dtype and first.shape == (64, 48) and not first.any()
    first[3] = 7
    address = first.data_ptr()
    assert recycled.kept_bytes() == (first.numel() * first.element_size(), 0)
    del first
    gc.collect()
    again = recycled.zeros((64, 48), like)
    assert again.data_ptr() == address and not again.any()
    assert recycled.kept_bytes()[1] == 0


def test_memory_still_read_through_a_view_is_not_lent_again(small_threshold):
    like = torch.ones(1)
    first = recycled.zeros((64, 64), like)
    first += 2
    row = first[5]  # a view keeps the storage, and so the loan
    as_numpy = first.numpy()  # and so does an array over it
    address = first.data_ptr()
    del first
    gc.collect()
    second = recycled.zeros((64, 64), like)
    assert second.data_ptr() != address and not second.any()
    assert torch.equal(row, torch.full((64,), 2.0)) and (as_numpy == 2).all()
    del row, second
    gc.collect()
    third = recycled.zeros((64, 64), like)
    assert third.data_ptr() != address  # the array is still read
    del as_numpy
    gc.collect()
    assert recycled.zeros((64, 64), like).data_ptr() == address


def test_free_arrays_beyond_the_bound_are_let_go(small_threshold):
    like = torch.ones(1)
    arrays = [recycled.zeros((n, 1024), like) for n in (4, 5, 6, 7, 8)]  # 16-32 kB each, 120 kB in all
    del arrays
    gc.collect()
    assert recycled.kept_bytes() == (0, 120 * 1024)
    recycled.zeros((3, 1024), like)  # a new size, freed at once: with it, at most 64 kB stays free
    # the largest that fit, in turn: 32 kB, then 20 (28, 24 would not)
    assert recycled.kept_bytes() == (0, (12 + 32 + 20) * 1024)


def test_an_analysis_still_held_keeps_its_sums_while_later_ones_run(tiny_random, monkeypatch):
    """The engine through recycled arrays (the table's dense sums, lent from 1 kB here): the same sums
    as without, and a held analysis's sums untouched by later analyses, which reuse what is freed."""
    from backend.vocabulary import STATS
    from workers.engine import AnalysisRequest, run_analysis

    ids = tiny_random.tokenizer.encode("She drank a cup of").ids
    request = AnalysisRequest(input_ids=ids)
    plain = run_analysis(tiny_random, request, 1 << 30)  # its table (128 kB) is below the threshold
    monkeypatch.setattr(recycled, "RECYCLED_MIN_BYTES", 1024)
    monkeypatch.setattr(recycled, "_slots", [])
    held = run_analysis(tiny_random, request, 1 << 30)
    lent, _ = recycled.kept_bytes()
    assert lent > 0  # the table's sums are lent memory
    for _ in range(2):
        later = run_analysis(tiny_random, AnalysisRequest(input_ids=ids[::-1]), 1 << 30)
        del later
        gc.collect()
    assert recycled.kept_bytes()[0] == lent and recycled.kept_bytes()[1] > 0  # freed, and kept
    again = run_analysis(tiny_random, request, 1 << 30)
    for analysis in (held, again):
        for stat in STATS:
            for (name, got), (_, want) in zip(
                analysis.sequence.sums.iter_stat(stat), plain.sequence.sums.iter_stat(stat), strict=True
            ):
                assert torch.equal(got, want), f"{stat} {name}"


def test_a_copy_is_a_contiguous_clone_in_lent_memory(small_threshold):
    value = torch.arange(64 * 48, dtype=torch.float32).reshape(48, 64).T  # not contiguous
    copied = recycled.copy(value)
    assert torch.equal(copied, value) and copied.is_contiguous()
    assert recycled.kept_bytes() == (value.numel() * 4, 0)
    address = copied.data_ptr()
    del copied
    gc.collect()
    again = recycled.copy(value + 1)
    assert again.data_ptr() == address and torch.equal(again, value + 1)


def test_a_positions_squares_are_views_of_one_array_lent_again_to_the_next(small_threshold):
    """``ParameterSums(in_one_array=True)``: every tensor a view of one recycled array, written by the
    product itself and added into after, an expert's slice zeroed around it; the next position's sums
    get the same memory once every view of the last is gone, and sums kept apart never take it."""
    from workers.fisher.block_squares import ParameterSums

    shapes = {"w": (64, 48), "experts": (3, 32, 48)}  # 30 kB: recycled here
    gen = torch.Generator().manual_seed(0)
    left, right = torch.randn(64, 5, generator=gen), torch.randn(5, 48, generator=gen)
    slice_left, slice_right = torch.randn(32, 4, generator=gen), torch.randn(4, 48, generator=gen)
    sums = ParameterSums(shapes, in_one_array=True)
    sums.add_product("w", left, right)
    sums.add_product("w", left.T.contiguous().T, right)  # added in the product, a strided left too
    sums.add_product("experts", slice_left, slice_right, index=1)
    torch.testing.assert_close(sums.values["w"], 2 * left @ right)
    torch.testing.assert_close(sums.values["experts"][1], slice_left @ slice_right)
    assert not sums.values["experts"][[0, 2]].any()
    address = sums.values["w"].untyped_storage().data_ptr()
    assert sums.values["experts"].untyped_storage().data_ptr() == address
    assert recycled.kept_bytes() == ((64 * 48 + 3 * 32 * 48) * 4, 0)

    kept = sums.values["experts"]  # a reader still holds one tensor: the array is not lent again
    del sums
    gc.collect()
    other = ParameterSums(shapes, in_one_array=True)
    other.add("w", torch.ones(64, 48))
    assert other.values["w"].untyped_storage().data_ptr() != address
    torch.testing.assert_close(kept[1], slice_left @ slice_right)
    del kept, other
    gc.collect()
    following = ParameterSums(shapes, in_one_array=True)
    following.add("w", torch.ones(64, 48))
    assert following.values["w"].untyped_storage().data_ptr() == address
    assert torch.equal(following.values["w"], torch.ones(64, 48))
    apart = ParameterSums(shapes)
    apart.add_product("w", left, right)
    assert apart.values["w"].untyped_storage().data_ptr() != address
