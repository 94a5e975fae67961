"""Log-bin histograms, bin selection and exact top-k sums against direct computations (sort, bincount)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from workers.fisher import cpu_kernels
from workers.fisher.concentration import (
    N_BINS,
    BinChoice,
    _bins,
    collect_bins,
    histogram,
    histograms_in_one_pass,
    plans_of,
    select_bins,
    select_in_one_pass,
    thresholds,
    totals_in_one_pass,
)
from workers.fisher.cpu_kernels import threads as cpu_threads
from workers.fisher.terms import StatTerms


def _values(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Non-negative values over many octaves, with zeros, ties, denormals and rounding-level negatives."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.rand(n, generator=generator, dtype=torch.float64).pow(12).to(dtype)
    values[:: max(1, n // 50)] = 0.0
    values[1 :: max(1, n // 20)] = 0.25  # ties
    values[2] = 1e-40  # a float32 denormal: bin 0, like a zero
    values[3] = -1e-9  # rounding below zero: bin 0
    return values


def _reference_histogram(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    index = _bins(values)
    counts = torch.bincount(index, minlength=N_BINS).double()
    sums = torch.bincount(index, weights=values.double(), minlength=N_BINS)
    sums[0] = 0.0
    return counts, sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [7, 1_100_000 + 3])
def test_histogram_counts_and_float64_sums_match_bincount(dtype, n):
    values = _values(n, dtype)
    hist = histogram([values[: n // 3], values[n // 3 :]])
    counts, sums = _reference_histogram(values)
    assert hist.total_count == n
    assert torch.equal(hist.counts, counts)
    torch.testing.assert_close(hist.sums, sums, rtol=1e-12, atol=0.0)


def test_histogram_sums_do_not_lose_increments_past_float32():
    """2^24 + 10^6 ones in one bin: a float32 running sum stops at 2^24."""
    n = (1 << 24) + 1_000_000
    hist = histogram([torch.ones(n)])
    assert hist.total == float(n)


def test_selection_is_every_value_of_the_wanted_bins_and_above_a_bin_grouped_by_bin():
    values = _values(1_100_000 + 11)
    bins = _bins(values)
    nonzero = bins[bins > 0]
    wanted = {int(nonzero.median()), int(nonzero.max()) - 40}
    from_bin = int(nonzero.max()) - 5
    keep = (bins > 0) & (torch.isin(bins, torch.tensor(sorted(wanted))) | (bins >= from_bin))
    chosen = torch.nonzero(keep).flatten()
    expected = chosen[torch.sort(bins[chosen], stable=True).indices]  # by bin, then by index
    hist = histogram([values])
    compiled = select_bins(values, wanted, from_bin, hist)
    by_torch = BinChoice.of(hist, wanted, from_bin).select_with_torch(StatTerms(values))
    for selection in (select_bins(values, wanted, from_bin), compiled, by_torch):
        assert torch.equal(selection.index, expected)
        assert torch.equal(selection.values, values[expected].double())
        for b in (*wanted, from_bin, from_bin + 1, 1):
            chosen_b = b in wanted or b >= from_bin
            want = values[bins == b].double() if chosen_b else torch.empty(0, dtype=torch.float64)
            assert torch.equal(selection.of(b), want)
        index, tail = selection.at_or_above(from_bin)
        above = torch.nonzero(bins >= from_bin).flatten()
        assert torch.equal(index, above[torch.sort(bins[above], stable=True).indices])
        assert torch.equal(tail, values[index].double())
    found: dict[int, list[torch.Tensor]] = {}
    collect_bins(values, wanted, found)
    assert found.keys() == wanted
    for b in wanted:
        assert torch.equal(torch.cat(found[b]), values[bins == b].double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("wanted_bins", [3, cpu_kernels.HIT_BINS, cpu_kernels.HIT_BINS + 1])
def test_a_selection_tested_in_vectors_chooses_what_a_value_by_value_test_chooses(dtype, wanted_bins):
    """Up to HIT_BINS chosen bins below the top range are tested a vector of values at a time, more
    value by value; either way every value of a chosen bin and none other, also in the last, short
    block, for a stat that is a sum with a square (rounded as the selection's float32 bins are)."""
    n = 100_000 + 7
    fisher = _values(n, dtype, seed=3)
    moment = _values(n, dtype, seed=4) - 0.05
    terms = StatTerms(fisher, moment, squared=True)
    formed = terms.formed()
    bins = _bins(formed)
    present = torch.unique(bins[bins > 0])
    from_bin = int(present[-3])
    last_block = bins[n - n % 16 :]
    in_last_block = int(last_block[(last_block > 0) & (last_block < from_bin - 1)][0])
    others = present[(present != in_last_block) & (present < from_bin - 1)]  # apart from the top range
    spread = others[torch.linspace(0, len(others) - 1, wanted_bins - 1).long()]
    wanted = {in_last_block, *(int(b) for b in spread)}  # a value of the short last block is chosen
    assert len(wanted) == wanted_bins
    choice = BinChoice.of(histogram([terms]), wanted, from_bin)
    chosen = np.zeros((1, N_BINS), dtype=np.bool_)
    chosen[0] = choice.starts >= 0
    assert cpu_kernels._hit_bins(chosen)[2] == (wanted_bins <= cpu_kernels.HIT_BINS)
    keep = (bins > 0) & (torch.isin(bins, torch.tensor(sorted(wanted))) | (bins >= from_bin))
    expected = torch.nonzero(keep).flatten()
    expected = expected[torch.sort(bins[expected], stable=True).indices]
    selection = choice.select(terms)
    assert torch.equal(selection.index, expected)
    assert torch.equal(selection.values, formed[expected].double())
    assert torch.equal(selection.index, choice.select_with_torch(terms).index)


def test_a_selection_refuses_a_histogram_of_other_values():
    values = _values(10_007)
    other = histogram([_values(10_007, seed=9)])
    wanted = {int(_bins(values).max())}
    for select in (BinChoice.of(other, wanted).select, BinChoice.of(other, wanted).select_with_torch):
        with pytest.raises(ValueError, match="histogram is not the selected values' own"):
            select(StatTerms(values))


def test_no_values_chosen_reads_nothing():
    hist = histogram([_values(1000)])
    choice = BinChoice.of(hist, {N_BINS - 1})  # a bin no value is in
    assert choice.size == 0
    selection = choice.select(torch.empty(0))  # an empty stand-in: never read
    assert selection.index.numel() == selection.values.numel() == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_named_thresholds_are_exact_top_k_sums(seed):
    values = _values(300_001, seed=seed).clamp_min(0)
    chunks = [values[:100_000], values[100_000:]]
    fractions = [1e-5, 0.001, 0.01, 0.05, 0.1, 0.9]
    named = thresholds(histogram(chunks), lambda: iter(chunks), fractions)
    ordered = torch.sort(values.double(), descending=True).values
    for q, threshold in zip(fractions, named, strict=True):
        k = max(1, math.ceil(q * values.numel()))
        assert threshold.k == k
        assert threshold.value == float(ordered[k - 1])
        assert threshold.top_sum == pytest.approx(float(ordered[:k].sum()), rel=1e-12)


def test_plans_and_choices_for_many_histograms_at_once_give_each_ones_exact_top_k():
    """The summary plans every tensor in one call (rows of very different sizes side by side, an
    all-zero one and an empty one): each row's thresholds, finished from the values its own choice
    selects, are that row's exact top-k."""
    chunks = [
        _values(300_001, seed=3).clamp_min(0),
        _values(17, seed=4).clamp_min(0),
        torch.zeros(1000),
        torch.zeros(0),
        _values(50_000, seed=5).clamp_min(0) * 1e6,
        torch.full((64,), 0.25),
    ]
    fractions = [1e-5, 0.001, 0.05, 0.1, 0.9, 1.0]
    hists = [histogram([chunk]) for chunk in chunks]
    plans = plans_of(hists, fractions)
    choices = BinChoice.each(hists, [plan.bins for plan in plans])
    for chunk, plan, choice in zip(chunks, plans, choices, strict=True):
        selection = choice.select(chunk)
        named = plan.finish({b: [selection.of(b)] for b in plan.bins})
        ordered = torch.sort(chunk.double(), descending=True).values
        for q, threshold in zip(fractions, named, strict=True):
            k = max(1, math.ceil(q * chunk.numel()))
            assert threshold.k == k
            want = ordered[:k]
            assert threshold.value == (float(want[-1]) if want.numel() == k else 0.0)
            assert threshold.top_sum == pytest.approx(float(want.sum()), rel=1e-12, abs=0.0)


@pytest.mark.parametrize(
    "values",
    [
        np.random.default_rng(0).random(5000) + 1e-3,  # float64 with every bit in use
        (np.random.default_rng(1).random(5000, dtype=np.float32) * 0.06 + 1).astype(np.float64),  # one bin
        np.random.default_rng(2).choice([0.25, 0.5, 0.75], 5000),  # ties
        np.exp(np.random.default_rng(3).normal(size=5000) * 30),  # hundreds of octaves
        np.array([3.0]),
    ],
)
def test_the_need_largest_of_a_boundary_bin_are_the_sorted_ones(values):
    ordered = np.sort(values)[::-1]
    needs = {1, 2, values.size // 3, values.size - 1, values.size}
    for need in sorted(n for n in needs if 1 <= n <= values.size):
        value, total = cpu_kernels.largest_sum(values, need)
        assert value == ordered[need - 1]
        assert total == pytest.approx(float(ordered[:need].sum()), rel=1e-13)


def test_the_need_largest_refuses_what_it_cannot_order():
    for values, need, message in [
        (np.array([1.0, 0.0]), 1, "positive"),
        (np.array([1.0, -2.0]), 1, "positive"),
        (np.array([1.0, 2.0]), 3, "need 3 of 2"),
        (np.array([1.0, 2.0]), 0, "need 0 of 2"),
        (np.array([1.0, 2.0], np.float32), 1, "float64"),
    ]:
        with pytest.raises(ValueError, match=message):
            cpu_kernels.largest_sum(values, need)


@pytest.mark.parametrize("squared", [False, True])
def test_a_sum_of_arrays_bins_and_selects_as_its_formed_array(squared):
    """base + extra (or + extra^2) read term by term gives what the formed array gives."""
    base = _values(1_100_000 + 5, seed=3)
    extra = _values(base.numel(), seed=4).clamp_min(0).sqrt()
    terms = StatTerms(base, extra, squared)
    formed = terms.formed()
    hist, want = histogram([terms]), histogram([formed])
    assert torch.equal(hist.counts, want.counts)
    torch.testing.assert_close(hist.sums, want.sums, rtol=1e-12, atol=0.0)
    bins = _bins(formed)
    wanted = {int(bins.max()) - 3, int(bins[bins > 0].median())}
    got, expected = select_bins(terms, wanted, hist=hist), select_bins(formed, wanted)
    assert torch.equal(got.index, expected.index)
    assert torch.equal(got.values, expected.values)


def test_parts_in_threads_give_what_one_pass_gives(monkeypatch):
    """The compiled loops cut a large array into one part per torch thread: the same counts, sums and
    sum of squares as one part (a selection runs in one part)."""
    values = _values(100_003, seed=5)
    extra = _values(values.numel(), seed=6).clamp_min(0).sqrt()
    terms = StatTerms(values, extra, squared=True)

    def run():
        return histogram([terms]), cpu_kernels.square_sum(values)

    monkeypatch.setattr(cpu_threads, "PART_MIN_VALUES", 1 << 40)
    one_hist, one_square = run()
    threads = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "PART_MIN_VALUES", 1000)
    torch.set_num_threads(3)  # three parts, whatever this machine has
    try:
        hist, square = run()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(hist.counts, one_hist.counts)
    torch.testing.assert_close(hist.sums, one_hist.sums, rtol=1e-12, atol=0.0)
    assert square == pytest.approx(one_square, rel=1e-12)


def _three_stats(n: int) -> tuple[StatTerms, StatTerms, StatTerms, torch.Tensor]:
    """What the summary bins of one tensor off-policy: the Fisher, it plus a sum of squares, it plus the
    square of a first moment; and that first moment."""
    fisher = _values(n, seed=11)
    squares = _values(n, seed=12).clamp_min(0)
    moment = _values(n, seed=13) - 0.1  # signed
    return StatTerms(fisher), StatTerms(fisher, squares), StatTerms(fisher, moment, squared=True), moment


@pytest.mark.parametrize("stats", [1, 2, 3])
def test_one_pass_gives_what_a_pass_per_quantity_gives(stats):
    """Histograms of up to three stats, each array read once: the same counts and float64 sums, bit for
    bit, as each taken in a pass of its own (the same updates in the same order); their totals, a sum
    of squares and a share sum in one pass the same as each alone, and each total the float64 sum of
    the values its histogram bins; selections of up to three stats in one pass the same as one at a
    time."""
    *binned, moment = _three_stats(200_003)
    binned = binned[:stats]
    shares = binned[-1] if stats > 1 else StatTerms(binned[0].base, moment.abs())
    hists = histograms_in_one_pass(binned)
    totals, square_sum, share_sum = totals_in_one_pass(list(binned), moment, shares)
    for hist, total, terms in zip(hists, totals, binned, strict=True):
        alone = histogram([terms])
        assert torch.equal(hist.counts, alone.counts)
        assert torch.equal(hist.sums, alone.sums)
        assert hist.total_count == alone.total_count
        assert totals_in_one_pass([terms])[0] == [total]
        formed = terms.formed()
        binned_values = formed[_bins(formed) > 0].double()  # bin 0: zeros, denormals, negatives
        torch.testing.assert_close(total, float(binned_values.sum()), rtol=1e-12, atol=0.0)
        torch.testing.assert_close(total, hist.total, rtol=1e-12, atol=0.0)  # the same values
    assert square_sum == cpu_kernels.square_sum(moment)
    torch.testing.assert_close(square_sum, float(moment.double().square().sum()), rtol=1e-12, atol=0.0)
    assert share_sum / moment.numel() == cpu_kernels.extra_share_mean(shares)
    choices = []
    for hist in hists:
        bins = torch.nonzero(hist.counts).flatten()
        choices.append(BinChoice.of(hist, {int(bins[len(bins) // 2])}, int(bins[-3])))
    for together, terms, choice in zip(select_in_one_pass(binned, choices), binned, choices, strict=True):
        alone = choice.select_with_torch(terms)
        assert torch.equal(together.index, alone.index)
        assert torch.equal(together.values, alone.values)


def test_one_pass_refuses_more_stats_or_arrays_of_other_sizes():
    *binned, moment = _three_stats(1000)
    with pytest.raises(ValueError, match="at most 3"):
        histograms_in_one_pass([*binned, binned[0]])
    with pytest.raises(ValueError, match="at most 3"):
        totals_in_one_pass([*binned, binned[0]])
    with pytest.raises(ValueError, match="differ in size"):
        histograms_in_one_pass([binned[0], StatTerms(moment[:-1].abs())])
    with pytest.raises(ValueError, match="differ in size"):
        totals_in_one_pass(list(binned), moment[:-1])
    with pytest.raises(ValueError, match="no share"):
        totals_in_one_pass(list(binned), shares=binned[0])
    hists = histograms_in_one_pass(binned)
    choices = [BinChoice.of(hist, set(), 1) for hist in hists]
    with pytest.raises(ValueError, match="differ in size"):
        select_in_one_pass([binned[0], StatTerms(moment[:-1].abs())], choices[:2])


@pytest.mark.parametrize("squared", [False, True])
def test_the_extra_terms_mean_share_is_the_mean_of_the_formed_ratio(squared):
    """rho's mean in one compiled pass: mean of extra / (base + extra), 0/0 as 0, against torch's ratio."""
    base = _values(300_007, seed=7).clamp_min(0)
    extra = _values(base.numel(), seed=8).clamp_min(0)
    base[:50], extra[:50] = 0.0, 0.0  # 0/0: a share of 0
    terms = StatTerms(base, extra, squared)
    want = float(terms.extra_share().double().mean())
    assert cpu_kernels.extra_share_mean(terms) == pytest.approx(want, rel=1e-6)


def test_the_share_of_an_extra_term_survives_a_denormal_sum():
    """0 + (1e-20)^2 = 1e-40 (denormal): its square's share is 1, not the 0 that 1/1e-40 = inf gave."""
    terms = StatTerms(torch.zeros(3), torch.tensor([1e-20, 0.0, 2.0]), squared=True)
    assert terms.extra_share().tolist() == pytest.approx([1.0, 0.0, 1.0], rel=1e-4)  # denormal precision
    assert cpu_kernels.extra_share_mean(terms) == pytest.approx(2 / 3, rel=1e-4)


@pytest.mark.parametrize("shape", [(37, 23), (50,), (6, 4, 5)])
def test_pooled_views_are_float64_block_sums(shape):
    """Each cell of a pooled view is the float64 sum of its block (1-D: one row; 3-D: rows by dim 0)."""
    from workers.fisher.pooling import pooled_view

    values = _values(math.prod(shape), seed=9).reshape(shape)
    view = pooled_view(values, max_rows=8, max_cols=5)
    matrix = values.double().reshape(1, -1) if values.dim() == 1 else values.double().reshape(shape[0], -1)
    rows, cols = view["row_edges"], view["col_edges"]
    want = torch.tensor(
        dtype=torch.float64,
        data=[
            [float(matrix[r0:r1, c0:c1].sum()) for c0, c1 in zip(cols, cols[1:], strict=False)]
            for r0, r1 in zip(rows, rows[1:], strict=False)
        ],
    )
    assert view["shape"] == list(want.shape)
    torch.testing.assert_close(torch.from_numpy(view["values"]).double(), want, rtol=1e-6, atol=0.0)


def test_items_in_threads_come_back_in_order_and_run_their_loops_whole():
    """Items finish out of order (the largest start first); the results keep the items' order, and a
    loop called inside an item is not cut in parts (every thread is busy already)."""
    import time

    sizes = [3, 50, 1, 20, 7, 0]

    def work(size: int) -> tuple[int, int]:
        time.sleep(size / 5000)
        parts = cpu_kernels._in_parts(1 << 30, lambda lo, hi: hi - lo)
        return size, len(parts)

    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = cpu_kernels.each_in_threads(work, sizes, sizes)
        nested = cpu_kernels.each_in_threads(
            lambda size: cpu_kernels.each_in_threads(work, [size, size], [1, 1]), sizes, sizes
        )
    finally:
        torch.set_num_threads(threads)
    assert got == [(size, 1) for size in sizes]
    assert nested == [[(size, 1), (size, 1)] for size in sizes]
    assert not cpu_kernels._busy()  # this thread cuts loops in parts again


def test_an_error_in_one_item_reaches_the_caller_after_every_thread_stopped():
    import threading
    import time

    started: list[int] = []
    lock = threading.Lock()

    def work(item: int) -> int:
        with lock:
            started.append(item)
        if item == 2:
            raise ValueError("item 2 is bad")
        time.sleep(0.01)
        return item

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="item 2 is bad"):
            cpu_kernels.each_in_threads(work, list(range(40)), [40 - i for i in range(40)])
    finally:
        torch.set_num_threads(threads)
    seen = len(started)
    time.sleep(0.05)
    assert len(started) == seen < 40  # nothing runs on after the call, and the rest were not started


@pytest.mark.parametrize("extra", [None, "plus", "square"])
@pytest.mark.parametrize("shape", [(37, 23), (50,), (6, 4, 5), (300, 7)])
def test_pooled_views_from_terms_are_torchs_block_sums(shape, extra):
    """The compiled pass over a stat's terms gives the block sums torch's ops give on the formed stat
    (the GPU's path), in the same order of additions."""
    from workers.fisher.pooling import block_edges, block_sums_with_torch, grid_shape, pooled_view

    size = math.prod(shape)
    base = _values(size, seed=3).reshape(shape)
    more = None if extra is None else _values(size, seed=4).reshape(shape) - 0.5
    terms = StatTerms(base, more, squared=extra == "square")
    view = pooled_view(terms, max_rows=8, max_cols=5)
    rows, cols = grid_shape(shape)
    want = block_sums_with_torch(
        terms.formed().reshape(rows, cols), block_edges(rows, 8), block_edges(cols, 5)
    )
    assert torch.equal(torch.from_numpy(view["values"]), want.float())
    assert view["row_edges"] == list(block_edges(rows, 8)) and view["shape"] == list(want.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("extra", ["plus", "square"])
def test_pooled_views_of_a_share_are_torchs_block_sums_of_it(extra, dtype):
    """rho's view from its terms (``share``): each value's share rounded as ``StatTerms.extra_share``
    rounds it, 0 where it is 0/0, and summed as torch's ops sum the formed share, bit for bit."""
    from workers.fisher.pooling import block_edges, block_sums_with_torch, pooled_view

    rows, cols = 300, 7
    base = _values(rows * cols, seed=5).to(dtype)
    more = _values(rows * cols, seed=6).to(dtype)
    base[::5], more[::5] = 0.0, 0.0  # 0/0: a zero sum has zero terms
    more[1::7] = 0.0  # a share of 0
    if extra == "square":
        more = more - 0.3  # signed, as a first moment is
    terms = StatTerms(base.reshape(rows, cols), more.reshape(rows, cols), squared=extra == "square")
    row_edges, col_edges = block_edges(rows, 8), block_edges(cols, 5)
    got = cpu_kernels.block_sums(terms, cols, row_edges, col_edges, share=True)
    want = block_sums_with_torch(terms.extra_share().reshape(rows, cols), row_edges, col_edges)
    assert torch.isfinite(want).all()
    assert torch.equal(torch.from_numpy(got), want)
    view = pooled_view(terms, max_rows=8, max_cols=5, share=True)
    assert torch.equal(torch.from_numpy(view["values"]), want.float())
    with pytest.raises(ValueError, match="no share"):
        cpu_kernels.block_sums(StatTerms(base), rows * cols, [0, 1], [0, rows * cols], share=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_pooled_views_of_roots_are_block_sums_of_the_clamped_roots(dtype):
    """A Fisher's roots as the bound reads them (``root``): each value clamped at 0, its square root
    correctly rounded in the values' dtype (bfloat16 widened to float32 first, as every loop reads it),
    summed in one pass as torch's ops sum them: bit for bit those of numpy's roots. Negative rounding
    residues, zeros, -inf and inf; NaN stays NaN. torch's own float32 root may differ in the last bit
    (this CPU's vectorized kernel is not always correctly rounded): the GPU's path within rounding."""
    from workers.fisher.pooling import block_edges, block_sums_with_torch, pooled_view_and_total

    rows, cols = 300, 7
    values = (_values(rows * cols, seed=7) - 0.2).to(dtype)
    values[::11] = 0.0
    values[5], values[6] = -torch.inf, torch.inf
    matrix = values.reshape(rows, cols)
    row_edges, col_edges = block_edges(rows, 8), block_edges(cols, 5)
    widened = matrix if dtype != torch.bfloat16 else matrix.float()
    roots = torch.from_numpy(np.sqrt(widened.clamp_min(0).numpy()))
    want = block_sums_with_torch(roots, row_edges, col_edges)
    view, total = pooled_view_and_total(matrix, max_rows=8, max_cols=5, root=True)
    assert torch.equal(torch.from_numpy(view["values"]), want.float())
    assert total == float(want.sum())
    with cpu_threads.torch_ops_only():  # a GPU's path: torch's ops on the formed roots
        on_torch, _ = pooled_view_and_total(widened, max_rows=8, max_cols=5, root=True)
    torch.testing.assert_close(torch.from_numpy(on_torch["values"]), want.float())
    matrix[0, 0] = torch.nan
    (nan_view, _) = pooled_view_and_total(matrix, max_rows=8, max_cols=5, root=True)
    assert np.isnan(nan_view["values"][0, 0]) and not np.isnan(nan_view["values"][1:]).any()


def test_block_sums_refuse_edges_that_miss_the_values():
    terms = StatTerms(torch.ones(12))
    with pytest.raises(ValueError, match="do not cover"):
        cpu_kernels.block_sums(terms, 4, [0, 2], [0, 4])  # 2 rows of 4: 8 of the 12 values
    with pytest.raises(ValueError, match="do not cover"):
        cpu_kernels.block_sums(terms, 4, [0, 3], [0, 3])


def test_top_magnitudes_taken_in_parts_are_those_of_the_whole(monkeypatch):
    from workers.fisher import top_sets

    monkeypatch.setattr(top_sets, "MAGNITUDE_PART", 1000)  # several parts, the last one short
    values = torch.randn(10_500, generator=torch.Generator().manual_seed(4))
    with cpu_kernels.torch_ops_only():  # the parts are the torch path's (a GPU's)
        found = top_sets.top_candidates("w", values, signed=True, k=64)
    want = torch.topk(values.abs(), 64).indices.tolist()
    assert [index for _, _, index, _ in found] == want
    assert all(magnitude == abs(value) for magnitude, _, _, value in found)
