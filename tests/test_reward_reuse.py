"""A reward change answered without the Fisher equals the whole analysis under that reward.

Two levels: the reward pass's policy gradient and the bound from kept Fisher roots against the engine's
own sums (tiny models of several families, float64); and the worker's path on the shipped tiny-random
model, where a second reward is answered from the first analysis's kept parts and the result (summary
and pooled views) is compared with a whole analysis of the same request made in another store.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from backend.local_store import LocalStore
from backend.schemas import AnalysisJob
from backend.store import RedisStore
from backend.vocabulary import Method, Sampler, SamplerKind
from tests.service_settings import folder_settings
from tests.tiny_models import BUDGET, tiny_model
from workers import jobs
from workers.fisher.pooling import pooled_view
from workers.fisher.response import analyze_sequence
from workers.fisher.reward_pass import FisherRoots, policy_gradient_pass

PREFIX = torch.tensor([3, 5, 8, 7, 11])
RESPONSE = torch.tensor([9, 4, 2])
REWARD_IDS = {4: 1.0, 9: -0.5, 2: 0.25}
REDIS_URL = "redis://127.0.0.1:6379/13"
CASES = [
    ("llama", True, "prefix", Sampler()),
    ("llama", True, "response", Sampler(temperature=0.7, top_k=5)),
    ("qwen2", False, "response", Sampler()),
    ("gemma2", True, "prefix", Sampler(temperature=0.7, top_k=5)),  # a softcapped head
    ("llama", False, "response", Sampler(kind=SamplerKind.data)),  # one-hot mu: no Fisher
]


def _vector(vocab: int) -> torch.Tensor:
    reward = torch.zeros(vocab, dtype=torch.float64)
    for token, value in REWARD_IDS.items():
        reward[token] = value
    return reward


@pytest.mark.parametrize(("family", "tied", "shape", "sampler"), CASES)
def test_reward_pass_and_kept_roots_equal_the_engines_sums(family, tied, shape, sampler):
    model = tiny_model(family, tied=tied)
    continuation = RESPONSE if shape == "response" else torch.tensor([], dtype=torch.long)
    reward = _vector(model.get_output_embeddings().weight.shape[0])
    roots = FisherRoots((4, 8))
    full = analyze_sequence(
        model,
        PREFIX,
        continuation,
        sampler,
        Method(),
        reward,
        memory_budget_bytes=BUDGET,
        observe=roots.observe,
    )
    computed = policy_gradient_pass(model, PREFIX, continuation, sampler, reward, memory_budget_bytes=BUDGET)
    stds = [p.reward_std for p in computed.positions]
    assert stds == pytest.approx([r.reward_std for r in full.positions], rel=1e-12)
    assert [p.reward_mean for p in computed.positions] == pytest.approx(
        [r.reward_mean for r in full.positions], rel=1e-12, abs=1e-15
    )
    assert roots.any_fisher == (sampler.kind != SamplerKind.data)
    for name in full.sums.names:
        expected = full.sums.stat("policy_grad", name)
        torch.testing.assert_close(computed.policy_grad[name], expected, rtol=1e-9, atol=1e-12)
        bound = full.sums.stat("bound", name)
        assert roots.bound_totals(stds, name) == pytest.approx(float(bound.sum()), rel=1e-9, abs=1e-12)
        view = pooled_view(bound, 4, 8)["values"]
        np.testing.assert_allclose(roots.bound_view(stds, name), view, rtol=1e-5, atol=1e-7)
    for at, record in zip(computed.positions, full.positions, strict=True):
        assert at.policy_grad_sq == pytest.approx(record.moments_totals["policy_grad_sq"], rel=1e-9)


# the worker's path ------------------------------------------------------------------------------


def _job(loaded, reward: dict[str, float], continuation: str = "", **kwargs) -> AnalysisJob:
    ids = loaded.tokenizer.encode("She drank a cup of").ids
    cont = loaded.tokenizer.encode(continuation, add_special_tokens=False).ids if continuation else []
    return AnalysisJob(
        model=loaded.id,
        weights_digest=loaded.info.digest,
        input_ids=ids,
        continuation_ids=cont,
        reward=reward,
        **kwargs,
    )


def _token(loaded, text: str) -> str:
    (token,) = loaded.tokenizer.encode(text, add_special_tokens=False).ids
    return str(token)


def _run(job: AnalysisJob, store: LocalStore, settings, pool) -> tuple[dict, dict]:
    jobs.execute_analysis(job, store, settings, pool)
    stored = store.read(job.key())
    assert stored.meta is not None and stored.meta["status"] == "done", stored.meta
    pooled = store.get_pooled(job.key())
    assert pooled is not None
    return json.loads(stored.summary_json), pooled


def _assert_same(reused, whole, path="summary") -> None:
    """Every number of ``whole`` in ``reused`` to rounding; every other value equal."""
    if isinstance(whole, dict):
        assert set(reused) == set(whole), (path, set(reused) ^ set(whole))
        for key in whole:
            if path == "summary" and key in ("timing", "cost"):
                continue
            _assert_same(reused[key], whole[key], f"{path}.{key}")
    elif isinstance(whole, list):
        assert len(reused) == len(whole), path
        for i, (a, b) in enumerate(zip(reused, whole, strict=True)):
            _assert_same(a, b, f"{path}[{i}]")
    elif isinstance(whole, float) and not isinstance(reused, bool):
        assert isinstance(reused, float | int), path
        if math.isfinite(whole):
            assert reused == pytest.approx(whole, rel=2e-5, abs=1e-9), path
        else:
            assert reused == whole, path
    elif isinstance(whole, np.ndarray):
        # float32 rounding of a sum is relative to its terms, not to the sum: an entry near zero amid
        # entries 1e3 times larger moves by ulps of those (batches of other sizes round differently on
        # some CPUs), so the absolute tolerance is a few float32 ulps of the array's largest entry
        scale = float(np.abs(whole).max()) if whole.size else 0.0
        np.testing.assert_allclose(reused, whole, rtol=2e-5, atol=max(1e-9, 4e-6 * scale), err_msg=path)
    else:
        assert reused == whole, path


class _Pool:
    """The model pool of a test: the shared tiny-random fixture, loaded once."""

    def __init__(self, loaded):
        self.loaded = loaded

    def get(self, model_id):
        assert model_id == self.loaded.id
        return self.loaded

    def forget(self, model_id):
        raise AssertionError("the tiny model does not change")


@pytest.mark.parametrize(
    ("continuation", "sampler", "first", "second"),
    [
        ("", Sampler(temperature=0.7, top_k=5), {" tea": 1.0}, {" tea": 1.0, " coffee": 0.5}),
        (" tea with her", Sampler(temperature=0.7, top_k=50), {" tea": 1.0}, {" coffee": -1.0}),
        ("", Sampler(), {" tea": 1.0}, {}),  # the reward taken away
        (" tea with her", Sampler(), {}, {" tea": 2.0}),  # a reward on an analysis that had none
    ],
)
def test_a_new_reward_is_answered_from_the_kept_fisher_as_a_whole_analysis_would(
    tiny_random, tmp_path: Path, continuation, sampler, first, second
):
    pool = _Pool(tiny_random)

    def reward(texts: dict[str, float]) -> dict[str, float]:
        return {_token(tiny_random, text): value for text, value in texts.items()}

    settings = folder_settings(tmp_path / "reused")
    store = LocalStore(settings.results_dir)
    _run(_job(tiny_random, reward(first), continuation, sampler=sampler), store, settings, pool)
    job = _job(tiny_random, reward(second), continuation, sampler=sampler)
    reused, reused_pooled = _run(job, store, settings, pool)
    assert store.read_counter(jobs.ENGINE_RUNS) == 1 and store.read_counter(jobs.REWARD_REUSES) == 1
    assert reused["timing"]["fisher_reused"] is True
    assert settings.levels_path(job.key()).is_file()  # compares read the reused analysis's top-q sets

    alone = folder_settings(tmp_path / "whole")
    whole, whole_pooled = _run(job, LocalStore(alone.results_dir), alone, pool)
    _assert_same(reused, whole)
    _assert_same(reused_pooled, whole_pooled, "pooled")
    assert np.array_equal(
        np.fromfile(settings.levels_path(job.key()), np.uint8),
        np.fromfile(alone.levels_path(job.key()), np.uint8),
    )


def test_without_the_kept_analysis_in_the_store_the_job_runs_whole(tiny_random, tmp_path: Path):
    pool = _Pool(tiny_random)
    settings = folder_settings(tmp_path)
    store = LocalStore(settings.results_dir)
    _run(_job(tiny_random, {_token(tiny_random, " tea"): 1.0}), store, settings, pool)
    other = LocalStore(tmp_path / "another-store")  # the same exports folder, not the analysis it names
    summary, _ = _run(_job(tiny_random, {_token(tiny_random, " tea"): 2.0}), other, settings, pool)
    assert other.read_counter(jobs.ENGINE_RUNS) == 1 and other.read_counter(jobs.REWARD_REUSES) == 0
    assert summary["timing"]["fisher_reused"] is False


def test_over_real_redis_the_new_reward_reads_the_kept_analysis_from_redis(tiny_random, tmp_path: Path):
    """The kept analysis's summary and pooled views come back from Redis (one read of its views)."""
    connection = redis.Redis.from_url(REDIS_URL)
    prefix = f"fs-test-{uuid.uuid4().hex[:8]}"
    store = RedisStore(connection, 600, prefix=prefix)
    pool = _Pool(tiny_random)
    settings = folder_settings(tmp_path / "redis", redis_url=REDIS_URL)
    sampler = Sampler(temperature=0.7, top_k=5)
    try:
        _run(_job(tiny_random, {_token(tiny_random, " tea"): 1.0}, sampler=sampler), store, settings, pool)
        job = _job(tiny_random, {_token(tiny_random, " coffee"): 1.0}, sampler=sampler)
        reused, reused_pooled = _run(job, store, settings, pool)
        assert store.read_counter(jobs.REWARD_REUSES) == 1 and store.read_counter(jobs.ENGINE_RUNS) == 1
    finally:
        for key in connection.scan_iter(f"{prefix}:*"):
            connection.delete(key)
    alone = folder_settings(tmp_path / "whole")
    whole, whole_pooled = _run(job, LocalStore(alone.results_dir), alone, pool)
    _assert_same(reused, whole)
    _assert_same(reused_pooled, whole_pooled, "pooled")


def test_a_kept_analysis_that_cannot_answer_lets_the_job_run_whole(tiny_random, tmp_path: Path):
    """The kept analysis's top-q sets evicted: the new reward is computed whole, not failed."""
    pool = _Pool(tiny_random)
    settings = folder_settings(tmp_path)
    store = LocalStore(settings.results_dir)
    first = _job(tiny_random, {_token(tiny_random, " tea"): 1.0})
    _run(first, store, settings, pool)
    settings.levels_path(first.key()).unlink()  # as the exports budget may remove it
    summary, _ = _run(_job(tiny_random, {_token(tiny_random, " tea"): 2.0}), store, settings, pool)
    assert store.read_counter(jobs.ENGINE_RUNS) == 2 and store.read_counter(jobs.REWARD_REUSES) == 0
    assert summary["timing"]["fisher_reused"] is False
