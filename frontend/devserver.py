"""The dashboard run locally for a headless browser: the embedded service in a subprocess, and Chromium.

Shared by the browser test (tests/test_browser.py) and the screenshot script (scripts/screenshots.py),
so both start the service, wait for it and open the browser the same way. Nothing in the running
dashboard imports this module.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Playwright

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"  # Debian's; Playwright never downloads a browser here
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class ServiceDidNotStart(RuntimeError):
    """The service never answered /healthz (it exited, or was still loading when the wait ran out)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def embedded_service(
    results_dir: Path,
    exports_dir: Path,
    port: int = 0,
    start_timeout_s: float = 120.0,
    landing_analysis: bool = True,
    extra_env: dict[str, str] | None = None,
) -> Iterator[str]:
    """`fisherscope serve` (embedded mode, no Redis) on 127.0.0.1:port (0: a free one), yielding its URL.

    Results and exports go to the given folders, so a run never touches the user's own; the process is
    terminated on leaving the block, also when the start-up wait fails. `landing_analysis=False`: serve
    does not queue the first page's example at start (its one worker would run nothing else for a
    minute on a CPU); a page that opens the landing still computes it, once, when it asks.
    """
    port = port or free_port()
    env = {
        **os.environ,
        "FISHERSCOPE_RESULTS_DIR": str(results_dir),
        "FISHERSCOPE_EXPORTS_DIR": str(exports_dir),
        "FISHERSCOPE_LANDING_ANALYSIS": "true" if landing_analysis else "false",
        **(extra_env or {}),
    }
    env.pop("REDIS_URL", None)
    env.pop("FISHERSCOPE_REDIS_URL", None)
    code = f"from workers.serve import serve; serve('127.0.0.1', {port})"
    process = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(process, url, start_timeout_s)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def wait_for_health(process: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServiceDidNotStart(f"the embedded service exited with code {process.returncode}")
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServiceDidNotStart(f"the embedded service did not answer {url}/healthz within {timeout_s:.0f} s")


def wait_until_ready(url: str, timeout_s: float = 300.0) -> None:
    """Wait for /readyz: 200 once serve's preload of the default model is done. Until then a job that
    loads a model races the preload in transformers' loader (both fail), so nothing is asked before."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = httpx.get(f"{url}/readyz", timeout=10)
        if answer.status_code == 200:
            return
        if time.monotonic() > deadline:
            raise ServiceDidNotStart(f"{url} was not ready within {timeout_s:.0f} s: {answer.text[:200]}")
        time.sleep(0.5)


def launch_chromium(playwright: Playwright) -> Browser:
    """Headless Debian Chromium with the flags that keep it offline and quiet in a container."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
