"""``fisherscope worker`` under ``torchrun --nproc-per-node 2`` (gloo on the CPU) is one worker: rank 0
takes the job from the real Redis (db 10), both processes run a share of its directions, and the stored
result is one process's; a failure in either process fails the run on rank 0 and leaves neither waiting.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch.distributed as dist
import torch.multiprocessing as mp
from fastapi.testclient import TestClient

from backend.main import create_app
from backend.settings import Settings
from workers.commands import processes
from workers.fisher.shards import Shard, current_shard

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = "redis://127.0.0.1:6379/10"
QUEUE = "fisherscope-processes-test"
BODY = {
    "model": "tiny-random",
    "prefix": "She drank a cup of",
    "continuation": " tea with",
    "sampler": {"temperature": 0.7, "top_k": 9},
    "reward": {" tea": 1.0},
    "rho": True,
}


def _wait_done(client: TestClient, analysis_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while (answer := client.get(f"/api/v1/analyses/{analysis_id}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, f"still {answer['status']} at {answer['stage']}"
        time.sleep(0.1)
    return answer


@pytest.mark.slow
def test_a_worker_under_torchrun_stores_one_processs_numbers(tmp_path, tiny_random):
    connection = redis.Redis.from_url(REDIS_URL)
    connection.flushdb()
    settings = Settings(redis_url=REDIS_URL, queue_name=QUEUE, exports_dir=tmp_path / "exports")
    client = TestClient(create_app(settings))
    try:
        posted = client.post("/api/v1/analyses", json=BODY)
        assert posted.status_code == 202, posted.text
        analysis_id = posted.json()["id"]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "FISHERSCOPE_QUEUE_NAME": QUEUE,
            "FISHERSCOPE_EXPORTS_DIR": str(settings.exports_dir),
        }
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2"]
        command = [*torchrun, "-m", "workers.cli", "worker", "--redis-url", REDIS_URL, "--burst"]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        split = _wait_done(client, analysis_id, timeout_s=1)  # the burst worker ran it before it left
        assert split["status"] == "done", split["error"]
    finally:
        connection.flushdb()

    from workers.serve import embedded_api

    alone = TestClient(embedded_api(Settings(results_dir=tmp_path / "r", exports_dir=tmp_path / "e")))
    posted = alone.post("/api/v1/analyses", json=BODY)
    assert posted.json()["id"] == analysis_id
    single = _wait_done(alone, analysis_id)
    assert single["status"] == "done", single["error"]

    one, two = single["result"], split["result"]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert sum(two["directions_per_process"]) == one["directions_per_process"][0]
    assert all(count > 0 for count in two["directions_per_process"])
    for key, value in one["totals"].items():
        assert two["totals"][key] == pytest.approx(value, rel=1e-4, abs=1e-12), key
    tensors = {tensor["name"]: tensor["totals"] for tensor in two["tensors"]}
    for tensor in one["tensors"]:
        for stat, value in tensor["totals"].items():
            found = tensors[tensor["name"]][stat]
            assert found == pytest.approx(value, rel=1e-4, abs=1e-9), (tensor["name"], stat)


# --- the protocol alone: what rank 0 sends, what the others repeat, how a failure travels -------------


def repeat_share(fail_on: int, stage: str):
    """A run that records the shard it ran in, failing on process ``fail_on`` at ``stage``."""
    rank = dist.get_rank()
    if (rank, stage) == (fail_on, "load"):
        raise FileNotFoundError("no weights on this node")

    def run() -> Shard | None:
        if (rank, stage) == (fail_on, "run"):
            raise MemoryError("out of memory")
        return current_shard()

    return run


def _worker_process(rank: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        if rank:
            processes.follow()  # returns at rank 0's stop
            return
        with processes.leading():
            for fail_on, stage, message in (
                (1, "load", "process 1 of 2 of this worker failed: FileNotFoundError: no weights"),
                (1, "run", "process 1 of 2 of this worker failed: MemoryError: out of memory"),
            ):
                try:
                    with processes.together(repeat_share, fail_on, stage):
                        repeat_share(-1, "")()
                except RuntimeError as error:
                    assert message in str(error), error
                else:
                    raise AssertionError("a failure in process 1 did not fail the run")
            try:
                with processes.together(repeat_share, -1, ""):
                    raise MemoryError("out of memory on rank 0")
            except MemoryError:
                pass  # rank 0's own failure, as it was
            with processes.together(repeat_share, -1, ""):
                assert repeat_share(-1, "")() == Shard(0, 2)  # and the group still runs together
        assert processes._control is None and current_shard() is None
    finally:
        dist.destroy_process_group()


def test_rank_0_leads_and_a_failure_in_any_process_fails_the_run_in_step(tmp_path):
    mp.spawn(_worker_process, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True, start_method="spawn")
