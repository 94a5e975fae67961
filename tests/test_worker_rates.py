"""The API's seconds come from the workers: each worker publishes its measured matmul rate for a model
(through the store), and the API's estimates use the slowest live worker's, the configured rate only
when none has published. Real Redis (db 9) for the store and RQ's registry of live workers."""

from __future__ import annotations

import pytest
import redis
from rq import Queue, SimpleWorker
from rq.serializers import JSONSerializer

from backend.analysis_records import AnalysisRecords
from backend.cost import estimate_cost, slowest_live_rate
from backend.local_store import LocalStore
from backend.normalize import normalize
from backend.queue import IN_PROCESS_WORKER, RedisQueue, ThreadQueue
from backend.schemas import AnalysisCreate
from backend.settings import Settings
from backend.store import RedisStore
from workers.jobs import published_rate

REDIS_URL = "redis://127.0.0.1:6379/9"
QUEUE = "fisherscope-rates-test"


def test_the_slowest_live_workers_rate_is_taken():
    rates = {"fast": 3e11, "slow": 1e11, "gone": 1e9}
    assert slowest_live_rate(rates, {"fast", "slow"}) == 1e11  # a job may land on the slow one
    assert slowest_live_rate(rates, {"fast"}) == 3e11
    assert slowest_live_rate(rates, set()) is None  # nobody alive has measured: the setting stands in
    assert slowest_live_rate({}, None) is None
    assert slowest_live_rate({IN_PROCESS_WORKER: 2e11}, None) == 2e11  # embedded: this process's own


@pytest.fixture
def connection():
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()


def test_rates_published_through_redis_count_only_for_live_workers(connection, tmp_path):
    settings = Settings(redis_url=REDIS_URL, queue_name=QUEUE, results_dir=tmp_path)
    store = RedisStore(connection, settings.result_ttl_s)
    queue = RedisQueue(connection, QUEUE, settings.job_timeout_s)
    records = AnalysisRecords(settings, store, queue)
    assert records.flops_per_second("tiny-random") == settings.flops_per_second  # none published

    rq_queue = Queue(QUEUE, connection=connection, serializer=JSONSerializer)
    alive = SimpleWorker([rq_queue], connection=connection, serializer=JSONSerializer, name="alive")
    alive.register_birth()
    try:
        store.publish_rate("alive", "tiny-random", 1.5e11)
        store.publish_rate("stopped-long-ago", "tiny-random", 2e9)  # not in RQ's registry: ignored
        store.publish_rate("alive", "smollm2-135m", 9e10)
        assert store.rates("tiny-random") == {"alive": 1.5e11, "stopped-long-ago": 2e9}
        assert queue.live_workers() == {"alive"}
        assert records.flops_per_second("tiny-random") == 1.5e11
        assert records.flops_per_second("smollm2-135m") == 9e10
        store.publish_rate("alive", "tiny-random", 1.2e11)  # measured again: the last one counts
        assert records.flops_per_second("tiny-random") == 1.2e11
    finally:
        alive.register_death()
    assert queue.live_workers() == set()
    assert records.flops_per_second("tiny-random") == settings.flops_per_second


def test_an_embedded_worker_publishes_its_rate_and_the_estimate_uses_it(tmp_path, tiny_random):
    """A job run in this process (no RQ) measures and publishes its rate; a POST's estimate of the same
    model then turns its flops into seconds at that rate."""
    store = LocalStore(tmp_path / "results")
    rate = published_rate(store, tiny_random)
    assert rate is not None and rate > 0
    assert store.rates(tiny_random.info.id) == {IN_PROCESS_WORKER: rate}
    settings = Settings(results_dir=tmp_path / "results")
    records = AnalysisRecords(settings, store, ThreadQueue(lambda *args: None))
    info, codec = records.resolve_model(tiny_random.info.id)
    job = normalize(
        AnalysisCreate(model=info.id, prefix="She drank a cup of"), codec, info, settings.limits()
    )
    analysis_id, stored = records.submit_job(info, job)
    assert stored.meta is not None
    queued = stored.meta["cost"]
    assert queued["seconds"] == pytest.approx(
        estimate_cost(info, job, rate, settings.engine_memory_bytes).seconds
    )
    assert rate != settings.flops_per_second
