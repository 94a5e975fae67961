"""Downloads a notebook can use: each choice of stats, tensors and dtype is its own file and job; float16
rounds within its documented error and never writes inf; HEAD answers wherever GET does, never starting
an export. Over the embedded store and over real Redis (with the worker's job functions in-process).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis
import torch
from fastapi.testclient import TestClient
from safetensors import safe_open
from safetensors.torch import load

from backend.main import create_app
from backend.queue import ANALYSIS_FUNCTION, EXPORT_FUNCTION, ThreadQueue
from backend.schemas import AnalysisJob
from backend.store import RedisStore
from backend.vocabulary import STATS
from tests.service_settings import folder_settings
from tests.test_redis_e2e import ensure_tiny, wait_done
from workers import jobs
from workers.serve import embedded_api

REDIS_URL = "redis://127.0.0.1:6379/13"
BODY = {"model": "tiny-random", "prefix": "She drank a cup of", "continuation": " coffee"}
ALL_STATS = ",".join(STATS)


_settings = folder_settings


def _client(app) -> TestClient:
    return TestClient(app, base_url="http://127.0.0.1")


def download(client: TestClient, analysis_id: str, **query: str) -> bytes:
    url = f"/api/v1/analyses/{analysis_id}/safetensors"
    deadline = time.monotonic() + 120
    while (answer := client.get(url, params=query)).status_code == 202:
        assert time.monotonic() < deadline, "the export was not written in 120 s"
        time.sleep(0.1)
    assert answer.status_code == 200, answer.text
    return answer.content


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(path, "pt") as file:
        return file.metadata()


def check_choices(client: TestClient, analysis_id: str, exports: Path) -> None:
    url = f"/api/v1/analyses/{analysis_id}/safetensors"
    assert client.head(url).status_code == 404  # nobody asked: HEAD says so and starts nothing
    assert not exports.exists() or not any(exports.glob("*.safetensors"))
    half = load(download(client, analysis_id))
    assert {key.partition("/")[0] for key in half if "/" in key} == {"fisher", "mean_shift"}
    assert all(value.dtype == torch.float16 for key, value in half.items() if "/" in key)
    head = client.head(url)
    assert head.status_code == 200 and head.content == b""
    default_file = next(exports.glob("*-fisher+mean_shift-float16.safetensors"))
    assert int(head.headers["content-length"]) == default_file.stat().st_size
    meta = _metadata(default_file)
    assert meta["stats"] == "fisher,mean_shift" and meta["dtype"] == "float16" and meta["tensors"] == "all"
    assert "2^-11" in meta["rounding"] and "flushed_to_zero" in meta

    full = load(download(client, analysis_id, stats=ALL_STATS, dtype="float32"))
    names = {key.partition("/")[2] for key in half if key.startswith("fisher/")}
    assert {key for key in full if "/" in key} == {f"{s}/{n}" for s in ALL_STATS.split(",") for n in names}
    for key, value in half.items():
        if "/" in key:  # float16 is the float32 value rounded: relative 2^-11, absolute 2^-24 near 0
            torch.testing.assert_close(value.float(), full[key], rtol=2**-11, atol=2**-24)
    assert _metadata(next(exports.glob("*-float32.safetensors")))["rounding"].startswith("float32")

    layer = load(download(client, analysis_id, stats="fisher", tensors="model.layers.0,*norm*"))
    kept = {n for n in names if n.startswith("model.layers.0.") or "norm" in n}
    assert kept and kept != names and {key.partition("/")[2] for key in layer if "/" in key} == kept
    assert len(list(exports.glob("*.safetensors"))) == 3  # one file per choice

    for query, words in (
        ({"stats": "fisher,nope"}, "stats must be"),
        ({"dtype": "float64"}, "dtype must be"),
        ({"tensors": "no.such.weight"}, "selects no parameter"),
    ):
        answer = client.get(url, params=query)
        assert answer.status_code == 422 and words in answer.json()["detail"], answer.text
        assert client.head(url, params=query).status_code == 422


@pytest.mark.slow
def test_download_choices_over_the_embedded_store(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    client = _client(embedded_api(settings))
    analysis_id = client.post("/api/v1/analyses", json=BODY).json()["id"]
    assert wait_done(client, analysis_id)["status"] == "done"
    check_choices(client, analysis_id, settings.exports_dir)
    check_head(client, analysis_id)


def check_head(client: TestClient, analysis_id: str) -> None:
    """HEAD of a GET route: the GET's status and headers, no body; unknown paths stay JSON 404/405."""
    got, head = client.get(f"/api/v1/analyses/{analysis_id}"), client.head(f"/api/v1/analyses/{analysis_id}")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == "application/json"
    assert head.headers["content-length"] == got.headers["content-length"]
    assert client.head("/api/v1/models").status_code == 200
    assert client.head("/api/v1/analyses/" + "0" * 64).status_code == 404
    assert client.head("/api/v1/analyses/not-an-id").status_code == 422
    missing = client.head("/api/v1/no/such/route")
    assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"
    post_only = client.head("/api/v1/analyses")
    assert post_only.status_code == 405 and post_only.headers["allow"] == "POST"
    wrong = client.put(f"/api/v1/analyses/{analysis_id}")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "DELETE, GET, HEAD"
    assert "text/html" not in wrong.headers["content-type"]


@pytest.mark.slow
def test_float16_overflow_is_refused_with_a_422_naming_float32(tmp_path: Path) -> None:
    """A reward of 1e12 makes the policy gradient far beyond float16's 65504: never a file of inf."""
    settings = _settings(tmp_path)
    client = _client(embedded_api(settings))
    body = {**BODY, "reward": {" coffee": 1e12}}
    analysis_id = client.post("/api/v1/analyses", json=body).json()["id"]
    assert wait_done(client, analysis_id)["status"] == "done"
    url = f"/api/v1/analyses/{analysis_id}/safetensors"
    deadline = time.monotonic() + 120
    while (answer := client.get(url, params={"stats": "policy_grad"})).status_code == 202:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert answer.status_code == 422 and "float32" in answer.json()["detail"], answer.text
    assert client.head(url, params={"stats": "policy_grad"}).status_code == 422  # remembered: no recompute
    assert not any(settings.exports_dir.glob("*policy_grad-float16*"))
    arrays = load(download(client, analysis_id, stats="policy_grad", dtype="float32"))
    peak = max(float(v.abs().max()) for k, v in arrays.items() if k.startswith("policy_grad/"))
    assert peak > 65504 and all(bool(torch.isfinite(v).all()) for v in arrays.values())


def test_a_file_over_the_exports_budget_is_refused_before_any_work(tmp_path: Path) -> None:
    settings = _settings(tmp_path, exports_budget_bytes=10_000)
    client = _client(embedded_api(settings))
    analysis_id = client.post("/api/v1/analyses", json=BODY).json()["id"]
    assert wait_done(client, analysis_id)["status"] == "done"
    answer = client.get(f"/api/v1/analyses/{analysis_id}/safetensors", params={"stats": ALL_STATS})
    assert answer.status_code == 422 and "exports budget" in answer.json()["detail"]


@pytest.mark.slow
def test_download_choices_over_real_redis(tmp_path: Path) -> None:
    ensure_tiny()
    connection = redis.Redis.from_url(REDIS_URL)
    prefix = f"fs-test-{uuid.uuid4().hex[:8]}"
    settings = _settings(tmp_path, redis_url=REDIS_URL)
    store = RedisStore(connection, settings.result_ttl_s, prefix=prefix)
    exports_run = []

    def run(function: str, payload: dict, _: str) -> None:
        job = AnalysisJob.model_validate(payload)
        if function == ANALYSIS_FUNCTION:
            jobs.execute_analysis(job, store, settings)
        elif function == EXPORT_FUNCTION:
            exports_run.append(jobs.execute_export(job, store, settings))

    try:
        client = _client(create_app(settings, store, ThreadQueue(run)))
        analysis_id = client.post("/api/v1/analyses", json=BODY).json()["id"]
        assert wait_done(client, analysis_id)["status"] == "done"
        check_choices(client, analysis_id, settings.exports_dir)
        assert [len(paths) for paths in exports_run] == [1, 1, 1]  # each choice its own job and file
    finally:
        for key in connection.scan_iter(f"{prefix}:*"):
            connection.delete(key)


def test_the_dashboard_download_link_carries_the_choice() -> None:
    from dash import html

    from frontend.api_client import ApiClient
    from frontend.callbacks.exports import _has_component
    from frontend.exports import arrays_choice, arrays_query

    assert arrays_query(None, None) == {"stats": "fisher,mean_shift", "dtype": "float16"}
    query = arrays_query(["raw", "fisher"], "float32")  # in the order the API and files list them
    assert query == {"stats": "fisher,raw", "dtype": "float32"}
    url = ApiClient("http://example.org").arrays_url("a" * 64, query)
    assert url.endswith("/safetensors?stats=fisher%2Craw&dtype=float32")
    assert _has_component(html.Div([html.Span("x"), arrays_choice()]), "arrays-dtype")
    assert not _has_component(html.Div([html.Span("x")]), "arrays-dtype")
