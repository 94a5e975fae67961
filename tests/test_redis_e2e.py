"""End to end over the real Redis (db 12) through a real `fisherscope worker` process on tiny-random:
results and pooled views, cache hits that do not run the engine again, concurrent identical requests
computed once, the safetensors download computed on demand, and a cancel that frees the worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from backend.analysis_records import AnalysisRecords
from backend.cost import estimate_cost
from backend.main import create_app
from backend.queue import RedisQueue, ThreadQueue
from backend.schemas import AnalysisJob
from backend.settings import Settings
from backend.store import RedisStore
from backend.vocabulary import CANCELLED

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = "redis://127.0.0.1:6379/12"
QUEUE = "fisherscope-e2e-test"

pytestmark = pytest.mark.slow


def ensure_tiny() -> None:
    from backend import registry as catalog

    if not catalog.is_available("tiny-random"):
        from workers.models.fetch import fetch_model

        fetch_model("tiny-random", progress=False)


def start_worker(
    exports: Path, redis_url: str = REDIS_URL, queue: str = QUEUE, extra_env: dict[str, str] | None = None
) -> subprocess.Popen:
    env = {
        **os.environ,
        **(extra_env or {}),
        "REDIS_URL": redis_url,
        "FISHERSCOPE_QUEUE_NAME": queue,
        "FISHERSCOPE_EXPORTS_DIR": str(exports),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "workers.worker"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def stop_worker(worker: subprocess.Popen) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def wait_done(client: TestClient, analysis_id: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        answer = client.get(f"/api/v1/analyses/{analysis_id}").json()
        if answer["status"] in ("done", "failed"):
            return answer
        assert time.monotonic() < deadline, f"still {answer['status']} at {answer['stage']}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    ensure_tiny()
    connection = redis.Redis.from_url(REDIS_URL)
    connection.flushdb()
    exports = tmp_path_factory.mktemp("exports")
    worker = start_worker(exports)
    settings = Settings(redis_url=REDIS_URL, queue_name=QUEUE, exports_dir=exports)
    client = TestClient(create_app(settings))
    store = RedisStore(connection, settings.result_ttl_s)
    yield client, store
    stop_worker(worker)
    connection.flushdb()


def test_analysis_end_to_end_and_cache_hit(service) -> None:
    client, store = service
    body = {"model": "tiny-random", "prefix": "She drank a cup of", "reward": {" tea": 1.0, " coffee": 1.0}}
    first = client.post("/api/v1/analyses", json=body)
    assert first.status_code == 202, first.text
    analysis_id = first.json()["id"]
    assert len(analysis_id) == 64
    done = wait_done(client, analysis_id)
    assert done["status"] == "done", done["error"]
    summary = done["result"]
    assert [t["id"] for t in summary["tokens"]["prefix"]] == done["request"]["input_ids"]
    assert len(summary["positions"]) == 1
    runs = store.read_counter("engine_runs")
    assert runs >= 1

    again = client.post("/api/v1/analyses", json=body)
    assert again.status_code == 200 and again.json()["id"] == analysis_id
    assert again.json()["result"] == summary
    assert store.read_counter("engine_runs") == runs  # served from the cache

    names = client.get(f"/api/v1/analyses/{analysis_id}/tensors").json()
    assert set(names) == {t["name"] for t in summary["tensors"]}
    view = client.get(f"/api/v1/analyses/{analysis_id}/tensors/{names[0]}", params={"rows": 2, "cols": 3})
    assert view.status_code == 200, view.text
    grid = view.json()["view"]
    assert len(grid["values"]) == grid["shape"][0] <= 2 and len(grid["row_edges"]) == grid["shape"][0] + 1
    tensor_total = next(t for t in summary["tensors"] if t["name"] == names[0])["totals"]["fisher"]
    assert sum(map(sum, grid["values"])) == pytest.approx(tensor_total, rel=1e-4, abs=1e-9)
    top = client.get(f"/api/v1/analyses/{analysis_id}/top", params={"stat": "fisher", "limit": 5}).json()
    assert top["coordinates"] == summary["top_coordinates"]["fisher"][:5]
    assert client.get(f"/api/v1/analyses/{analysis_id}/tensors/nope").status_code == 404
    assert client.get(f"/api/v1/analyses/{analysis_id}/top", params={"stat": "nope"}).status_code == 404


def test_concurrent_identical_requests_compute_once(service) -> None:
    client, store = service
    body = {"model": "tiny-random", "prefix": "The cat sat on the", "sampler": {"temperature": 0.7}}
    before = store.read_counter("engine_runs")
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda _: client.post("/api/v1/analyses", json=body), range(16)))
    assert {a.status_code for a in answers} <= {200, 202}
    ids = {a.json()["id"] for a in answers}
    assert len(ids) == 1
    assert wait_done(client, ids.pop())["status"] == "done"
    assert store.read_counter("engine_runs") == before + 1


def test_safetensors_download_on_demand(service) -> None:
    from safetensors.numpy import load

    client, _ = service
    body = {"model": "tiny-random", "prefix": "a cup of", "continuation": " tea"}
    analysis_id = client.post("/api/v1/analyses", json=body).json()["id"]
    assert wait_done(client, analysis_id)["status"] == "done"
    deadline = time.monotonic() + 120
    while (response := client.get(f"/api/v1/analyses/{analysis_id}/safetensors")).status_code == 202:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert response.status_code == 200
    arrays = load(response.content)
    assert any(key.startswith("fisher/") for key in arrays)
    assert "input_ids" in arrays


def test_the_worker_publishes_its_rate_and_estimates_use_it(service) -> None:
    """The worker process measured its matmul rate at tiny-random's width and published it under its RQ
    name; a new request's estimate turns flops into seconds at that rate, not the configured one."""
    client, store = service
    body = {"model": "tiny-random", "prefix": "The worker measured"}
    done = wait_done(client, client.post("/api/v1/analyses", json=body).json()["id"])
    assert done["status"] == "done", done["error"]
    rates = store.rates("tiny-random")
    live = RedisQueue(store.redis, QUEUE, 60).live_workers()
    assert len(rates) == 1 and set(rates) <= live, (rates, live)
    (rate,) = rates.values()
    settings = Settings(redis_url=REDIS_URL, queue_name=QUEUE)
    assert rate > 0 and rate != settings.flops_per_second
    queued = client.post("/api/v1/analyses", json={**body, "prefix": "Estimated at the worker's rate"})
    assert queued.status_code == 202, queued.text
    info, _ = AnalysisRecords(settings, store, ThreadQueue(lambda *args: None)).resolve_model("tiny-random")
    job = AnalysisJob.model_validate(queued.json()["request"])
    expected = estimate_cost(info, job, rate, settings.engine_memory_bytes, partials=True)
    assert queued.json()["cost"]["seconds"] == pytest.approx(expected.seconds)
    wait_done(client, queued.json()["id"])


def test_a_cancelled_analysis_stops_and_frees_the_worker(service) -> None:
    """A long response, cancelled while its directions run: the worker process stops it within a chunk
    (long before it would have finished) and computes the next request."""
    client, store = service
    words = " and then she went to the shop to buy some bread" * 2  # 44 tokens: about 10 s here
    sampler = {"temperature": 0.7}
    body = {"model": "tiny-random", "prefix": "She drank a cup of", "continuation": words, "sampler": sampler}
    body["rho"] = True
    analysis_id = client.post("/api/v1/analyses", json=body).json()["id"]
    deadline = time.monotonic() + 120
    while (answer := client.get(f"/api/v1/analyses/{analysis_id}").json())["stage"] != "directions":
        assert answer["status"] in ("queued", "running") and time.monotonic() < deadline, answer
        time.sleep(0.05)
    asked = time.monotonic()
    cancel = client.delete(f"/api/v1/analyses/{analysis_id}")
    assert cancel.status_code == 202 and cancel.json()["stage"] == "cancelling", cancel.text
    stopped = wait_done(client, analysis_id)
    assert stopped["status"] == "failed" and stopped["error"] == CANCELLED
    stopped_after = time.monotonic() - asked
    assert stopped["progress"] < 0.85  # still among the directions when it stopped
    assert not store.cancel_requested(analysis_id)  # the worker withdrew the request once it stopped
    nxt = client.post("/api/v1/analyses", json={"model": "tiny-random", "prefix": "After a cancel"})
    assert wait_done(client, nxt.json()["id"])["status"] == "done", stopped_after
