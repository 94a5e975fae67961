"""Shared fixtures: the real models, loaded once per test run.

The models are fetched into the cache when missing (never skipped): the suite must exercise the real
SmolLM2 and the deterministic tiny-random model on every machine.
"""

from __future__ import annotations

import os
import sys

import pytest

# Starlette's test clients call the app as http://testserver, a name no deployment answers to; the
# compute routes' per-client limit is one no test reaches but the test of that limit (its own settings)
os.environ.setdefault("FISHERSCOPE_ALLOWED_HOSTS", "localhost,127.0.0.1,::1,testserver")
os.environ.setdefault("FISHERSCOPE_RATE_LIMIT", "100000/minute")


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests need a CUDA device; without one (CI has none) they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_random():
    """The tiny random Llama (vocab 512, d_model 64), built into the cache if missing."""
    from workers.models.loading import load_model

    return load_model("tiny-random", fetch=True)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in float32, fetched and converted into the cache if missing (~30 s)."""
    from workers.models.loading import load_model

    return load_model("smollm2-135m", fetch=True)


@pytest.fixture
def float64_reference():
    """Float64 through the models' own float32 casts (RMSNorm, softmax), for engine and brute force."""
    from workers.fisher.reference import float64_throughout

    with float64_throughout():
        yield


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave at once with pytest's own status, after every report is written.

    Why: the embedded service's worker threads and torch's thread pools may still be alive when the
    interpreter tears down, and a native library's static destructors then call std::terminate
    (SIGABRT, exit 134) after all tests passed. Nothing is left to do at that point but exit.
    """
    if _EXIT_STATUS in config.stash:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(config.stash[_EXIT_STATUS])


_EXIT_STATUS = pytest.StashKey[int]()
