"""Embedded mode: one process runs the API and an in-process worker; finished analyses persist to a
folder, so the same link answers after a restart (a new app over the same folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.settings import Settings
from tests.test_redis_e2e import wait_done
from workers.serve import build_app, embedded_api

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_embedded_runs_in_process_and_survives_restart(tmp_path: Path) -> None:
    settings = Settings(redis_url=None, results_dir=tmp_path / "results", exports_dir=tmp_path / "exports")
    client = TestClient(embedded_api(settings))
    body = {"model": "tiny-random", "prefix": "She drank a cup of", "reward": {" tea": 1.0}}
    analysis_id = client.post("/api/v1/analyses", json=body).json()["id"]
    done = wait_done(client, analysis_id)
    assert done["status"] == "done", done["error"]
    assert client.post("/api/v1/analyses", json=body).status_code == 200

    restarted = TestClient(embedded_api(settings))  # a new process would see only the folder
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
    page = client.get("/")  # the dashboard is mounted under /
    assert page.status_code == 200 and "_dash-config" in page.text
