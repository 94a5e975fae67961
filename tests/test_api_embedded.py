"""Embedded mode: one process runs the API and an in-process worker; finished analyses persist to a
folder, so the same link answers after a restart (a new app over the same folder).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.embedded import build_app
from backend.main import create_app
from backend.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def wait_done(client: TestClient, analysis_id: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while (answer := client.get(f"/api/v1/analyses/{analysis_id}").json())["status"] not in (
        "done",
        "failed",
    ):
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    return answer


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "workers" / "engine.py").exists(), reason="workers/engine.py not written yet")
def test_embedded_runs_in_process_and_survives_restart(tmp_path: Path) -> None:
    settings = Settings(redis_url=None, results_dir=tmp_path / "results", exports_dir=tmp_path / "exports")
    client = TestClient(create_app(settings))
    body = {"model": "tiny-random", "prefix": "She drank a cup of", "reward": {" tea": 1.0}}
    analysis_id = client.post("/api/v1/analyses", json=body).json()["id"]
    done = wait_done(client, analysis_id)
    assert done["status"] == "done", done["error"]
    assert client.post("/api/v1/analyses", json=body).status_code == 200

    restarted = TestClient(create_app(settings))  # a new process would see only the folder
    again = restarted.get(f"/api/v1/analyses/{analysis_id}")
    assert again.status_code == 200 and again.json()["result"] == done["result"]
    name = done["result"]["tensors"][0]["name"]
    assert restarted.get(f"/api/v1/analyses/{analysis_id}/tensors/{name}").status_code == 200
    assert restarted.post("/api/v1/analyses", json=body).status_code == 200


def test_embedded_app_serves_api_with_or_without_dashboard(tmp_path: Path) -> None:
    settings = Settings(redis_url="redis://ignored:1/0", results_dir=tmp_path / "results")
    client = TestClient(build_app(settings, "127.0.0.1", 8000))  # build_app forces embedded mode
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/readyz").json()["status"] == "ready"
    assert client.get("/api/v1/models").status_code == 200
    if (ROOT / "frontend" / "app.py").exists():  # the dashboard is mounted under /
        page = client.get("/")
        assert page.status_code == 200 and "_dash-config" in page.text
