"""Hostile input never holds a worker or the API: reward patterns are RE2, tried at POST against every
prompt's target; a part that cannot succeed is not retried and the study says why; the request schemas
fuzzed with Hypothesis answer 2xx or 4xx, never 5xx.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.embedded import local_backend
from backend.main import create_app
from backend.queue import JobQueue
from backend.rewards import RewardKind, RewardRule
from backend.settings import Settings
from backend.studies import STUDY_KIND, StudyService
from backend.study_schemas import StudyJob
from tests.test_redis_e2e import ensure_tiny, start_worker, stop_worker
from tests.test_study_api import wait_study

REDIS_URL = "redis://127.0.0.1:6379/14"
QUEUE = "fisherscope-hostile-test"
# what froze the embedded process under Python's `re`: exponential backtracking on a 32-token response
BACKTRACKING = r"([\s\S]|[\s\S])*(?!)"
BACKTRACKING_RE2 = r"([\s\S]|[\s\S])*\x00{target}"  # the same blow-up for `re`, a pattern RE2 runs
STUDY = {
    "model": "tiny-random",
    "prompts": [{"prompt": "Two plus three is", "target": " 2+3"}],
    "samples": 1,
    "max_tokens": 32,
    "seed": 3,
    "sampler": {"top_k": 8},
}


def study(pattern: str) -> dict:
    return {**STUDY, "reward": {"kind": "regex", "pattern": pattern}}


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> TestClient:
    """Redis mode with no worker: what is accepted stays queued, nothing computes."""
    ensure_tiny()
    redis.Redis.from_url(REDIS_URL).flushdb()
    folder = tmp_path_factory.mktemp("hostile")
    return TestClient(create_app(Settings(redis_url=REDIS_URL, queue_name=QUEUE, studies_dir=folder)))


@pytest.mark.parametrize(
    ("pattern", "says"),
    [
        (BACKTRACKING, "invalid perl operator"),
        ("(" * 499, "missing )"),
        ("a{1001}", "invalid repetition size"),
        (r"(a)\1{target}", "backreferences"),
        ("(?P<{target}>.)", "prompt 1"),
        ("", "needs a pattern"),
    ],
)
def test_a_pattern_re2_cannot_run_is_422_at_post(api: TestClient, pattern: str, says: str) -> None:
    answer = api.post("/api/v1/studies", json=study(pattern))
    assert answer.status_code == 422, answer.text
    assert says in answer.json()["detail"], answer.json()["detail"]


@pytest.mark.parametrize("pattern", ["a{4294967295}", "a{1,99999999999}", BACKTRACKING_RE2])
def test_patterns_re2_reads_otherwise_are_accepted_never_a_500(api: TestClient, pattern: str) -> None:
    """RE2 reads a count it cannot parse as literal text; either way the answer is not a 500."""
    assert api.post("/api/v1/studies", json=study(pattern)).status_code == 202


@pytest.mark.timeout(20)
def test_scoring_is_linear_in_the_response_whatever_the_pattern() -> None:
    """Under `re` each of these takes longer than the age of the universe on 5000 characters."""
    response = "x" * 5000
    for pattern in (BACKTRACKING_RE2, r"(x+x+)+y{target}", r"(.*)*(.*)*(.*)*\x00{target}"):
        assert RewardRule(RewardKind.regex, pattern).score(response, "t") == 0.0
    assert RewardRule(RewardKind.regex, r"^\s*{target}(\D|$)").score(" 8 apples", "8") == 1.0
    assert RewardRule(RewardKind.regex, r"^\s*{target}(\D|$)").score(" 81", "8") == 0.0
    assert RewardRule(RewardKind.regex, "{target}").score("a \udc80 2+3", "2+3") == 1.0


@pytest.mark.slow
def test_a_redis_worker_scores_the_backtracking_pattern_and_stays_alive(tmp_path: Path) -> None:
    ensure_tiny()
    redis.Redis.from_url(REDIS_URL).flushdb()
    studies = tmp_path / "studies"
    client = TestClient(create_app(Settings(redis_url=REDIS_URL, queue_name=QUEUE, studies_dir=studies)))
    worker = start_worker(tmp_path / "exports", REDIS_URL, QUEUE, {"FISHERSCOPE_STUDIES_DIR": str(studies)})
    try:
        posted = client.post("/api/v1/studies", json=study(BACKTRACKING_RE2))
        assert posted.status_code == 202, posted.text
        started = time.monotonic()
        done = wait_study(client, posted.json()["id"], timeout_s=240)
        assert client.get("/healthz").status_code == 200
    finally:
        stop_worker(worker)
    assert done["status"] == "done", done["error"]
    assert len(done["summary"]["responses"]) == 1
    assert time.monotonic() - started < 240


class RecordingQueue(JobQueue):
    """The jobs a service queued, for a test that asks whether anything was queued again."""

    def __init__(self) -> None:
        self.jobs: list[str] = []

    def enqueue(self, function: str, payload: dict, analysis_id: str, retries: int = 0) -> None:
        self.jobs.append(analysis_id)


def test_a_part_that_cannot_succeed_is_not_retried_and_the_study_says_why(tmp_path: Path) -> None:
    """A study queued before its pattern was checked (an older API, a job written by hand) fails on
    the worker with the reason; a new POST of it queues nothing and keeps saying what to change."""
    from workers.study_jobs import execute_study_part

    ensure_tiny()
    settings_ = Settings(results_dir=tmp_path / "results", studies_dir=tmp_path / "studies")
    store, _ = local_backend(settings_)
    queue = RecordingQueue()
    service = StudyService(create_app(settings_, store, queue).state.service)
    accepted, _ = service.normalize(service_body())
    job = StudyJob.model_validate(
        {**accepted.model_dump(mode="json"), "reward": {"kind": "regex", "pattern": "(?P<{target}>.)"}}
    )
    study_id = job.key()
    store.claim(study_id, {"kind": STUDY_KIND, "status": "queued", "request": job.model_dump(mode="json")})
    execute_study_part(job, 0, store, settings_)
    read = service.get(study_id)
    assert read.status == "failed" and read.parts[0].permanent
    assert "retrying cannot fix" in (read.error or "") and "invalid named capture group" in (read.error or "")
    service._enqueue_parts(study_id, job)
    assert queue.jobs == []


def service_body():
    from backend.study_schemas import StudyCreate

    return StudyCreate.model_validate({**STUDY, "max_tokens": 2})


# ---- fuzz: a fixed budget of generated requests against the request schemas ----

FLOATS = st.floats(allow_nan=False, allow_infinity=False)  # JSON has no NaN: raw bodies test those
JSON_LEAVES = st.none() | st.booleans() | st.integers() | FLOATS | st.text(max_size=40)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
)
SAMPLERS = st.fixed_dictionaries(
    {},
    optional={
        "kind": st.sampled_from(["model", "uniform", "data", "nope"]) | JSON_LEAVES,
        "temperature": FLOATS | JSON_LEAVES,
        "top_k": st.integers(-5, 10**12) | JSON_LEAVES,
        "top_p": FLOATS | JSON_LEAVES,
    },
)
ANALYSES = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny-random", "nope", "../x", ""]) | st.text(max_size=20)},
    optional={
        "prefix": st.text(max_size=60),
        "continuation": st.text(max_size=30) | st.none(),
        "sampler": SAMPLERS | JSON_VALUES,
        "reward": st.dictionaries(st.text(max_size=6), FLOATS | JSON_LEAVES, max_size=3) | JSON_VALUES,
        "method": st.sampled_from(["exact", "mc:4", "truncated:0.9", "mc:-1", "mc:nan"])
        | st.text(max_size=12),
        "extra": JSON_VALUES,
    },
)
STUDIES = st.fixed_dictionaries(
    {
        "model": st.just("tiny-random"),
        "prompts": st.lists(
            st.fixed_dictionaries(
                {"prompt": st.text(max_size=40)}, optional={"target": st.text(max_size=10)}
            ),
            min_size=0,
            max_size=3,
        ),
    },
    optional={
        "reward": st.fixed_dictionaries(
            {"kind": st.sampled_from(["regex", "exact", "other"])},
            optional={"pattern": st.text(alphabet="(){}[]*+?|\\.^$ab{target}<>P=!:dws0-9", max_size=30)},
        ),
        "samples": st.integers(-2, 100),
        "max_tokens": st.integers(-2, 300),
        "q": st.lists(FLOATS, max_size=4),
        "sampler": SAMPLERS,
    },
)
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(body=ANALYSES)
def test_fuzzed_analysis_requests_are_answered_without_a_server_error(api: TestClient, body: dict) -> None:
    answer = api.post("/api/v1/analyses", json=body)
    assert answer.status_code in (200, 202, 400, 413, 422), (body, answer.text)
    assert answer.headers["content-type"].startswith("application/json")


@FUZZ
@given(body=STUDIES)
def test_fuzzed_study_requests_are_answered_without_a_server_error(api: TestClient, body: dict) -> None:
    answer = api.post("/api/v1/studies", json=body)
    assert answer.status_code in (200, 202, 400, 413, 422), (body, answer.text)
    if answer.status_code >= 400:
        assert answer.json()["detail"], body


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-0.0"])
def test_non_finite_numbers_in_a_raw_body_are_refused(api: TestClient, number: str) -> None:
    for field in ("temperature", "top_p", "top_k"):
        body = f'{{"model": "tiny-random", "prefix": "x", "sampler": {{"{field}": {number}}}}}'
        answer = api.post("/api/v1/analyses", content=body, headers={"content-type": "application/json"})
        assert answer.status_code in (202, 400, 422), (field, number, answer.text)
    studies = f'{{"model": "tiny-random", "prompts": [{{"prompt": "a"}}], "q": [{number}]}}'
    answer = api.post("/api/v1/studies", content=studies, headers={"content-type": "application/json"})
    assert answer.status_code in (202, 400, 422), (number, answer.text)
