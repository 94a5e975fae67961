"""Regenerate the summaries the dashboard tests read (tests/fixtures/) from the engine itself.

Each fixture is what `GET /api/v1/analyses/{id}` returns as `result` for one request, computed through
the worker's own path (normalize -> `workers.jobs.analyze_job`), with the timing zeroed so that the
same engine gives the same bytes. `tests/fixtures/fixtures.json` records each request with the
model's digest and the engine version; tests/test_fixtures.py checks that the files are current.

    .venv/bin/python scripts/make_fixtures.py [--only summary_tiny_random]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "tests" / "fixtures"
MANIFEST = FIXTURES / "fixtures.json"
PREFIX = "She drank a cup of"
REQUESTS: dict[str, dict] = {
    # slide 2, 5 and 10 material: a tempered sampler with a reward that prefers tea
    "summary_smollm2": {
        "model": "smollm2-135m",
        "prefix": PREFIX,
        "sampler": {"temperature": 0.7},
        "reward": {" tea": 1.0, " coffee": 0.0},
        "rho": True,  # off the policy: the slides read rho
    },
    "summary_smollm2_response": {
        "model": "smollm2-135m",
        "prefix": PREFIX,
        "continuation": " coffee with milk",
    },
    "summary_smollm2_data": {
        "model": "smollm2-135m",
        "prefix": PREFIX,
        "continuation": " coffee with milk",
        "sampler": {"kind": "data"},
        "rho": True,
    },
    "summary_tiny_random": {"model": "tiny-random", "prefix": PREFIX, "continuation": " coffee and"},
}


def fixture_summary(name: str, pool=None) -> tuple[dict, dict]:
    """(summary as the API serves it, manifest entry) for one named request."""
    from backend.fastjson import dumps
    from backend.normalize import normalize
    from backend.registry import model_info, tokenizer_path
    from backend.schemas import ENGINE_VERSION, AnalysisCreate
    from backend.settings import get_settings
    from backend.tokens import codec_for_file
    from workers.jobs import analyze_job, model_pool

    body = REQUESTS[name]
    create = AnalysisCreate.model_validate(body)
    info = model_info(create.model)
    settings = get_settings()
    job = normalize(create, codec_for_file(tokenizer_path(create.model)), info, settings.limits())
    loaded = (pool or model_pool()).get(create.model)
    summary = analyze_job(loaded, job, settings).summary
    summary["timing"]["seconds"] = 0.0
    summary["cost"]["seconds"] = 0.0  # depends on the configured throughput, not on the engine
    served = json.loads(dumps(summary))  # non-finite numbers become null, as in the API's answer
    entry = {"request": body, "digest": info.digest, "engine_version": ENGINE_VERSION, "machine": machine()}
    return served, entry


def machine() -> str:
    """What float32 results depend on beyond the engine: the CPU and torch's kernels for it (the SmolLM2
    fixtures differ by ~2e-5 between an AVX2 and an AVX-512 machine)."""
    import torch

    from workers.throughput import device_key

    return f"{device_key('cpu')}, torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"


def write(name: str, summary: dict) -> str:
    text = json.dumps(summary, indent=1, sort_keys=True) + "\n"
    (FIXTURES / f"{name}.json").write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(REQUESTS), help="regenerate only these")
    args = parser.parse_args()
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.is_file() else {}
    for name in args.only or list(REQUESTS):
        summary, entry = fixture_summary(name)
        entry["sha256"] = write(name, summary)
        manifest[name] = entry
        print(f"{name}: {entry['request']}")
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
