"""``POST /api/v1/updates``: two registered checkpoints of one model compared by a worker (embedded, and a
real Redis worker), with a study's Fisher masks laid over what changed; bad pairs refused with a 422."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from backend import registry
from backend.settings import Settings
from tests.test_redis_e2e import ensure_tiny
from tests.test_registry import qwen3_folder, run_cli
from tests.test_study_api import wait_study
from workers.serve import embedded_api
from workers.weight_updates import compare_checkpoints

STUDY = {
    "prompts": [{"prompt": "Two plus three is", "target": " five"}],
    "samples": 1,
    "max_tokens": 2,
    "seed": 1,
    "sampler": {"top_k": 8},
    "reward": {"kind": "regex", "pattern": "{target}"},
    "q": [0.01, 0.1],
}


def _tuned(source, target):
    """A copy of a saved model with a tenth of its weights moved (bf16, as a training run saves it)."""
    shutil.copytree(source, target)
    (path,) = target.glob("*.safetensors")
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(0)
    for value in tensors.values():
        flat = value.view(-1)
        moved = torch.rand(flat.shape, generator=generator) < 0.1
        flat[moved] += (0.05 * torch.randn(int(moved.sum()), generator=generator)).to(flat.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return target


@pytest.fixture
def models(tmp_path, monkeypatch, capsys):
    """Two registered checkpoints of one tiny Qwen3 in a cache of the test's own (and tiny-random)."""
    ensure_tiny()  # in the default cache: copied in beside the test's registered ids
    tiny = registry.model_dir("tiny-random")
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    shutil.copytree(tiny, registry.model_dir("tiny-random"))
    base = qwen3_folder(tmp_path, "base")
    assert run_cli(capsys, "models", "add", "q-base", str(base))[0] == 0
    assert run_cli(capsys, "models", "add", "q-tuned", str(_tuned(base, tmp_path / "tuned")))[0] == 0
    return tmp_path


def wait_updates(client: TestClient, updates_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        body = client.get(f"/api/v1/updates/{updates_id}").json()
        if body["status"] in ("done", "failed"):
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.1)


def test_two_checkpoints_through_the_embedded_service(models):
    settings = Settings(redis_url=None, results_dir=models / "results", studies_dir=models / "studies")
    client = TestClient(embedded_api(settings))
    first = client.post("/api/v1/updates", json={"before": "q-base", "after": "q-tuned"})
    assert first.status_code == 202, first.text
    done = wait_updates(client, first.json()["id"])
    assert done["status"] == "done", done["error"]
    expected = compare_checkpoints("q-base", "q-tuned")
    summary = done["summary"]
    assert summary["total"] == expected["total"] and summary["tensors"] == expected["tensors"]
    assert 0.05 < summary["total"]["changed_share"] < 0.15 and summary["masks"] is None
    again = client.post("/api/v1/updates", json={"before": "q-base", "after": "q-tuned"})
    assert again.status_code == 200 and again.json()["summary"] == summary  # the cache

    study = client.post("/api/v1/studies", json={"model": "q-base", **STUDY})
    study_id = wait_study(client, study.json()["id"])["id"]
    with_masks = client.post(
        "/api/v1/updates", json={"before": "q-base", "after": "q-tuned", "study": study_id}
    )
    done = wait_updates(client, with_masks.json()["id"])
    assert done["status"] == "done", done["error"]
    masks = done["summary"]["masks"]
    assert masks["file"] == f"study {study_id}" and masks["q"] == [0.01, 0.1]
    assert [row["q"] for row in done["summary"]["top_q"]] == [0.01, 0.1]  # the study's densities
    changed = next(row for row in masks["sets"] if row["set"] == "changed")
    # a tenth of the weights moved at random: about a tenth of each mask, as chance has it
    assert changed["in_mask"][1] == pytest.approx(0.1 * masks["mask_sizes"][1], rel=0.3)


def test_pairs_that_cannot_be_compared_are_refused(models):
    settings = Settings(redis_url=None, results_dir=models / "results", studies_dir=models / "studies")
    client = TestClient(embedded_api(settings))
    unknown = client.post("/api/v1/updates", json={"before": "q-base", "after": "nope"})
    assert unknown.status_code == 422 and "nope" in unknown.json()["detail"]
    other = client.post("/api/v1/updates", json={"before": "q-base", "after": "tiny-random"})
    assert other.status_code == 422 and "not one architecture" in other.json()["detail"]
    missing = client.post("/api/v1/updates", json={"before": "q-base", "after": "q-tuned", "study": "a" * 64})
    assert missing.status_code == 422 and "no study" in missing.json()["detail"]
    study = client.post("/api/v1/studies", json={"model": "tiny-random", **STUDY})
    study_id = wait_study(client, study.json()["id"])["id"]
    foreign = client.post("/api/v1/updates", json={"before": "q-base", "after": "q-tuned", "study": study_id})
    assert foreign.status_code == 422 and "give a study of one of the two models" in foreign.json()["detail"]
    bad_q = client.post("/api/v1/updates", json={"before": "q-base", "after": "q-tuned", "q": [0]})
    assert bad_q.status_code == 422
    assert client.get(f"/api/v1/updates/{'b' * 64}").status_code == 404


@pytest.mark.slow
def test_a_redis_worker_compares_two_checkpoints(models):
    import redis

    from backend.main import create_app
    from tests.test_redis_e2e import start_worker, stop_worker

    url, queue = "redis://127.0.0.1:6379/13", "fisherscope-updates-test"
    redis.Redis.from_url(url).flushdb()
    worker = start_worker(models / "exports", redis_url=url, queue=queue)
    try:
        settings = Settings(redis_url=url, queue_name=queue, exports_dir=models / "exports")
        client = TestClient(create_app(settings))
        posted = client.post("/api/v1/updates", json={"before": "q-base", "after": "q-tuned", "q": [0.05]})
        assert posted.status_code == 202, posted.text
        done = wait_updates(client, posted.json()["id"], timeout_s=180)
        assert done["status"] == "done", done["error"]
        assert done["summary"]["total"] == compare_checkpoints("q-base", "q-tuned", (0.05,))["total"]
    finally:
        stop_worker(worker)
        redis.Redis.from_url(url).flushdb()
