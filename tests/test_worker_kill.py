"""A worker killed mid-job leaves the job failed with a reason (never "running" forever), and a
retried request recovers on a fresh worker. Real Redis (db 13), real worker processes.
"""

from __future__ import annotations

import signal
import time

import pytest
import redis
from fastapi.testclient import TestClient

from backend.main import create_app
from backend.settings import Settings
from backend.store import LEASE_TTL_S, WORKER_DIED
from tests.test_redis_e2e import QUEUE, ROOT, ensure_tiny, start_worker, stop_worker, wait_done

REDIS_URL = "redis://127.0.0.1:6379/13"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (ROOT / "workers" / "engine.py").exists(), reason="workers/engine.py not written yet"
    ),
]


def test_killed_worker_leaves_job_failed_then_retry_recovers(tmp_path) -> None:
    ensure_tiny()
    connection = redis.Redis.from_url(REDIS_URL)
    connection.flushdb()
    client = TestClient(create_app(Settings(redis_url=REDIS_URL, queue_name=QUEUE, exports_dir=tmp_path)))
    body = {"model": "tiny-random", "prefix": "She drank a cup of", "continuation": " tea and a cup of"}
    worker = start_worker(tmp_path, REDIS_URL)
    try:
        analysis_id = client.post("/api/v1/analyses", json=body).json()["id"]
        deadline = time.monotonic() + 120
        while client.get(f"/api/v1/analyses/{analysis_id}").json()["status"] == "queued":
            assert time.monotonic() < deadline, "the worker never picked the job up"
            time.sleep(0.01)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        answer = client.get(f"/api/v1/analyses/{analysis_id}").json()
        if answer["status"] == "done":
            pytest.skip("the job finished before the kill landed; nothing to observe")
        deadline = time.monotonic() + LEASE_TTL_S + 10
        while (answer := client.get(f"/api/v1/analyses/{analysis_id}").json())["status"] == "running":
            assert time.monotonic() < deadline, "a killed job stayed running"
            time.sleep(0.2)
        assert answer["status"] == "failed" and answer["error"] == WORKER_DIED

        worker = start_worker(tmp_path, REDIS_URL)
        retried = client.post("/api/v1/analyses", json=body)
        assert retried.status_code == 202 and retried.json()["id"] == analysis_id
        assert wait_done(client, analysis_id)["status"] == "done"
    finally:
        stop_worker(worker)
        connection.flushdb()
