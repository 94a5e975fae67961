"""The summaries the dashboard tests read are the engine's own, and current.

tests/fixtures/*.json are written by scripts/make_fixtures.py through the worker's path. Here: the
manifest matches the files, this engine version and the models' digests; the tiny-random fixture is
recomputed and must equal the file; the SmolLM2 prefix fixture is recomputed (slow) and must equal it
to float32 rounding. A changed engine that is not followed by a regeneration fails here.
"""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from backend.registry import model_info
from backend.schemas import ENGINE_VERSION
from scripts.make_fixtures import FIXTURES, MANIFEST, REQUESTS, fixture_summary


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads(MANIFEST.read_text())


def test_every_fixture_is_listed_with_this_engine_and_the_current_weights(manifest, tiny_random, smollm2):
    assert set(manifest) == set(REQUESTS) == {p.stem for p in FIXTURES.glob("summary_*.json")}
    for name, entry in manifest.items():
        assert entry["request"] == REQUESTS[name]
        assert entry["engine_version"] == ENGINE_VERSION, f"{name}: run scripts/make_fixtures.py"
        assert entry["digest"] == model_info(entry["request"]["model"]).digest
        text = (FIXTURES / f"{name}.json").read_text()
        assert hashlib.sha256(text.encode()).hexdigest() == entry["sha256"], f"{name} was edited by hand"


# SmolLM2's float32 sums on another CPU's kernels: up to 6e-5 apart (the mean shift's small squares)
# between two AVX-512 CPUs of different vendors; a new machine changes no fixture, this absorbs it
CROSS_CPU_REL_TOL = 2e-4


def assert_same_summary(got, want, path: str = "summary", rel_tol: float = 2e-5) -> None:
    """Equal structure and text; numbers equal to float32 rounding (the engine's own arithmetic)."""
    if isinstance(want, dict):
        assert set(got) == set(want), f"{path}: keys differ"
        for key in want:
            assert_same_summary(got[key], want[key], f"{path}.{key}", rel_tol)
    elif isinstance(want, list):
        assert len(got) == len(want), f"{path}: lengths differ"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_summary(a, b, f"{path}[{i}]", rel_tol)
    elif isinstance(want, float) and not isinstance(got, bool):
        assert math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-9), f"{path}: {got} != {want}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def test_the_tiny_random_fixture_is_what_the_engine_computes_now(tiny_random):
    summary, _ = fixture_summary("summary_tiny_random")
    assert_same_summary(summary, json.loads((FIXTURES / "summary_tiny_random.json").read_text()))


@pytest.mark.slow
def test_the_smollm2_prefix_fixture_is_what_the_engine_computes_now(smollm2, manifest):
    summary, entry = fixture_summary("summary_smollm2")
    written_on = manifest["summary_smollm2"].get("machine")
    try:
        want = json.loads((FIXTURES / "summary_smollm2.json").read_text())
        assert_same_summary(summary, want, rel_tol=CROSS_CPU_REL_TOL)
    except AssertionError as error:
        raise AssertionError(
            f"{error}\nWritten on {written_on}, computed on {entry['machine']}: further apart than CPUs "
            "differ, so the engine's numbers changed (a deliberate change reruns scripts/make_fixtures.py "
            "in the same commit)"
        ) from error
