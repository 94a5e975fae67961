"""A shared server only its users can drive: allowed hosts, the API token, per-client rate limits, the
dashboard behind the same token, and `serve` refusing to open itself to a network without one.
"""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from backend.credentials import basic_header
from backend.main import create_app
from frontend.api_client import ApiClient
from tests.service_settings import folder_settings
from workers.cli import main
from workers.serve import build_app, exposure_problem, served_settings

TOKEN = "a-token-for-tests-0123456789"
REDIS_URL = "redis://127.0.0.1:6379/12"
ANALYSIS = {"model": "tiny-random", "prefix": "She drank a cup of"}
STUDY = {"model": "tiny-random", "prompts": [{"prompt": "Two plus three is", "target": " five"}]}
EXPORT = "/api/v1/analyses/" + "0" * 64 + "/safetensors"


settings = folder_settings


def api(tmp_path: Path, **overrides) -> TestClient:
    return TestClient(create_app(settings(tmp_path, **overrides)))


def test_a_foreign_host_header_is_refused_as_dns_rebinding_would_send_it(tmp_path: Path) -> None:
    client = api(tmp_path, allowed_hosts=["localhost", "127.0.0.1", "::1"])
    for host in ("localhost:8000", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
        assert client.get("/api/v1/models", headers={"host": host}).status_code == 200, host
    for host in ("evil.example:8000", "127.0.0.1.evil.example", "", "[::2]"):
        refused = client.get("/api/v1/models", headers={"host": host})
        assert refused.status_code == 400, host
        assert "FISHERSCOPE_ALLOWED_HOSTS" in refused.json()["detail"]
    assert api(tmp_path, allowed_hosts=["*"]).get("/healthz", headers={"host": "any.example"}).is_success


def test_serve_allows_the_address_it_binds_and_refuses_a_network_without_a_token(tmp_path: Path) -> None:
    base = settings(tmp_path, allowed_hosts=["localhost"])
    assert served_settings(base, "10.1.2.3").allowed_hosts == ["localhost", "10.1.2.3"]
    assert served_settings(base, "0.0.0.0").allowed_hosts == ["localhost"]
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert exposure_problem(host, base, open_without_token=False) is None
    for host in ("0.0.0.0", "::", "192.168.1.5"):
        problem = exposure_problem(host, base, open_without_token=False)
        assert problem is not None and "FISHERSCOPE_API_TOKEN" in problem
        assert exposure_problem(host, base, open_without_token=True) is None
    with_token = settings(tmp_path, api_token=TOKEN)
    assert exposure_problem("0.0.0.0", with_token, open_without_token=False) is None


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["serve", "--host", "0.0.0.0"], {}, "FISHERSCOPE_API_TOKEN"),
        (["serve", "--host", "192.168.7.7", "--port", "1"], {}, "--open-without-token"),
        (["serve"], {"FISHERSCOPE_API_TOKEN": "short"}, "at least 16 characters"),
        (["serve"], {"FISHERSCOPE_RATE_LIMIT": "lots"}, "FISHERSCOPE_RATE_LIMIT"),
    ],
)
def test_serve_refuses_before_starting(argv, env, says, monkeypatch, capsys) -> None:
    from backend.settings import get_settings

    monkeypatch.delenv("FISHERSCOPE_API_TOKEN", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    try:
        assert main(argv) == 2
    finally:
        get_settings.cache_clear()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines


def test_the_token_guards_routes_that_compute_or_write(tmp_path: Path) -> None:
    client = api(tmp_path, api_token=TOKEN)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for method, path, body in (
        ("POST", "/api/v1/analyses", ANALYSIS),
        ("POST", "/api/v1/studies", STUDY),
        ("GET", EXPORT, None),
    ):
        for headers in (
            {},
            {"Authorization": "Bearer wrong-token-0123456789"},
            {"Authorization": "Basic %%"},
        ):
            refused = client.request(method, path, json=body, headers=headers)
            assert refused.status_code == 401, (path, headers, refused.text)
            assert refused.headers["WWW-Authenticate"].startswith("Bearer")
            assert "FISHERSCOPE_API_TOKEN" in refused.json()["detail"]
        for headers in (bearer, {"Authorization": basic_header(TOKEN)}):
            allowed = client.request(method, path, json=body, headers=headers)
            assert allowed.status_code not in (401, 403), (path, allowed.text)
    # reads by id, the model list and health stay open: a share link opens for a colleague
    assert client.get("/api/v1/models").status_code == 200
    assert client.get("/api/v1/analyses/" + "0" * 64).status_code == 404
    assert client.get("/healthz").status_code == 200


def test_without_a_token_the_compute_routes_are_open_as_before(tmp_path: Path) -> None:
    assert api(tmp_path).post("/api/v1/analyses", json=ANALYSIS).status_code == 202


def test_a_client_over_its_limit_gets_429_with_retry_after(tmp_path: Path) -> None:
    app = create_app(settings(tmp_path, rate_limit="3/minute"))
    first, second = (TestClient(app, client=(f"10.0.0.{n}", 5000)) for n in (1, 2))
    answers = [first.post("/api/v1/analyses", json=ANALYSIS).status_code for _ in range(3)]
    assert 429 not in answers
    limited = first.post("/api/v1/studies", json=STUDY)  # one window over every compute route
    assert limited.status_code == 429
    assert 1 <= int(limited.headers["Retry-After"]) <= 60
    assert "retry in" in limited.json()["detail"]
    assert first.get("/api/v1/models").status_code == 200  # reads are not limited
    assert second.post("/api/v1/analyses", json=ANALYSIS).status_code != 429  # per client


def test_api_processes_over_one_redis_share_the_limit(tmp_path: Path) -> None:
    client = (f"10.9.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}", 5000)
    redis.Redis.from_url(REDIS_URL).ping()
    apps = [create_app(settings(tmp_path, redis_url=REDIS_URL, rate_limit="2/minute")) for _ in range(2)]
    one, two = (TestClient(app, client=client) for app in apps)
    bad = {"model": "no-such-model", "prefix": "x"}  # refused cheaply, after the limit counted it
    assert one.post("/api/v1/analyses", json=bad).status_code == 422
    assert two.post("/api/v1/analyses", json=bad).status_code == 422
    assert one.post("/api/v1/analyses", json=bad).status_code == 429


def test_unknown_api_paths_answer_json_never_the_dashboard(tmp_path: Path) -> None:
    client = TestClient(build_app(settings(tmp_path), "127.0.0.1", 8000))
    assert client.get("/").status_code == 200 and "_dash-config" in client.get("/").text
    cases = [
        ("GET", "/api/v1/nope", 404),
        ("GET", "/api/v2/models", 404),
        ("GET", "/api/v1/analyses/" + "0" * 64 + "/tensors/model.layers.0%2fweight", 404),
        ("DELETE", "/api/v1/models", 405),
        ("PUT", "/api/v1/studies", 405),
        ("HEAD", "/api/v1/nope", 404),
        ("POST", "/api/v1/models", 405),
    ]
    for method, path, status in cases:
        answer = client.request(method, path)
        assert answer.status_code == status, (method, path, answer.text[:200])
        assert answer.headers["content-type"].startswith("application/json"), (method, path)
        if status == 405:
            assert answer.headers["Allow"]


def test_dash_internals_refuse_malformed_requests_with_4xx(tmp_path: Path) -> None:
    client = TestClient(build_app(settings(tmp_path), "127.0.0.1", 8000), raise_server_exceptions=False)
    for prefix in ("", "/studies"):
        for body in (b"{}", b"[]", b"not json", b'{"output": 5}', b'{"output": "x.y", "inputs": []}'):
            answer = client.post(
                f"{prefix}/_dash-update-component", content=body, headers={"content-type": "application/json"}
            )
            assert answer.status_code == 400, (prefix, body, answer.text[:200])
            assert "not a request of this dashboard" in answer.json()["detail"]
    layout = client.get("/_dash-dependencies").json()
    real = layout[0]
    wrong_inputs = {"output": real["output"], "inputs": [], "state": [], "outputs": []}
    assert client.post("/_dash-update-component", json=wrong_inputs).status_code == 400
    for callback in layout:  # the right shape, an object wherever the page sends text or numbers
        objects = [
            [{**item, "value": {"x": 1}} for item in callback.get(field, [])] for field in ("inputs", "state")
        ]
        body = {"output": callback["output"], "outputs": [], "inputs": objects[0], "state": objects[1]}
        answer = client.post("/_dash-update-component", json=body)
        assert answer.status_code < 500, (callback["output"], answer.text[:200])
        assert answer.headers["content-type"].startswith("application/json") or answer.status_code == 204
    assert client.get("/_dash-component-suites/dash/nope.js").status_code == 404


def test_the_dashboard_asks_for_the_token_and_keeps_it_server_side(tmp_path: Path) -> None:
    client = TestClient(build_app(settings(tmp_path, api_token=TOKEN), "127.0.0.1", 8000))
    for path in ("/", "/studies/", "/_dash-layout"):
        refused = client.get(path)
        assert refused.status_code == 401, path
        assert refused.headers["WWW-Authenticate"].startswith("Basic")
    wrong = "Basic " + base64.b64encode(b"someone:guess").decode()
    assert client.get("/", headers={"Authorization": wrong}).status_code == 401
    page = client.get("/?prefix=hello", headers={"Authorization": basic_header(TOKEN, user="anyone")})
    assert page.status_code == 200 and TOKEN not in page.text
    layout = client.get("/_dash-layout", headers={"Authorization": basic_header(TOKEN)})
    assert layout.status_code == 200 and TOKEN not in layout.text


def test_the_dashboards_client_sends_the_token(tmp_path: Path) -> None:
    app = create_app(settings(tmp_path, api_token=TOKEN))
    dashboard = ApiClient("http://testserver", token=TOKEN)
    dashboard.http = TestClient(app, headers=dict(dashboard.http.headers))
    assert dashboard.submit(ANALYSIS)["status"] in ("queued", "failed", "running", "done")
    anonymous = ApiClient("http://testserver", token="")
    anonymous.http = TestClient(app, headers=dict(anonymous.http.headers))
    with pytest.raises(Exception, match="FISHERSCOPE_API_TOKEN"):
        anonymous.submit(ANALYSIS)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve", "--port", "99999"], "must be in 1-65535"),
        (["serve", "--port", "http"], "not a whole number"),
        (["worker", "--redis-url", "redis://127.0.0.1:1/15"], "cannot reach Redis"),
        (["worker", "--redis-url", "bogus://x"], "cannot reach Redis"),
    ],
)
def test_serve_and_worker_options_are_one_line_errors(argv, says, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
