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
