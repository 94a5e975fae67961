"""The cache-hit fast path: stored summary bytes spliced into the response must answer exactly what
the pydantic path answers (same schema, same values), in both stores, and never emit NaN.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from backend.local_store import LocalStore
from backend.main import create_app
from backend.queue import ThreadQueue
from backend.schemas import AnalysisCreate, AnalysisPublic
from backend.service import AnalysisService
from backend.settings import Settings
from backend.store import RedisStore, Store
from tests.requirements import require

REDIS_URL = "redis://127.0.0.1:6379/11"
# an engine summary (tiny-random), its first token's text holding what JSON must escape
SUMMARY = json.loads((Path(__file__).parent / "fixtures" / "summary_tiny_random.json").read_text())
SUMMARY["tokens"]["prefix"][0]["text"] = 'caf\u00e9 \u2013 "quoted" \\ NaN'

# a partial result's light summary: no concentration, top coordinates, overlap, cost or timing yet
PARTIAL = {
    **SUMMARY,
    "concentration": None,
    "top_coordinates": None,
    "overlap": None,
    "cost": None,
    "timing": None,
}

needs_tiny = pytest.mark.usefixtures("tiny_random")  # fetched into the cache when missing


def refuse_constant(token: str) -> None:
    raise AssertionError(f"response holds the non-JSON number {token}")


def never_run(function: str, payload: dict, analysis_id: str) -> None:
    raise AssertionError(f"a cache hit must not queue {function}")


def cached_analysis(store: Store, settings: Settings, summary: dict) -> tuple[AnalysisService, dict, str]:
    """A service over `store` with one finished analysis of tiny-random stored in it."""
    service = AnalysisService(settings, store, ThreadQueue(never_run))
    body = {"model": "tiny-random", "prefix": "She drank a cup of", "reward": {" tea": 1.0}}
    create = AnalysisCreate.model_validate(body)
    info, codec = service.resolve_model(create.model)
    from backend.normalize import normalize

    job = normalize(create, codec, info, settings.limits())
    analysis_id = job.key()
    meta = {"status": "queued", "progress": 0.0, "stage": None, "error": None}
    meta |= {"request": job.model_dump(mode="json"), "cost": None, "created": 0.0}
    assert store.claim(analysis_id, meta)
    store.save_result(analysis_id, summary, {})
    return service, body, analysis_id


def check_fast_path(service: AnalysisService, body: dict, analysis_id: str) -> dict:
    slow = service.get(analysis_id).model_dump(mode="json")
    fast = json.loads(service.get_json(analysis_id), parse_constant=refuse_constant)
    assert fast == slow
    AnalysisPublic.model_validate(fast)
    posted, status = service.submit_json(AnalysisCreate.model_validate(body))
    assert status == 200 and json.loads(posted, parse_constant=refuse_constant) == slow
    return fast


@needs_tiny
def test_local_store_splices_the_summary_unchanged(tmp_path: Path) -> None:
    settings = Settings(redis_url=None, results_dir=tmp_path / "results")
    service, body, analysis_id = cached_analysis(LocalStore(settings.results_dir), settings, SUMMARY)
    fast = check_fast_path(service, body, analysis_id)
    assert fast["status"] == "done" and fast["result"] == SUMMARY
    assert fast["result"]["tokens"]["prefix"][0]["text"] == SUMMARY["tokens"]["prefix"][0]["text"]

    restarted = AnalysisService(settings, LocalStore(settings.results_dir), ThreadQueue(never_run))
    assert json.loads(restarted.get_json(analysis_id)) == fast  # read back from the folder


@needs_tiny
def test_nan_in_a_summary_is_served_as_null(tmp_path: Path) -> None:
    settings = Settings(redis_url=None, results_dir=tmp_path / "results")
    summary = {**SUMMARY, "totals": {"fisher": math.nan, "raw": math.inf}}  # non-finite: null on the wire
    store = LocalStore(settings.results_dir)
    service, body, analysis_id = cached_analysis(store, settings, summary)
    assert check_fast_path(service, body, analysis_id)["result"]["totals"] == {"fisher": None, "raw": None}

    # a summary written by an older version holds the token NaN: served through the slow path
    (settings.results_dir / analysis_id / "summary.json").write_text(json.dumps(summary))
    older = AnalysisService(settings, LocalStore(settings.results_dir), ThreadQueue(never_run))
    assert check_fast_path(older, body, analysis_id)["result"]["totals"] == {"fisher": None, "raw": None}


@needs_tiny
def test_redis_store_reads_meta_and_summary_in_one_round_trip(tmp_path: Path) -> None:
    connection = redis.Redis.from_url(REDIS_URL)
    try:
        reachable = bool(connection.ping())
    except redis.ConnectionError:
        reachable = False
    require(reachable, "Redis on 127.0.0.1:6379 (.ci/run starts it)")
    connection.flushdb()
    try:
        settings = Settings(redis_url=REDIS_URL, results_dir=tmp_path)
        store = RedisStore(connection, ttl_s=60)
        service, body, analysis_id = cached_analysis(store, settings, SUMMARY)
        check_fast_path(service, body, analysis_id)

        calls = []
        mget = connection.mget
        connection.mget = lambda keys: calls.append(keys) or mget(keys)  # type: ignore[method-assign]
        get = connection.get
        connection.get = lambda key: calls.append(key) or get(key)  # type: ignore[method-assign]
        service.get_json(analysis_id)
        assert len(calls) == 1, calls

        connection.delete(f"fs:summary:{analysis_id}")  # expired summary: the POST queues it again
        assert json.loads(service.get_json(analysis_id))["result"] is None
    finally:
        connection.flushdb()


@needs_tiny
def test_http_answers_are_the_pinned_schema(tmp_path: Path) -> None:
    settings = Settings(redis_url=None, results_dir=tmp_path / "results")
    store = LocalStore(settings.results_dir)
    _, body, analysis_id = cached_analysis(store, settings, SUMMARY)
    client = TestClient(create_app(settings, store, ThreadQueue(never_run)))
    got = client.get(f"/api/v1/analyses/{analysis_id}")
    posted = client.post("/api/v1/analyses", json=body)
    assert got.status_code == 200 and posted.status_code == 200
    assert got.headers["content-type"] == "application/json"
    assert got.json() == posted.json() and got.json()["result"] == SUMMARY
    assert client.get("/api/v1/analyses/" + "0" * 64).status_code == 404
    top = client.get(f"/api/v1/analyses/{analysis_id}/top", params={"stat": "fisher", "limit": 1})
    assert top.json()["coordinates"] == SUMMARY["top_coordinates"]["fisher"][:1]


@needs_tiny
@pytest.mark.parametrize("kind", ["local", "redis"])
def test_a_running_analysis_answers_its_latest_partial_result(tmp_path: Path, kind: str) -> None:
    """The partial is spliced into the running status as stored; it is gone once the result is in."""
    settings = Settings(redis_url=None, results_dir=tmp_path)
    if kind == "redis":
        connection = redis.Redis.from_url(REDIS_URL)
        connection.flushdb()
        store: Store = RedisStore(connection, settings.result_ttl_s)
    else:
        store = LocalStore(tmp_path)
    service = AnalysisService(settings, store, ThreadQueue(lambda *args: None))
    body = {"model": "tiny-random", "prefix": "She drank a cup of"}
    analysis_id, _ = service.submit_id(AnalysisCreate.model_validate(body))
    store.update_meta(analysis_id, status="running", stage="directions", progress=0.3)
    store.touch_lease(analysis_id)
    assert json.loads(service.get_json(analysis_id))["partial"] is None
    partial = {"kept_share": 0.63, "result": PARTIAL}
    store.save_partial(analysis_id, partial)
    answer = json.loads(service.get_json(analysis_id))
    assert answer["partial"] == partial and answer["result"] is None
    assert AnalysisPublic.model_validate(answer).partial.kept_share == 0.63
    store.save_result(analysis_id, SUMMARY, {})
    done = json.loads(service.get_json(analysis_id))
    assert done["partial"] is None and done["result"] == SUMMARY
    assert store.get_partial_json(analysis_id) is None
