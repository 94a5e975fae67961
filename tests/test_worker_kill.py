"""A worker killed mid-job leaves the job failed with a reason (never "running" forever), and a
retried request recovers on a fresh worker. Real Redis (db 13), real worker processes.

Deterministic: the job's model is a registered Qwen3 whose own modeling code (trusted by the operator)
waits while a hold file exists, so the worker is provably inside the job, its lease beating, when it
is killed; no race with a fast job remains.
"""

from __future__ import annotations

import signal
import time

import pytest
import redis
import torch
from fastapi.testclient import TestClient

from backend import registry
from backend.main import create_app
from backend.settings import Settings
from backend.store import LEASE_TTL_S, WORKER_DIED
from tests.test_redis_e2e import start_worker, stop_worker, wait_done
from tests.test_registry import save_tokenizer
from tests.tiny_models import tiny_model
from workers.cli import main as cli

REDIS_URL = "redis://127.0.0.1:6379/13"
QUEUE = "fisherscope-kill-test"
HELD_MODEL = '''
import os
import time

from transformers import Qwen3ForCausalLM

HOLD = {hold!r}


class HeldQwen3(Qwen3ForCausalLM):
    """Builds only once the hold file is gone: a model that takes as long to load as the test wants."""

    def __init__(self, config):
        while os.path.exists(HOLD):
            time.sleep(0.05)
        super().__init__(config)
'''

pytestmark = pytest.mark.slow


def register_held_model(tmp_path, hold) -> None:
    import json

    folder = tmp_path / "held-src"
    tiny_model("qwen3", dtype=torch.float32, vocab_size=512, pad_token_id=0).save_pretrained(folder)
    save_tokenizer(folder)
    (folder / "modeling_held.py").write_text(HELD_MODEL.format(hold=str(hold)))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_held.HeldQwen3"}
    (folder / "config.json").write_text(json.dumps(config))
    assert cli(["models", "add", "held-qwen3", str(folder), "--trust-remote-code"]) == 0


def test_killed_worker_leaves_job_failed_then_retry_recovers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    hold = tmp_path / "hold"
    register_held_model(tmp_path, hold)
    hold.touch()  # from here on, loading the model waits
    connection = redis.Redis.from_url(REDIS_URL)
    connection.flushdb()
    client = TestClient(create_app(Settings(redis_url=REDIS_URL, queue_name=QUEUE, exports_dir=tmp_path)))
    body = {"model": "held-qwen3", "prefix": "She drank a cup of"}
    worker = start_worker(tmp_path, REDIS_URL, QUEUE)
    try:
        analysis_id = client.post("/api/v1/analyses", json=body).json()["id"]
        deadline = time.monotonic() + 120
        while (answer := client.get(f"/api/v1/analyses/{analysis_id}").json())["status"] == "queued":
            assert time.monotonic() < deadline, "the worker never picked the job up"
            time.sleep(0.05)
        assert (answer["status"], answer["stage"]) == ("running", "load")  # held inside the job
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        deadline = time.monotonic() + LEASE_TTL_S + 10
        while (answer := client.get(f"/api/v1/analyses/{analysis_id}").json())["status"] == "running":
            assert time.monotonic() < deadline, "a killed job stayed running"
            time.sleep(0.2)
        assert answer["status"] == "failed" and answer["error"] == WORKER_DIED

        hold.unlink()
        worker = start_worker(tmp_path, REDIS_URL, QUEUE)
        retried = client.post("/api/v1/analyses", json=body)
        assert retried.status_code == 202 and retried.json()["id"] == analysis_id
        assert wait_done(client, analysis_id)["status"] == "done"
    finally:
        hold.unlink(missing_ok=True)
        stop_worker(worker)
        connection.flushdb()


def test_a_study_part_whose_worker_died_is_queued_again_and_the_study_ends_as_with_one_worker(
    tmp_path, monkeypatch
) -> None:
    """Two workers each hold one prompt of a study; one is killed. Only its part is run again (by the
    other worker, once the API sees the lease lapse), and the study equals the embedded one."""
    from backend.studies import part_id
    from workers.serve import embedded_api

    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path / "cache"))
    hold = tmp_path / "hold"
    register_held_model(tmp_path, hold)
    hold.touch()
    connection = redis.Redis.from_url(REDIS_URL)
    connection.flushdb()
    studies = tmp_path / "studies"
    settings = Settings(redis_url=REDIS_URL, queue_name=QUEUE, exports_dir=tmp_path, studies_dir=studies)
    client = TestClient(create_app(settings))
    body = {
        "model": "held-qwen3",
        "prompts": [{"prompt": "She drank a cup of"}, {"prompt": "Two plus three is"}],
        "samples": 2,
        "max_tokens": 3,
        "seed": 7,
        "sampler": {"top_k": 6},
        "q": [0.01],
    }
    env = {"FISHERSCOPE_STUDIES_DIR": str(studies)}
    workers = [start_worker(tmp_path, REDIS_URL, QUEUE, env) for _ in range(2)]
    try:
        study_id = client.post("/api/v1/studies", json=body).json()["id"]
        deadline = time.monotonic() + 120
        while not all(part.stage == "load" for part in _study(client, study_id).parts):
            assert time.monotonic() < deadline, "the two workers never took one part each"
            time.sleep(0.05)
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait(timeout=10)
        deadline = time.monotonic() + LEASE_TTL_S + 20
        attempts = {}
        while not any(n == 2 for n in attempts.values()):
            assert time.monotonic() < deadline, "the dead worker's part was never queued again"
            study = _study(client, study_id)
            assert study.status != "failed", study.error  # a retried part never fails the study
            metas = [client.app.state.studies.store.get_meta(part_id(study_id, i)) for i in range(2)]
            attempts = {i: int(m.get("attempts") or 1) for i, m in enumerate(metas)}
            time.sleep(0.2)
        hold.unlink()
        deadline = time.monotonic() + 240
        while (study := _study(client, study_id)).status not in ("done", "failed"):
            assert time.monotonic() < deadline, f"study still {study.status}: {study.parts}"
            time.sleep(0.2)
        assert study.status == "done", study.error
        assert sorted(attempts.values()) == [1, 2]  # only the killed worker's part ran twice
    finally:
        hold.unlink(missing_ok=True)
        for worker in workers:
            stop_worker(worker)
        connection.flushdb()
    embedded = TestClient(embedded_api(Settings(results_dir=tmp_path / "r", studies_dir=tmp_path / "s")))
    alone = embedded.post("/api/v1/studies", json=body).json()["id"]
    assert alone == study_id
    deadline = time.monotonic() + 240
    while (one := embedded.get(f"/api/v1/studies/{alone}").json())["status"] not in ("done", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert study.summary is not None
    timing = "timing"  # seconds per stage: the only field that depends on who ran it
    assert {k: v for k, v in one["summary"].items() if k != timing} == {
        k: v for k, v in study.summary.model_dump(mode="json").items() if k != timing
    }  # the same responses, sums and masks, bit for bit


def _study(client: TestClient, study_id: str):
    from backend.study_schemas import StudyPublic

    answer = client.get(f"/api/v1/studies/{study_id}")
    assert answer.status_code == 200, answer.text
    return StudyPublic.model_validate(answer.json())
