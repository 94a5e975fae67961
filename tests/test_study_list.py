"""Studies people find again: an optional name kept in the study's record (never in its id), and
GET /api/v1/studies listing the latest, newest first, from a bounded index in Redis or the local folder.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from backend.local_store import LocalStore
from backend.main import create_app
from backend.queue import JobQueue
from backend.store import RedisStore, Store
from tests.service_settings import folder_settings
from tests.test_redis_e2e import ensure_tiny
from tests.test_study_api import wait_study
from workers.serve import embedded_api

REDIS_URL = "redis://127.0.0.1:6379/13"
BODY = {"model": "tiny-random", "prompts": [{"prompt": "Two plus three is"}], "samples": 1, "max_tokens": 1}


class NoWorker(JobQueue):
    """Jobs are queued and never run: the list reads studies as queued."""

    def enqueue(self, function: str, payload: dict, analysis_id: str, retries: int = 0) -> None:
        pass


_settings = folder_settings


def check_recent_index(store: Store) -> None:
    """Newest first, each id once, never longer than its limit."""
    for n in range(5):
        store.remember_recent("studies", f"{n:064x}", limit=3)
    store.remember_recent("studies", f"{2:064x}", limit=3)  # asked again: first again, not twice
    assert store.recent("studies") == [f"{n:064x}" for n in (2, 4, 3)]
    assert store.recent("studies", limit=1) == [f"{2:064x}"]
    assert store.recent("other") == []


def test_the_recent_index_in_the_local_folder_survives_a_restart(tmp_path: Path) -> None:
    check_recent_index(LocalStore(tmp_path))
    assert LocalStore(tmp_path).recent("studies") == [f"{n:064x}" for n in (2, 4, 3)]


def test_the_recent_index_in_redis() -> None:
    connection = redis.Redis.from_url(REDIS_URL)
    prefix = f"fs-test-{uuid.uuid4().hex[:8]}"
    try:
        check_recent_index(RedisStore(connection, 60, prefix=prefix))
    finally:
        for key in connection.scan_iter(f"{prefix}:*"):
            connection.delete(key)


def check_listing(client: TestClient) -> list[dict]:
    first = client.post("/api/v1/studies", json={**BODY, "name": "  arithmetic  "})
    assert first.status_code in (200, 202), first.text
    assert first.json()["name"] == "arithmetic"
    second = client.post("/api/v1/studies", json={**BODY, "prompts": [{"prompt": "The sky is"}]})
    listed = client.get("/api/v1/studies").json()
    assert [item["id"] for item in listed] == [second.json()["id"], first.json()["id"]]
    assert listed[1]["name"] == "arithmetic" and listed[0]["name"] is None
    assert listed[1]["model"] == "tiny-random" and listed[1]["prompts"] == 1
    assert listed[1]["created"] <= listed[0]["created"]
    # the same study under another name: the same id, its first name, and first in the list again
    again = client.post("/api/v1/studies", json={**BODY, "name": "renamed"})
    assert again.json()["id"] == first.json()["id"] and again.json()["name"] == "arithmetic"
    listed = client.get("/api/v1/studies").json()
    assert [item["id"] for item in listed] == [first.json()["id"], second.json()["id"]]
    assert [item["id"] for item in client.get("/api/v1/studies", params={"limit": 1}).json()] == [
        first.json()["id"]
    ]
    for bad, words in ((("name", "two\nlines"), "one line"), (("name", ""), "at least 1")):
        answer = client.post("/api/v1/studies", json={**BODY, bad[0]: bad[1]})
        assert answer.status_code == 422 and words in answer.text, answer.text
    assert client.get("/api/v1/studies", params={"limit": 0}).status_code == 422
    assert client.head("/api/v1/studies").status_code == 200
    return listed


def test_studies_listed_over_real_redis(tmp_path: Path) -> None:
    ensure_tiny()
    connection = redis.Redis.from_url(REDIS_URL)
    prefix = f"fs-test-{uuid.uuid4().hex[:8]}"
    settings = _settings(tmp_path, redis_url=REDIS_URL)
    try:
        app = create_app(settings, RedisStore(connection, 600, prefix=prefix), NoWorker())
        listed = check_listing(TestClient(app, base_url="http://127.0.0.1"))
        assert {item["status"] for item in listed} == {"queued"}
    finally:
        for key in connection.scan_iter(f"{prefix}:*"):
            connection.delete(key)


@pytest.mark.slow
def test_studies_listed_over_the_embedded_store(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    client = TestClient(embedded_api(settings), base_url="http://127.0.0.1")
    listed = check_listing(client)
    for item in listed:
        assert wait_study(client, item["id"])["status"] == "done"
    assert {item["status"] for item in client.get("/api/v1/studies").json()} == {"done"}
    assert client.get(f"/api/v1/studies/{listed[0]['id']}").json()["name"] == "arithmetic"
