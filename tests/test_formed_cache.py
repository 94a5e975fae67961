"""Where first moments are formed: a thread's own buffers inside a one-tensor block, fresh arrays (the
last few kept) outside; and the summary's scratch pool hands out the smallest buffer that fits."""

from __future__ import annotations

import torch

from workers.fisher.first_moments import Factored, FirstMoment, FormedCache, OuterRows, Whole
from workers.fisher.scratch_pool import ScratchPool


def _moment(seed: int, shape=(4, 3)) -> Factored:
    generator = torch.Generator().manual_seed(seed)
    delta, feature = (
        torch.randn(2, shape[0], generator=generator),
        torch.randn(2, shape[1], generator=generator),
    )
    return Factored(shape, torch.float32, torch.device("cpu"), (OuterRows(delta, feature),))


def test_a_block_forms_each_table_into_the_threads_buffer_and_reuses_it_in_the_next():
    cache = FormedCache(0)
    first, second = _moment(1), _moment(2)
    table = FirstMoment({"a": first, "b": second}, cache, "common")
    with cache.one_tensor_at_a_time():
        a = table["a"]
        assert table["a"] is a  # read again in the block: the same array
        b = table["b"]  # the table's buffer holds "a" in this block: another array
        assert b.data_ptr() != a.data_ptr()
        torch.testing.assert_close(a, first.form())
        torch.testing.assert_close(b, second.form())
    with cache.one_tensor_at_a_time():
        b_again = table["b"]
        assert b_again.data_ptr() == a.data_ptr()  # the next block reuses the thread's buffer
        torch.testing.assert_close(b_again, second.form())


def test_outside_a_block_the_last_formed_are_kept_within_the_budget():
    entries = {name: _moment(seed, (64, 64)) for seed, name in enumerate("abc")}
    cache = FormedCache(budget_bytes=64 * 64 * 4)  # one tensor's worth
    table = FirstMoment(entries, cache, "common")
    a = table["a"]
    assert table["a"] is a
    table["b"]  # over the budget: "a" is let go, "b" kept
    assert table["b"] is table["b"] and table["a"] is not a
    torch.testing.assert_close(table["a"], a)


def test_a_moment_sums_its_terms_and_a_difference_stays_small():
    shape = (4, 3)
    whole = torch.randn(shape)
    left = _moment(3).plus(Whole(whole))
    right = _moment(4)
    difference = FirstMoment({"w": left}).minus(FirstMoment({"w": right}))
    assert isinstance(difference.entry("w"), Factored)
    torch.testing.assert_close(difference["w"], _moment(3).form() + whole - right.form())


def test_the_pool_hands_out_the_smallest_buffer_that_fits():
    pool = ScratchPool()
    small, large = torch.empty(10), torch.empty(1000)
    pool.give(large)
    pool.give(small)
    assert pool.take(5, torch.float32, torch.device("cpu")) is small
    assert pool.take(5, torch.float32, torch.device("cpu")) is large
    fresh = pool.take(5, torch.float32, torch.device("cpu"))
    assert fresh.numel() == 5
