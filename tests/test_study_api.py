"""Studies through the service: embedded end to end, two real Redis workers against one, bad input.

The part-and-reduce path must give the same study whatever the number of workers: parts are one
prompt each and the reducer adds them in prompt order, so the sums are equal bit for bit.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import redis
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load

from backend.main import create_app
from backend.settings import Settings
from tests.test_redis_e2e import ensure_tiny, start_worker, stop_worker
from workers.serve import embedded_api

REDIS_URL = "redis://127.0.0.1:6379/13"
QUEUE = "fisherscope-study-test"
BODY = {
    "model": "tiny-random",
    "prompts": [
        {"prompt": "Two plus three is", "target": " five"},
        {"prompt": "She drank a cup of", "target": " tea"},
        {"prompt": "The capital of France is", "target": " Paris"},
    ],
    "samples": 2,
    "max_tokens": 3,
    "seed": 5,
    "sampler": {"top_k": 8},
    "reward": {"kind": "regex", "pattern": "{target}"},
    "q": [0.01, 0.05],
}


def wait_study(client: TestClient, study_id: str, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        answer = client.get(f"/api/v1/studies/{study_id}")
        assert answer.status_code == 200, answer.text
        body = answer.json()
        if body["status"] in ("done", "failed"):
            return body
        assert time.monotonic() < deadline, f"study still {body['status']}: {body['parts']}"
        time.sleep(0.1)


def _masks(client: TestClient, study_id: str) -> dict[str, torch.Tensor]:
    answer = client.get(f"/api/v1/studies/{study_id}/masks")
    assert answer.status_code == 200, answer.text
    return load(answer.content)


def test_a_study_through_the_embedded_service(tmp_path: Path) -> None:
    ensure_tiny()
    settings = Settings(results_dir=tmp_path / "results", studies_dir=tmp_path / "studies")
    client = TestClient(embedded_api(settings))
    first = client.post("/api/v1/studies", json=BODY)
    assert first.status_code == 202, first.text
    study = wait_study(client, first.json()["id"])
    assert study["status"] == "done", study["error"]
    assert [p["status"] for p in study["parts"]] == ["done"] * 3
    summary = study["summary"]
    responses = summary["responses"]
    assert len(responses) == 6 and {r["prompt_index"] for r in responses} == {0, 1, 2}
    assert all(1 <= len(r["continuation_ids"]) <= 3 for r in responses)
    masks = _masks(client, study["id"])
    n_params = summary["counts"]["n_params"]
    for q in (0.01, 0.05):  # exactly ceil(q P) trainable coordinates per density
        ones = sum(int(t.sum()) for key, t in masks.items() if key.startswith(f"q{q:g}/"))
        assert ones == math.ceil(q * n_params)
    assert not any(settings.study_dir(study["id"]).glob("part-*"))  # reduced parts are removed
    again = client.post("/api/v1/studies", json=BODY)  # the cache: nothing new runs
    assert again.status_code == 200 and again.json()["summary"] == summary
    _check_mask_views(client, study["id"], masks)
    _check_study_comparison(client, study["id"], masks)


def _check_mask_views(client: TestClient, study_id: str, masks: dict[str, torch.Tensor]) -> None:
    """The heatmap of each parameter's mask counts exactly the file's ones, block by block."""
    for key, mask in masks.items():
        name = key.partition("/")[2]
        q = float(key.partition("/")[0][1:])
        answer = client.get(f"/api/v1/studies/{study_id}/masks/{name}", params={"q": q, "rows": 4, "cols": 5})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["shape"] == list(mask.shape) and body["size"] == mask.numel()
        assert body["count"] == int(mask.sum())
        view = body["view"]
        matrix = mask.reshape(1, -1) if mask.dim() == 1 else mask.reshape(-1, mask.shape[-1])
        rows, cols = view["row_edges"], view["col_edges"]
        assert (
            len(rows) <= 5 and len(cols) <= 6 and rows[-1] == matrix.shape[0] and cols[-1] == matrix.shape[1]
        )
        expected = [
            [int(matrix[rows[i] : rows[i + 1], cols[j] : cols[j + 1]].sum()) for j in range(len(cols) - 1)]
            for i in range(len(rows) - 1)
        ]
        assert view["values"] == expected
    name = next(iter(masks)).partition("/")[2]
    wrong_q = client.get(f"/api/v1/studies/{study_id}/masks/{name}", params={"q": 0.02})
    assert wrong_q.status_code == 422 and "0.01, 0.05" in wrong_q.text
    unknown = client.get(f"/api/v1/studies/{study_id}/masks/no.such.weight")
    assert unknown.status_code == 404 and "no parameter 'no.such.weight'" in unknown.text


def _check_study_comparison(client: TestClient, study_id: str, masks: dict[str, torch.Tensor]) -> None:
    """Two samplers' studies of the same prompts: the API's overlap equals a direct set computation."""
    other_body = {**BODY, "sampler": {"top_k": 3}, "q": [0.01, 0.1]}
    other = wait_study(client, client.post("/api/v1/studies", json=other_body).json()["id"])
    assert other["status"] == "done", other["error"]
    other_masks = _masks(client, other["id"])
    answer = client.get("/api/v1/studies/compare", params={"a": study_id, "b": other["id"]})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["q"] == [0.01] and body["model"] == "tiny-random"  # the one density both cut
    names = sorted(key for key in masks if key.startswith("q0.01/"))
    a = torch.cat([masks[n].reshape(-1) for n in names]).bool()
    b = torch.cat([other_masks[n].reshape(-1) for n in names]).bool()
    both = int((a & b).sum())
    assert body["overlap"] == [pytest.approx(both / int(a.sum()))]
    assert body["jaccard"] == [pytest.approx(both / int((a | b).sum()))]
    assert body["chance_overlap"] == [0.01] and body["chance_jaccard"] == [pytest.approx(0.01 / 1.99)]
    missing = client.get("/api/v1/studies/compare", params={"a": study_id, "b": "0" * 64})
    assert missing.status_code == 404 and "POST /api/v1/studies first" in missing.text
    bad = client.get("/api/v1/studies/compare", params={"a": study_id, "b": "xyz"})
    assert bad.status_code == 422


@pytest.mark.slow
def test_a_study_is_not_reduced_while_a_part_reads_as_running(tmp_path: Path) -> None:
    """Between a part writing its file and marking itself done, another part that finishes must not
    reduce the study: the study would read done with that part still running. The last part to mark
    itself done reduces it."""
    from backend.studies import part_id
    from backend.study_schemas import StudyCreate
    from workers.study_jobs import execute_study_part, part_path

    ensure_tiny()
    settings = Settings(results_dir=tmp_path / "results", studies_dir=tmp_path / "studies")
    service = TestClient(embedded_api(settings)).app.state.studies
    job, _ = service.normalize(StudyCreate.model_validate({**BODY, "prompts": BODY["prompts"][:2]}))
    store, study_id = service.store, job.key()
    execute_study_part(job, 0, store, settings)
    store.update_meta(part_id(study_id, 0), status="running")  # its file written, its status not yet
    execute_study_part(job, 1, store, settings)
    assert (store.get_meta(study_id) or {}).get("status") != "done"
    assert all(part_path(settings, study_id, i).is_file() for i in range(2))  # nothing reduced
    execute_study_part(job, 0, store, settings)  # its file is there: it marks itself done, then reduces
    assert store.get_meta(study_id)["status"] == "done"
    assert not any(part_path(settings, study_id, i).is_file() for i in range(2))


def test_two_redis_workers_give_the_one_worker_study(tmp_path: Path) -> None:
    ensure_tiny()
    connection = redis.Redis.from_url(REDIS_URL)
    results = {}
    for n_workers in (1, 2):
        connection.flushdb()
        studies = tmp_path / f"studies-{n_workers}"
        settings = Settings(redis_url=REDIS_URL, queue_name=QUEUE, studies_dir=studies)
        client = TestClient(create_app(settings))
        workers = [
            start_worker(tmp_path / "exports", REDIS_URL, QUEUE, {"FISHERSCOPE_STUDIES_DIR": str(studies)})
            for _ in range(n_workers)
        ]
        try:
            posted = client.post("/api/v1/studies", json=BODY)
            assert posted.status_code == 202, posted.text
            study = wait_study(client, posted.json()["id"])
        finally:
            for worker in workers:
                stop_worker(worker)
        assert study["status"] == "done", study["error"]
        results[n_workers] = (study, _masks(client, study["id"]))
    (one, one_masks), (two, two_masks) = results[1], results[2]
    assert one["id"] == two["id"]
    assert one["summary"]["responses"] == two["summary"]["responses"]
    assert one["summary"]["totals"] == two["summary"]["totals"]  # same order of addition: equal
    assert one_masks.keys() == two_masks.keys()
    assert all(torch.equal(one_masks[key], two_masks[key]) for key in one_masks)


def test_bad_studies_are_refused_with_what_to_fix(tmp_path: Path) -> None:
    ensure_tiny()
    client = TestClient(embedded_api(Settings(results_dir=tmp_path / "results", studies_dir=tmp_path / "s")))

    def refused(change: dict, status: int, words: str) -> None:
        answer = client.post("/api/v1/studies", json={**BODY, **change})
        assert answer.status_code == status, answer.text
        assert words in answer.json()["detail"], answer.json()["detail"]

    refused({"prompts": []}, 422, "prompts")
    refused({"prompts": [{"prompt": "   "}], "reward": None}, 422, "prompt 1 is empty")
    refused({"prompts": [{"prompt": "a " * 400}], "reward": None}, 422, "over the limit")
    refused({"prompts": [{"prompt": "Hi", "answer": "x"}]}, 422, "answer")
    refused({"prompts": [{"prompt": "Hi"}]}, 422, "prompt 1 has no target")
    refused({"reward": {"kind": "regex", "pattern": "("}}, 422, "not a regex")
    refused({"sampler": {"kind": "data", "data_token": " tea"}}, 422, "samples its responses")
    refused({"method": "mc:1"}, 422, "method")
    refused({"q": [0.0]}, 422, "(0, 1)")
    refused({"model": "../etc"}, 422, "model")
    missing = client.get("/api/v1/studies/" + "0" * 64)
    assert missing.status_code == 404 and "POST /api/v1/studies" in missing.json()["detail"]
    assert client.get("/api/v1/studies/nothex").status_code == 422
    assert client.get("/api/v1/studies/" + "0" * 64 + "/masks").status_code == 404
