"""The peak memory an analysis is estimated at, and the refusal of one over the limit: the count of
parameter-sized sums agrees with what the engine holds, the API answers 422 and the CLI exits 2, each
naming what would fit."""

from __future__ import annotations

import math

import pytest
import torch
from fastapi.testclient import TestClient

from backend import registry as catalog
from backend.main import create_app
from backend.memory_estimate import (
    between_chunks,
    estimate_peak,
    ghost_moments_between_chunks,
    kept_between_passes,
    parameter_sized_sums,
    position_arrays,
    what_would_fit,
)
from backend.schemas import AnalysisJob
from backend.settings import Settings, get_settings
from backend.vocabulary import Method, MethodName, Sampler
from backend.workspace import between_chunks_bytes
from tests.test_cli import assert_one_line_error, run_cli
from tests.tiny_models import BUDGET, tiny_llama
from workers.fisher import block_squares, directions, response
from workers.fisher.parameter_arrays import SumsStorage
from workers.fisher.response import analyze_sequence

OFF_POLICY = Sampler(temperature=0.7)
SMOLLM2 = type("Info", (), {"n_params": 134_515_008, "d_model": 576, "vocab_size": 49152})()


def _job(**fields) -> AnalysisJob:
    return AnalysisJob(model="m", weights_digest="d", input_ids=[3, 5, 8, 3, 11], **fields)


def _tiny_tied_model() -> tuple[torch.nn.Module, object]:
    """A tiny tied model, and what the estimate reads of it."""
    model = tiny_llama(tied=True, seed=2, vocab_size=41, dtype=torch.float32)
    info = type(
        "Info", (), {"n_params": sum(p.numel() for p in model.parameters()), "d_model": 16, "vocab_size": 41}
    )
    return model, info


def _off_policy(model: torch.nn.Module, job: AnalysisJob, **options) -> None:
    """The job's response analysed exactly under ``OFF_POLICY``."""
    ids, continuation = torch.tensor(job.input_ids), torch.tensor(job.continuation_ids)
    analyze_sequence(model, ids, continuation, OFF_POLICY, Method(), **options)


def test_a_prefix_holds_the_fisher_alone_and_rho_adds_the_fisher_under_p():
    assert parameter_sized_sums(_job()) == 1
    assert parameter_sized_sums(_job(sampler=OFF_POLICY)) == 1
    assert parameter_sized_sums(_job(sampler=OFF_POLICY, rho=True)) == 2
    # along a response every sum over positions is an array, and the position being added is one more
    assert parameter_sized_sums(_job(continuation_ids=[4, 7])) == 4
    # off the policy, the common component's squares are kept only for rho
    assert parameter_sized_sums(_job(continuation_ids=[4, 7], sampler=OFF_POLICY, reward={"4": 1.0})) == 8
    # the position being added holds its Fisher under p too
    assert parameter_sized_sums(_job(continuation_ids=[4, 7], sampler=OFF_POLICY, rho=True)) == 9


@pytest.mark.parametrize(
    ("fields", "positions"),
    [({}, 1), ({"sampler": OFF_POLICY, "rho": True}, 1), ({"continuation_ids": [4, 7, 9]}, 3),
     ({"continuation_ids": [4, 7], "sampler": OFF_POLICY, "reward": {"4": 1.0}}, 2),
     ({"continuation_ids": [4, 7], "sampler": OFF_POLICY, "rho": True}, 2)],
)  # fmt: skip
def test_the_sums_counted_are_those_the_engine_holds(fields, positions):
    """The arrays of the engine's running sums (first moments in their small form are not arrays)."""
    job = _job(**fields)
    model = tiny_llama(tied=False, seed=2, vocab_size=41, dtype=torch.float32)
    reward = torch.zeros(41, dtype=torch.float64)
    for token, value in job.reward.items():
        reward[int(token)] = value
    sequence = analyze_sequence(
        model,
        torch.tensor(job.input_ids),
        torch.tensor(job.continuation_ids, dtype=torch.long),
        job.sampler,
        Method(),
        reward if job.reward else None,
        memory_budget_bytes=BUDGET,
        fisher_under_p=job.rho,
    )
    assert len(sequence.positions) == positions
    sums = sequence.sums
    size = sum(math.prod(shape) for shape in sums.shapes.values())
    held = sum(
        entry.numel()
        for table in sums.sums.values()
        for entry in table.entries.values()
        if isinstance(entry, torch.Tensor)
    )
    # held once the last position is folded in: all but the position being added
    expected = parameter_sized_sums(job) - (position_arrays(job) if positions > 1 else 0)
    assert held == expected * size


def test_what_a_responses_first_pass_keeps_is_within_its_estimate(monkeypatch):
    """The plans and refining round's ghost moments a response's first pass keeps for its exact pass
    stay within what the estimate counts and within the workspace's share between chunks; nothing for a
    prefix, nor where no first pass runs (a truncated plan)."""
    job = _job(continuation_ids=[4, 7, 9, 2], sampler=OFF_POLICY, rho=True)
    model, info = _tiny_tied_model()
    counted: list[int] = []
    held: list[int] = []
    keeps, release = response._FirstPass._keeps, response._FirstPass.release

    def counting(self, t: int, nbytes: int) -> bool:
        kept = keeps(self, t, nbytes)
        counted.append(self.kept_bytes)
        return kept

    def released(self) -> None:  # after the round: every position's moments are kept
        plans = sum(planned.nbytes() for planned in self.plans if planned is not None)
        held.append(plans + sum(c.nbytes() for kept in self.carried.values() for c in kept.values()))
        release(self)

    monkeypatch.setattr(response._FirstPass, "_keeps", counting)
    monkeypatch.setattr(response._FirstPass, "release", released)
    _off_policy(model, job, memory_budget_bytes=BUDGET, on_partial=lambda snapshot, kept_share: None)
    plans = 8 * (3 * 16**2 + 2 * 41) * len(job.continuation_ids)
    # what is held, what the first pass counts it as, and the estimate: the round's moments too
    assert plans < held[0] <= max(counted) <= kept_between_passes(info, job)
    assert max(counted) <= between_chunks_bytes(BUDGET)
    assert kept_between_passes(SMOLLM2, _job()) == 0
    truncated = Method(name=MethodName.truncated, fraction=0.5)
    assert kept_between_passes(SMOLLM2, _job(continuation_ids=[4, 7], method=truncated)) == 0
    # a long response would keep more than the share: the share bounds it, the ghost moments within it
    long = _job(continuation_ids=list(range(64)))
    assert kept_between_passes(SMOLLM2, long) > 1 << 30
    assert between_chunks(SMOLLM2, long, 2 << 30) == between_chunks_bytes(2 << 30) == 1 << 30


@pytest.mark.parametrize("budget", [2 << 30, 48_000])
def test_the_ghost_moments_kept_between_chunks_are_within_their_estimate(monkeypatch, budget):
    """A position's exact pass keeps each ghost block's moments between its direction chunks: as many as
    the estimate counts at the longest context, within the workspace's share between chunks (of 24 kB:
    some blocks' M only)."""
    job = _job(continuation_ids=[4, 7, 9, 2, 6, 1, 3], sampler=OFF_POLICY)
    model, info = _tiny_tied_model()
    held: list[int] = []
    add_matrix = block_squares.SquareAccumulator.add_matrix

    def counting(self, *args, **kwargs) -> None:
        add_matrix(self, *args, **kwargs)
        held.append(sum(m.nbytes for m in self.ghost.values()))

    monkeypatch.setattr(block_squares.SquareAccumulator, "add_matrix", counting)
    monkeypatch.setattr(directions, "_chunk_size", lambda capture, budget: 4)  # several chunks a position
    _off_policy(model, job, memory_budget_bytes=budget, fisher_under_p=False)  # one square group
    estimated = ghost_moments_between_chunks(info, job)
    share = between_chunks_bytes(budget)
    assert 0 < max(held) <= min(estimated, share)
    if share < estimated * 2:
        assert max(held) > share / 2  # the share, not the blocks, bounds it


def _kept_and_ghost_moments(monkeypatch, budget: int) -> list[tuple[int, int, int, int]]:
    """A 7-token response after a 10-token prefix, on a tied model of 4000 tokens (plans of 36 kB a
    position), its round keeping no moments (the plans alone are kept): at every fold of the exact pass,
    (position, bytes the first pass keeps in all, of them for the positions after it, ghost moments
    held)."""
    model = tiny_llama(tied=True, seed=2, vocab_size=4000, dtype=torch.float32)
    ids, continuation = torch.arange(100, 110), torch.arange(200, 207)
    held_after = response._FirstPass.held_after
    now: list[int] = [0, 0, 0]
    found: list[tuple[int, int, int, int]] = []
    add_matrix = block_squares.SquareAccumulator.add_matrix

    def holding(self, t: int) -> int:
        now[:] = [t, self.kept_bytes, held_after(self, t)]
        return now[2]

    def counting(self, *args, **kwargs) -> None:
        add_matrix(self, *args, **kwargs)
        found.append((now[0], now[1], now[2], sum(m.nbytes for m in self.ghost.values())))

    with monkeypatch.context() as patch:
        patch.setattr(response._FirstPass, "held_after", holding)
        patch.setattr(response._FirstPass, "_keeps_carried", lambda self, t, capture: False)
        patch.setattr(block_squares.SquareAccumulator, "add_matrix", counting)
        patch.setattr(directions, "_chunk_size", lambda capture, budget: 4)  # several chunks a position
        analyze_sequence(
            model,
            ids,
            continuation,
            OFF_POLICY,
            Method(),
            memory_budget_bytes=budget,
            fisher_under_p=False,
            on_partial=lambda snapshot, kept: None,
        )
    return found


def test_a_responses_kept_plans_and_ghost_moments_share_one_half_of_the_workspace(monkeypatch):
    """While the exact pass runs a position, the first pass still keeps the plans of the positions after
    it: the position's ghost moments have what is left of the share between chunks, so the two together
    stay within it, where the plans alone and the ghost moments alone fit it but not both."""
    roomy = _kept_and_ghost_moments(monkeypatch, 1 << 30)
    kept = roomy[0][1]
    ghost: dict[int, int] = {}
    after: dict[int, int] = {}
    for t, _, later, moments in roomy:
        ghost[t], after[t] = max(ghost.get(t, 0), moments), later
    both = max(after[t] + ghost[t] for t in ghost)
    assert both > max(kept, *ghost.values())  # the two compete: each alone is less than both
    share = (max(kept, *ghost.values()) + both) // 2
    tight = _kept_and_ghost_moments(monkeypatch, 2 * share)
    assert [found[:3] for found in tight] == [found[:3] for found in roomy]  # the same plans kept
    assert max(later + moments for _, _, later, moments in tight) <= share < both


@pytest.mark.parametrize("tables_in_memory", [0, 2])
def test_a_responses_sums_beyond_their_memory_are_mapped_as_the_engine_maps_them(tmp_path, tables_in_memory):
    """Sums beyond ``sums_memory_bytes`` are memory-mapped files, not counted in the peak (the kernel
    can write them out); the estimate maps as many as the engine's storage does."""
    job = _job(continuation_ids=[4, 7, 9], sampler=OFF_POLICY, reward={"4": 1.0})
    model = tiny_llama(tied=False, seed=2, vocab_size=41, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    info = type("Info", (), {"n_params": n_params, "d_model": 16, "vocab_size": 41})()
    table = 4 * n_params
    storage = SumsStorage(tmp_path, memory_bytes=tables_in_memory * table + table // 2)
    reward = torch.zeros(41, dtype=torch.float64)
    reward[4] = 1.0
    analyze_sequence(
        model, torch.tensor(job.input_ids), torch.tensor(job.continuation_ids), job.sampler, Method(), reward,
        memory_budget_bytes=BUDGET, fisher_under_p=job.rho, sums_storage=storage,
    )  # fmt: skip
    in_memory = estimate_peak(info, job, 1 << 30)
    peak = estimate_peak(info, job, 1 << 30, storage.memory_bytes)
    assert (peak.sums - table, peak.mapped) == (storage.in_memory, storage.mapped)
    assert peak.mapped == (parameter_sized_sums(job) - position_arrays(job) - tables_in_memory) * table
    assert in_memory.total - peak.total == peak.mapped
    assert "more of sums in mapped files" in peak.line() and "mapped" not in in_memory.line()
    # a prefix keeps no sums over positions: nothing to map
    assert estimate_peak(info, _job(sampler=OFF_POLICY), 1 << 30, 0).mapped == 0


def test_what_would_fit_names_the_changes_that_fit():
    job = _job(continuation_ids=[4, 7], sampler=OFF_POLICY, rho=True)
    peak = estimate_peak(SMOLLM2, job, 1 << 30)
    prefix = estimate_peak(SMOLLM2, _job(sampler=OFF_POLICY, rho=True), 1 << 30)
    assert prefix.total < peak.total and prefix.weights == peak.weights
    fits = what_would_fit(SMOLLM2, job, 1 << 30, prefix.total)
    assert fits == ["the prefix alone (no response)"]


@pytest.fixture
def small_server(tmp_path) -> TestClient:
    if not catalog.is_available("tiny-random"):
        from workers.models.fetch import fetch_model

        fetch_model("tiny-random", progress=False)
    settings = Settings(
        redis_url=None,
        results_dir=tmp_path / "results",
        exports_dir=tmp_path / "exports",
        allowed_models=["tiny-random"],
        memory_limit_bytes=100 << 20,  # below the runtime: every analysis is over it
    )
    return TestClient(create_app(settings))


def test_the_api_refuses_an_analysis_over_the_memory_limit(small_server):
    body = {"model": "tiny-random", "prefix": "She drank a cup of", "continuation": " tea", "rho": True,
            "sampler": {"kind": "model", "temperature": 0.7}}  # fmt: skip
    response = small_server.post("/api/v1/analyses", json=body)
    assert response.status_code == 422, response.text
    message = response.json()["detail"]
    assert (
        "at peak" in message and "over the memory limit of 0.1 GB (FISHERSCOPE_MEMORY_LIMIT_BYTES)" in message
    )


def test_the_cli_refuses_an_analysis_over_the_memory_limit(capsys, tiny_random, monkeypatch):
    monkeypatch.setenv("FISHERSCOPE_MEMORY_LIMIT_BYTES", str(100 << 20))
    get_settings.cache_clear()
    try:
        code, out, err = run_cli(
            capsys, "analyze", "--model", "tiny-random", "--prefix", "She drank a cup of"
        )
    finally:
        get_settings.cache_clear()
    assert_one_line_error(code, err, "memory limit of 0.1 GB", "at peak")
    assert "GB at peak" in out
