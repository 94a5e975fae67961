"""Cancel, DELETE /api/v1/analyses/{id}: a queued analysis fails at once and its worker skips it; a
running one stops at its next progress report (after every chunk of directions) and the worker takes
the next job; a finished one is refused (409); the same request POSTed again runs anew.

Embedded mode (the in-process worker), made deterministic by holding the model's load on an event: the
analysis is running (stage ``load``) when the DELETE comes. Over the real Redis with a real worker
process: ``tests/test_redis_e2e.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.settings import Settings
from backend.store import ENGINE_RUNS
from backend.vocabulary import CANCELLED
from tests.test_redis_e2e import wait_done
from workers import jobs
from workers.serve import embedded_api

pytestmark = pytest.mark.slow


@pytest.fixture
def held(tmp_path: Path, monkeypatch):
    """An embedded API whose worker waits at the model's load until the test sets ``release``."""
    release = threading.Event()
    real = jobs.model_pool()

    class HeldPool:
        def get(self, model_id: str):
            release.wait(60)
            return real.get(model_id)

        def forget(self, model_id: str) -> None:
            real.forget(model_id)

    monkeypatch.setattr(jobs, "model_pool", lambda: HeldPool())
    settings = Settings(redis_url=None, results_dir=tmp_path / "results", exports_dir=tmp_path / "exports")
    client = TestClient(embedded_api(settings))
    yield client, release
    release.set()


def wait_status(client: TestClient, analysis_id: str, status: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while (answer := client.get(f"/api/v1/analyses/{analysis_id}").json())["status"] != status:
        assert time.monotonic() < deadline, answer
        time.sleep(0.02)
    return answer


def test_cancel_a_running_and_a_queued_analysis(held) -> None:
    client, release = held
    store = client.app.state.service.store
    first = {"model": "tiny-random", "prefix": "She drank a cup of", "continuation": " tea with her"}
    second = {"model": "tiny-random", "prefix": "The cat sat on the"}
    running = client.post("/api/v1/analyses", json=first).json()["id"]
    wait_status(client, running, "running")
    queued = client.post("/api/v1/analyses", json=second).json()["id"]
    assert client.get(f"/api/v1/analyses/{queued}").json()["status"] == "queued"

    answer = client.delete(f"/api/v1/analyses/{queued}")
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "failed" and answer.json()["error"] == CANCELLED
    answer = client.delete(f"/api/v1/analyses/{running}")
    assert answer.status_code == 202, answer.text
    assert answer.json()["status"] == "running" and answer.json()["stage"] == "cancelling"
    assert client.delete(f"/api/v1/analyses/{queued}").status_code == 200  # failed: as it is

    release.set()
    stopped = wait_done(client, running)
    assert stopped["status"] == "failed" and stopped["error"] == CANCELLED
    assert stopped["partial"] is None and stopped["result"] is None
    # the worker skipped the cancelled queued job and takes the next: the same request, POSTed again
    again = client.post("/api/v1/analyses", json=second)
    assert again.status_code == 202 and again.json()["id"] == queued
    assert wait_done(client, queued)["status"] == "done"
    assert store.read_counter(ENGINE_RUNS) == 2  # the cancelled run started; the skipped one never did

    refused = client.delete(f"/api/v1/analyses/{queued}")
    assert refused.status_code == 409 and "nothing to cancel" in refused.json()["detail"]
    assert client.delete(f"/api/v1/analyses/{'0' * 64}").status_code == 404
    assert client.delete("/api/v1/analyses/not-an-id").status_code == 422


def test_cancel_a_response_while_it_is_sampled(held) -> None:
    """The id of a sampled response: cancelled before its response is drawn, the analysis of the drawn
    response stops at its first report, and the request's id follows it to the cancelled record."""
    client, release = held
    sample = {"seed": 3, "max_tokens": 4}
    body = {"model": "tiny-random", "prefix": "Once upon a", "continuation_sample": sample}
    request_id = client.post("/api/v1/analyses", json=body).json()["id"]
    wait_status(client, request_id, "running")
    assert client.delete(f"/api/v1/analyses/{request_id}").status_code == 202
    release.set()
    stopped = wait_done(client, request_id)
    assert stopped["status"] == "failed" and stopped["error"] == CANCELLED
    assert stopped["id"] != request_id  # the drawn response's analysis, which the request follows
    again = client.post("/api/v1/analyses", json=body)  # asked again: the drawn response runs
    assert again.status_code == 202 and again.json()["id"] == stopped["id"]
    assert wait_done(client, request_id)["status"] == "done"


def test_a_request_posted_again_while_it_is_cancelling_goes_on(held) -> None:
    client, release = held
    body = {"model": "tiny-random", "prefix": "A second thought about"}
    analysis_id = client.post("/api/v1/analyses", json=body).json()["id"]
    wait_status(client, analysis_id, "running")
    assert client.delete(f"/api/v1/analyses/{analysis_id}").json()["stage"] == "cancelling"
    again = client.post("/api/v1/analyses", json=body)
    assert again.status_code == 202 and again.json()["stage"] != "cancelling"
    release.set()
    assert wait_done(client, analysis_id)["status"] == "done"
