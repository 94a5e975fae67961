"""Embedded mode: one process runs the API and an in-process worker; finished analyses persist to a
folder, so the same link answers after a restart (a new app over the same folder).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
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


def test_serve_loads_its_model_then_queues_the_landing_view(tmp_path: Path, monkeypatch) -> None:
    """Deterministic: the pool's load waits on an event the test sets."""
    import threading

    from workers import jobs

    release, asked = threading.Event(), []

    class HeldPool:
        def get(self, model_id: str):
            asked.append(model_id)
            release.wait(30)

    monkeypatch.setattr(jobs, "model_pool", lambda: HeldPool())
    client = TestClient(embedded_api(Settings(results_dir=tmp_path / "results"), preload="smollm2-135m"))
    answer = client.get("/readyz")
    assert answer.status_code == 503 and "loading the model smollm2-135m" in answer.json()["detail"]
    assert client.get("/healthz").json()["status"] == "ok"  # alive all the while
    release.set()
    deadline = time.monotonic() + 10
    while client.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # then the landing view's analysis and its rho stage are queued: each job asks the pool for the model
    while len(asked) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert asked == ["smollm2-135m"] * 3


@pytest.mark.slow
def test_a_sampled_continuation_is_drawn_once_and_a_seed_reproduces_it(tmp_path: Path) -> None:
    """The worker draws y ~ mu with the seed, then analyses that concrete response; the request's id
    follows it, so the same seed finds the cached analysis and nothing is computed again."""
    client = TestClient(embedded_api(Settings(results_dir=tmp_path / "results", exports_dir=tmp_path)))
    body = {
        "model": "tiny-random",
        "prefix": "She drank a cup of",
        "sampler": {"temperature": 0.9, "top_k": 20},
        "continuation_sample": {"seed": 7, "max_tokens": 6},
    }
    first = client.post("/api/v1/analyses", json=body)
    assert first.status_code == 202, first.text
    request_id = first.json()["id"]
    done = wait_done(client, request_id)
    assert done["status"] == "done", done["error"]
    response = done["request"]["continuation_ids"]
    assert 1 <= len(response) <= 6 and done["request"]["continuation_sample"] is None
    assert done["id"] != request_id and len(done["result"]["positions"]) == len(response)
    assert [t["id"] for t in done["result"]["tokens"]["continuation"]] == response
    runs = client.get("/api/v1/stats").json()["engine_runs"]
    again = client.post("/api/v1/analyses", json=body)
    assert again.status_code == 200 and again.json()["id"] == done["id"]
    assert client.get(f"/api/v1/analyses/{request_id}").json()["id"] == done["id"]
    assert client.get("/api/v1/stats").json()["engine_runs"] == runs
    other = wait_done(
        client,
        client.post(
            "/api/v1/analyses", json={**body, "continuation_sample": {"seed": 8, "max_tokens": 6}}
        ).json()["id"],
    )
    assert other["status"] == "done" and other["id"] != done["id"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"continuation": " tea"}, "not both"),
        ({"sampler": {"kind": "data"}}, "cannot draw a response"),
        ({"continuation_sample": {"seed": 1, "max_tokens": 65}}, "over the limit of 64"),
        ({"continuation_sample": {"seed": -1}}, "greater than or equal to 0"),
    ],
)
def test_bad_sample_requests_say_what_to_fix(tmp_path: Path, change: dict, says: str) -> None:
    client = TestClient(embedded_api(Settings(results_dir=tmp_path / "results")))
    body = {"model": "tiny-random", "prefix": "She drank", "continuation_sample": {"seed": 1}, **change}
    answer = client.post("/api/v1/analyses", json=body)
    assert answer.status_code == 422 and says in answer.json()["detail"], answer.text


def _top_sets(fisher: np.ndarray, fractions: list[float]) -> list[set[int]]:
    """The top-q coordinates by value, ties by index: a direct set computation."""
    order = np.lexsort((np.arange(fisher.size), -np.maximum(fisher, 0)))
    return [set(order[: math.ceil(q * fisher.size)].tolist()) for q in fractions]


@pytest.mark.slow
def test_overview_positions_and_compare_of_two_analyses(tmp_path: Path) -> None:
    from safetensors.numpy import load

    settings = Settings(results_dir=tmp_path / "results", exports_dir=tmp_path / "exports")
    client = TestClient(embedded_api(settings))
    base = {"model": "tiny-random", "prefix": "She drank a cup of", "continuation": " coffee and then"}
    ids = []
    for sampler in ({}, {"temperature": 0.6, "top_k": 12}):
        answer = wait_done(
            client, client.post("/api/v1/analyses", json={**base, "sampler": sampler}).json()["id"]
        )
        assert answer["status"] == "done", answer["error"]
        ids.append(answer["id"])
    full = client.get(f"/api/v1/analyses/{ids[0]}").json()["result"]
    overview = client.get(f"/api/v1/analyses/{ids[0]}/overview").json()
    assert overview["positions"] == full["positions"][:1] and overview["tensors"] == full["tensors"]
    assert [p["index"] for p in overview["position_index"]] == list(range(len(full["positions"])))
    assert client.get(f"/api/v1/analyses/{ids[0]}/positions/2").json() == full["positions"][2]
    assert client.get(f"/api/v1/analyses/{ids[0]}/positions/99").status_code == 404

    compared = client.get("/api/v1/compare", params={"a": ids[0], "b": ids[1]}).json()
    fisher = []
    for analysis_id in ids:
        url = f"/api/v1/analyses/{analysis_id}/safetensors?stats=fisher&dtype=float32"  # float16 ties
        while (download := client.get(url)).status_code == 202:
            time.sleep(0.2)
        arrays = load(download.content)
        names = [t["name"] for t in full["tensors"]]
        fisher.append(np.concatenate([arrays[f"fisher/{name}"].reshape(-1) for name in names]))
    sets_a, sets_b = (_top_sets(f, compared["sets"]["q"]) for f in fisher)
    for i, (a, b) in enumerate(zip(sets_a, sets_b, strict=True)):
        assert compared["sets"]["overlap"][i] == len(a & b) / len(a)
        assert compared["sets"]["jaccard"][i] == len(a & b) / len(a | b)
    assert compared["sets"]["chance_overlap"] == compared["sets"]["q"]
    totals = {t["name"]: t["totals"]["fisher"] for t in full["tensors"]}
    assert all(pair["a"]["fisher"] == totals[pair["name"]] for pair in compared["tensors"])
    assert client.get("/api/v1/compare", params={"a": ids[0], "b": "0" * 64}).status_code == 404


def test_the_overview_names_every_vocabulary_row_among_the_top_coordinates(tmp_path: Path) -> None:
    from backend.registry import tokenizer_path
    from backend.tokens import TokenCodec

    settings = Settings(redis_url=None, results_dir=tmp_path / "results", exports_dir=tmp_path / "exports")
    client = TestClient(embedded_api(settings))
    analysis_id = client.post("/api/v1/analyses", json={"model": "tiny-random", "prefix": "Tea or"}).json()[
        "id"
    ]
    assert wait_done(client, analysis_id)["status"] == "done"
    overview = client.get(f"/api/v1/analyses/{analysis_id}/overview").json()
    vocab = overview["model"]["vocab_size"]
    shapes = {t["name"]: t["shape"] for t in overview["tensors"]}
    rows = {
        c["index"][0]
        for coordinates in overview["top_coordinates"].values()
        for c in coordinates
        if shapes[c["tensor"]][0] == vocab
    }
    codec = TokenCodec.from_file(tokenizer_path("tiny-random"))
    assert rows and overview["vocabulary"] == {str(row): codec.token_text(row) for row in sorted(rows)}
    # a view of a vocabulary-sized tensor names each block of rows by its first row's token; others don't
    head = next(t for t in overview["tensors"] if t["shape"][0] == vocab and len(t["shape"]) == 2)
    view = client.get(f"/api/v1/analyses/{analysis_id}/tensors/{head['name']}?rows=8").json()
    starts = view["view"]["row_edges"][:-1]
    assert view["row_tokens"] == [codec.token_text(row) for row in starts] and len(starts) == 8
    other = next(t for t in overview["tensors"] if t["shape"][0] != vocab)
    assert client.get(f"/api/v1/analyses/{analysis_id}/tensors/{other['name']}").json()["row_tokens"] is None
