"""Every bad request gets a 4xx whose message says what to fix (embedded app, no worker)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from backend import registry as catalog
from backend.main import create_app
from backend.settings import Settings

OK = {"model": "tiny-random", "prefix": "She drank a cup of"}


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    if not catalog.is_available("tiny-random"):
        from workers.models.fetch import fetch_model

        fetch_model("tiny-random", progress=False)
    folder = tmp_path_factory.mktemp("embedded")
    settings = Settings(
        redis_url=None,
        results_dir=folder / "results",
        exports_dir=folder / "exports",
        allowed_models=["tiny-random", "smollm2-135m"],
        max_prefix_tokens=16,
        max_continuation_tokens=4,
        cost_budget_tflop=1.0,
    )
    return TestClient(create_app(settings))


BAD_BODIES = [
    ({"model": "tiny-random"}, "prefix"),
    ({**OK, "prefix": ""}, "prefix"),
    ({**OK, "prefix": "   "}, "prefix is empty"),
    ({**OK, "prefix": "a " * 40}, "over the limit of 16"),
    ({**OK, "continuation": " a cup of tea and"}, "over the limit of 4"),
    ({**OK, "model": "gpt2"}, "unknown model"),
    ({**OK, "model": "../../etc/passwd"}, "not a path"),
    ({**OK, "model": "/root/.cache/fisherscope/tiny-random"}, "not a path"),
    ({**OK, "sampler": {"temperature": 0}}, "temperature"),
    ({**OK, "sampler": {"temperature": -1}}, "temperature"),
    ({**OK, "sampler": {"top_k": 0}}, "top_k"),
    ({**OK, "sampler": {"top_p": 0}}, "top_p"),
    ({**OK, "sampler": {"top_p": 1.01}}, "top_p"),
    ({**OK, "sampler": {"engine": "fp8"}}, "engine"),
    ({**OK, "sampler": {"kind": "beam"}}, "kind"),
    ({**OK, "method": "svd"}, "method must be"),
    ({**OK, "method": "mc:1"}, "method must be"),
    ({**OK, "method": "truncated:2"}, "method must be"),
    ({**OK, "reward": {"zzzzqq": 1.0}}, "not exactly one"),
    ({**OK, "reward": {"#99999": 1.0}}, "outside the vocabulary"),
    ({**OK, "reward": {" tea": "lots"}}, "valid number"),
    ({**OK, "reward": {" tea": [1]}}, "valid number"),
    ({**OK, "sampler": {"kind": "data"}}, "one-hot on"),
    ({**OK, "sampler": {"kind": "data", "data_token": "zzzzqq"}}, "not exactly one"),
    ({**OK, "extra": 1}, "extra"),
    ({**OK, "model": "smollm2-135m", "prefix": "word " * 15}, "over the budget"),
]


@pytest.mark.parametrize(("body", "says"), BAD_BODIES)
def test_bad_body_gets_4xx_with_message(client: TestClient, body: dict, says: str) -> None:
    response = client.post("/api/v1/analyses", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert says in response.json()["detail"]


def test_over_budget_names_estimate_and_cheaper_methods(client: TestClient) -> None:
    body = {**OK, "model": "smollm2-135m", "prefix": "word " * 15}
    answer = client.post("/api/v1/analyses", json=body).json()
    assert answer["estimate"]["flops"] > 1e12
    assert answer["cheaper_methods"] and all(
        m.startswith(("truncated:", "mc:")) for m in answer["cheaper_methods"]
    )


RAW_BODIES = [
    (b'{"model": "tiny-random", "prefix":', 400, "not valid JSON"),
    (b"[" * 200 + b"]" * 200, 400, "nested"),
    (b'{"model": "tiny-random", "prefix": "a\xff\xfe"}', 400, "UTF-8"),
    (b'{"model": "tiny-random", "prefix": "a\\ud800"}', 422, "unicode"),
    (b'{"model": "tiny-random", "prefix": "a", "reward": {" tea": NaN}}', 422, "finite"),
    (b'{"model": "tiny-random", "prefix": "a", "sampler": {"temperature": Infinity}}', 422, "finite"),
    (b"x" * (300 * 1024), 413, "bytes"),
]


@pytest.mark.parametrize(("raw", "status", "says"), RAW_BODIES)
def test_malformed_bodies(client: TestClient, raw: bytes, status: int, says: str) -> None:
    response = client.post("/api/v1/analyses", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert says in response.json()["detail"]


def test_unknown_analysis_is_404(client: TestClient) -> None:
    response = client.get("/api/v1/analyses/" + "0" * 64)
    assert response.status_code == 404 and "POST /api/v1/analyses" in response.json()["detail"]
    assert client.get("/api/v1/analyses/../../etc/passwd").status_code == 404


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/analyses/{id}",
        "/api/v1/analyses/{id}/tensors",
        "/api/v1/analyses/{id}/top",
        "/api/v1/analyses/{id}/safetensors",
        "/api/v1/analyses/{id}/tensors/lm_head.weight",
    ],
)
@pytest.mark.parametrize("bad_id", ["0" * 60_000, "A" * 64, "0" * 63, "g" * 64])
def test_malformed_ids_are_refused_at_the_route(client: TestClient, path: str, bad_id: str) -> None:
    response = client.get(path.format(id=bad_id))
    assert response.status_code == 422, response.text
    assert "analysis_id" in response.json()["detail"] and "64" in response.text


def test_tokenize_and_models(client: TestClient) -> None:
    pieces = client.get("/api/v1/tokenize", params={"model": "tiny-random", "text": " tea cup"}).json()
    assert [p["text"] for p in pieces["tokens"]] == [" tea", " cup"]
    assert client.get("/api/v1/tokenize", params={"model": "../x", "text": "a"}).status_code == 422
    models = {m["id"]: m for m in client.get("/api/v1/models").json()}
    info = catalog.model_info("tiny-random")
    assert models["tiny-random"]["vocab_size"] == info.vocab_size
    assert models["tiny-random"]["n_layers"] == info.n_layers
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/readyz").json()["status"] == "ready"
