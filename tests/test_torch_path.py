"""The GPU's code path, run on the CPU: with ``cpu_kernels.torch_ops_only`` every tensor goes through the
torch ops a CUDA device's tensors take (the ghost moments, the totals, histograms and selections of
the summary, the pooled views), and the analysis must be the one the compiled loops give."""

from __future__ import annotations

import pytest
import torch

from backend.vocabulary import STATS, Sampler
from tests.test_fixtures import assert_same_summary
from workers.engine import AnalysisRequest, run_analysis
from workers.fisher import cpu_kernels

BUDGET = 1 << 30
PREFIX = "She drank a cup of"
# the loops that read a tensor's values (the others, largest_sum and nested_levels, read CPU copies of
# a few values, on a GPU too)
COMPILED_LOOPS = (
    "tensor_pass",
    "tensor_totals",
    "select_grouped",
    "block_sums",
    "pair_moments",
    "histogram",
    "square_sum",
)


def _refused(loop: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"cpu_kernels.{loop} ran on the torch path")

    return refuse


def _atol(stat: str, scale: float) -> float:
    """float32 sums in another order: rounding relative to the stat's largest value. rho is a share in
    [0, 1] whose numerator is a first moment squared, a difference of near equals where that moment is
    small: its rounding is absolute, 1e-5 of a share (of a block of shares, in a pooled view)."""
    return 1e-5 * max(scale, 1.0) if stat == "rho" else 1e-6 * scale


def _analysis(loaded, request: AnalysisRequest):
    partials: list[dict] = []
    analysis = run_analysis(
        loaded, request, BUDGET, on_partial=lambda summary, kept: partials.append(summary)
    )
    analysis.summary.pop("timing")
    return analysis, partials


@pytest.mark.parametrize(
    "case",
    ["on-policy prefix", "tempered prefix with a reward", "response"],
)
def test_the_torch_path_gives_what_the_compiled_loops_give(tiny_random, case, monkeypatch):
    ids = tiny_random.tokenizer.encode(PREFIX).ids
    request = {
        "on-policy prefix": AnalysisRequest(input_ids=ids),
        "tempered prefix with a reward": AnalysisRequest(
            input_ids=ids, sampler=Sampler(temperature=0.7), reward={ids[0]: 1.0, ids[1]: -0.5}, rho=True
        ),
        "response": AnalysisRequest(input_ids=ids[:3], continuation_ids=ids[3:]),
    }[case]
    compiled, compiled_partials = _analysis(tiny_random, request)
    for loop in COMPILED_LOOPS:  # none of them may run on the GPU's path
        monkeypatch.setattr(cpu_kernels, loop, _refused(loop))
    with cpu_kernels.torch_ops_only():
        assert not cpu_kernels.compiled_for(torch.zeros(1))
        torch_path, torch_partials = _analysis(tiny_random, request)
        torch_pooled = torch_path.pooled()
    monkeypatch.undo()
    assert cpu_kernels.compiled_for(torch.zeros(1))

    sums, want = torch_path.sequence.sums, compiled.sequence.sums
    for stat in STATS:
        assert sums.identically_zero(stat) == want.identically_zero(stat)
        scale = max(float(value.abs().max()) for _, value in want.iter_stat(stat))
        for (name, got), (_, expected) in zip(sums.iter_stat(stat), want.iter_stat(stat), strict=True):
            torch.testing.assert_close(
                got,
                expected,
                rtol=1e-5,
                atol=_atol(stat, scale),
                msg=lambda m, s=stat, n=name: f"{s} {n}: {m}",
            )
    assert_same_summary(torch_path.summary, compiled.summary)
    # a prefix's first chunk; a response's first pass, then positions as they finish (as time allows)
    if not request.continuation_ids:
        assert len(torch_partials) == len(compiled_partials) == 1
    assert torch_partials and compiled_partials
    assert_same_summary(torch_partials[0], compiled_partials[0])

    pooled = compiled.pooled()
    assert set(torch_pooled) == set(pooled)
    for stat, views in pooled.items():
        # block sums of the stat formed in float32 (torch) against summed from its terms in float64
        scale = max(float(abs(view["values"]).max(initial=0)) for view in views.values())
        for name, view in views.items():
            mine = torch_pooled[stat][name]
            assert (mine["row_edges"], mine["col_edges"]) == (view["row_edges"], view["col_edges"])
            torch.testing.assert_close(
                torch.as_tensor(mine["values"]),
                torch.as_tensor(view["values"]),
                rtol=1e-5,
                atol=_atol(stat, scale),
                msg=lambda m, s=stat, n=name: f"pooled {s} {n}: {m}",
            )
