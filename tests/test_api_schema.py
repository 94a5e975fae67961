"""The OpenAPI schema is pinned, `backend.main` stays torch-free, and schemathesis finds no 5xx.

The schemathesis app runs in Redis mode on db 11 with no worker: accepted analyses stay queued.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from backend.main import create_app
from backend.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = "redis://127.0.0.1:6379/11"


def redis_app(**overrides):
    return create_app(Settings(redis_url=REDIS_URL, queue_name="fisherscope-schema-test", **overrides))


@pytest.fixture(scope="module", autouse=True)
def empty_database():
    """Db 11 is this module's: the queued analyses of one run are not the next run's cache."""
    redis.Redis.from_url(REDIS_URL).flushdb()


def test_openapi_schema_is_pinned() -> None:
    """Regenerate with: REDIS_URL=redis://127.0.0.1:6379/11 python -c "import json; from backend.main
    import app; open('openapi.json','w').write(json.dumps(app.openapi(), indent=2, sort_keys=True)+'\\n')"
    """
    committed = json.loads((ROOT / "openapi.json").read_text())
    assert redis_app().openapi() == committed


def test_backend_main_does_not_import_torch() -> None:
    code = "import sys, backend.main; print('torch' in sys.modules, 'workers.engine' in sys.modules)"
    for env in ({"REDIS_URL": REDIS_URL}, {}):
        result = subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), **env},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["False", "False"]


schema = schemathesis.openapi.from_asgi("/openapi.json", redis_app())
# a shared server: every request without the token, so compute routes answer their documented 401
guarded = schemathesis.openapi.from_asgi("/openapi.json", redis_app(api_token="schema-test-token-0123456789"))


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_no_server_errors(case) -> None:
    case.call_and_validate(
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ]
    )


@pytest.mark.slow
@guarded.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_no_server_errors_with_a_token(case) -> None:
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance])
