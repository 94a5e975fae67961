"""Redis stopped and restarted: the API answers 503 with a message meanwhile, never hangs, and recovers.

Uses a second redis-server on port 6390 started by the test (the main one on 6379 is never touched).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

from fastapi.testclient import TestClient

from backend.main import create_app
from backend.settings import Settings
from tests.requirements import require

PORT = 6390
BODY = {"model": "tiny-random", "prefix": "She drank a cup of"}


def start_redis(folder) -> subprocess.Popen:
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(PORT),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", PORT), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("second redis-server did not start")


def test_redis_down_is_503_and_recovers(tmp_path) -> None:
    require(shutil.which("redis-server") is not None, "redis-server")
    redis_process = start_redis(tmp_path)
    try:
        settings = Settings(redis_url=f"redis://127.0.0.1:{PORT}/0", queue_name="fisherscope-restart-test")
        client = TestClient(create_app(settings))
        assert client.get("/readyz").status_code == 200
        queued = client.post("/api/v1/analyses", json=BODY)
        assert queued.status_code == 202
        analysis_id = queued.json()["id"]

        redis_process.terminate()
        redis_process.wait(timeout=10)
        for method, path, body in (
            ("GET", f"/api/v1/analyses/{analysis_id}", None),
            ("POST", "/api/v1/analyses", BODY),
            ("GET", "/readyz", None),
        ):
            started = time.monotonic()
            response = client.request(method, path, json=body)
            assert response.status_code == 503, response.text
            assert "Redis" in response.json()["detail"] or "store unavailable" in response.json()["detail"]
            assert time.monotonic() - started < 10

        redis_process = start_redis(tmp_path)
        deadline = time.monotonic() + 15
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the API did not recover after Redis came back"
            time.sleep(0.2)
        again = client.post("/api/v1/analyses", json=BODY)  # the restarted Redis is empty: queued again
        assert again.status_code == 202 and again.json()["id"] == analysis_id
        assert client.get(f"/api/v1/analyses/{analysis_id}").json()["status"] == "queued"
    finally:
        redis_process.kill()
        redis_process.wait(timeout=10)
