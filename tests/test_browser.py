"""Browser tests in headless Debian Chromium (Playwright, never a downloaded browser).

Against the real service (embedded `backend.embedded`, model tiny-random) when the engine is importable;
otherwise against a stand-in API that serves the fixture summary with the contract's shapes. Both type a
prefix, run, wait for the figures, toggle centering, step slides with the arrow keys, open the share link
in a fresh context (nothing recomputed), check a bad link's message and that no request leaves
127.0.0.1, and save a screenshot of every slide into artifacts/browser/ (not tracked; the committed
screenshots of the real model come from scripts/screenshots.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
from werkzeug.serving import make_server

from frontend.app import create_dash_app
from frontend.devserver import CHROMIUM, embedded_service, free_port, launch_chromium

FIXTURE = Path(__file__).parent / "fixtures" / "summary_smollm2.json"
SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "browser"


class ServerThread:
    """Serve an HTTP server (anything with serve_forever and shutdown) in a daemon thread for the
    length of a with-block."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()


class FixtureApi(ServerThread):
    """An HTTP API with the contract's shapes: the first POST of a request computes (two polls of
    'running'), later identical POSTs answer 200 from its cache; `computations` counts the work."""

    def __init__(self, port: int) -> None:
        self.summary = json.loads(FIXTURE.read_text())
        self.computations = 0
        self.polls: dict[str, int] = {}
        self.done: set[str] = set()
        self.exports: dict[str, int] = {}
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer = api.post(body)
                self.answer(status, answer)

            def do_GET(self) -> None:  # noqa: N802
                status, answer = api.get(self.path)
                self.answer(status, answer)

        super().__init__(ThreadingHTTPServer(("127.0.0.1", port), Handler))

    def public(self, analysis_id: str, status: str, progress: float) -> dict[str, Any]:
        return {
            "id": analysis_id,
            "status": status,
            "progress": progress,
            "stage": "directions",
            "result": self.summary if status == "done" else None,
        }

    def post(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not body.get("prefix"):
            return 422, {"detail": "prefix: must not be empty"}
        analysis_id = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        if analysis_id in self.done:
            return 200, self.public(analysis_id, "done", 1.0)
        if analysis_id not in self.polls:
            self.computations += 1
            self.polls[analysis_id] = 0
        return 202, self.public(analysis_id, "queued", 0.0)

    def get(self, path: str) -> tuple[int, Any]:
        if path.startswith("/api/v1/stats"):
            return 200, {"engine_runs": self.computations}
        if path.startswith("/api/v1/models"):
            return 200, [{"id": "smollm2-135m", "available": True}, {"id": "tiny-random", "available": True}]
        if path.startswith("/api/v1/tokenize"):
            from urllib.parse import parse_qs, urlparse

            text = parse_qs(urlparse(path).query).get("text", [""])[0]
            pieces = re.findall(r"\s?\S+", text)
            return 200, {"tokens": [{"id": i, "text": piece} for i, piece in enumerate(pieces)]}
        match = re.match(r"^/api/v1/analyses/([0-9a-f]{64})(/tensors/[^?]+|/safetensors)?", path)
        if not match or match.group(1) not in self.polls:
            return 404, {"detail": "unknown analysis"}
        analysis_id = match.group(1)
        if match.group(2) == "/safetensors":  # written by the second ask; served as JSON here
            self.exports[analysis_id] = self.exports.get(analysis_id, 0) + 1
            if self.exports[analysis_id] >= 2:
                return 200, {"safetensors": "stand-in"}
            return 202, self.public(analysis_id, "done", 1.0)
        if match.group(2):
            view = {
                "shape": [2, 2],
                "row_edges": [0, 288, 576],
                "col_edges": [0, 288, 576],
                "values": [[1.0, 2.0], [3.0, 4.0]],
            }
            return 200, {"tensor": match.group(2).split("/")[-1], "stat": "fisher", "view": view}
        self.polls[analysis_id] += 1
        if self.polls[analysis_id] >= 3:
            self.done.add(analysis_id)
            return 200, self.public(analysis_id, "done", 1.0)
        return 200, self.public(analysis_id, "running", 0.4 * self.polls[analysis_id])


PREFIX = "She drank a cup of"


def engine_available() -> bool:
    try:
        return importlib.util.find_spec("workers.engine") is not None
    except ImportError:
        return False


@dataclass
class Service:
    """Where the dashboard is and how to count the analyses the API computed."""

    url: str
    model: str
    computed: Callable[[], int]
    api_url: str

    def engine_runs(self) -> int:
        """The API's own count of engine runs (GET /api/v1/stats); cache hits do not add to it."""
        return int(httpx.get(f"{self.api_url}/api/v1/stats", timeout=10).json()["engine_runs"])


@contextmanager
def real_service(tmp: Path) -> Iterator[Service]:
    """`fisherscope serve` in embedded mode in a subprocess, with its own result folder."""
    results = tmp / "results"
    with embedded_service(results, tmp / "exports") as url:
        yield Service(url, "tiny-random", lambda: sum(1 for p in results.rglob("*") if p.is_file()), url)


@contextmanager
def fixture_service() -> Iterator[Service]:
    api_port, dash_port = free_port(), free_port()
    with FixtureApi(api_port) as api:
        app = create_dash_app(f"http://127.0.0.1:{api_port}")
        with ServerThread(make_server("127.0.0.1", dash_port, app.server, threaded=True)):
            yield Service(
                f"http://127.0.0.1:{dash_port}",
                "smollm2-135m",
                lambda: api.computations,
                f"http://127.0.0.1:{api_port}",
            )


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed (apt-get install chromium)")
    if engine_available():
        with real_service(tmp_path_factory.mktemp("service")) as running:
            yield running
    else:
        with fixture_service() as running:
            yield running


def slide_values(page) -> dict[str, float]:
    """tensor name -> plotted value, read from the slide's Plotly graph in the page."""
    return page.evaluate("""() => {
        const graph = document.querySelector('#slide-graph .js-plotly-plot');
        const out = {};
        for (const trace of graph.data) {
            if (!trace.customdata) continue;
            trace.customdata.forEach((name, i) => { out[name] = trace.y[i]; });
        }
        return out;
    }""")


def wait_for_reading(page, timeout_ms: int = 240_000) -> None:
    page.wait_for_function(
        "() => (document.querySelector('#slide-reading')?.innerText || '').trim().length > 20",
        timeout=timeout_ms,
    )


def wait_for_restore(page) -> None:
    """Wait until the URL has been read into the controls (the share link is written after that)."""
    page.wait_for_function(
        "() => (document.querySelector('#share-link')?.value || '').includes('model=')", timeout=60_000
    )


def go_to_slide(page, number: int) -> None:
    """Step with the arrow keys, one key at a time: each step waits for the counter and the URL."""
    page.click("h2#slide-title")
    current = int(page.inner_text("#slide-counter").split("/")[0])
    step = 1 if number > current else -1
    for target in range(current + step, number + step, step):
        page.keyboard.press("ArrowRight" if step > 0 else "ArrowLeft")
        page.wait_for_function(
            f"() => document.querySelector('#slide-counter').innerText.startsWith('{target} /')"
            f" && window.location.search.includes('slide={target}')"
        )


def plotted(page, graph_id: str) -> list[dict[str, Any]]:
    """The traces (name, x, y) of a Plotly graph in the page."""
    return page.evaluate(
        f"""() => (document.querySelector('#{graph_id} .js-plotly-plot')?.data || [])
            .map(t => ({{name: t.name || '', x: Array.from(t.x || []), y: Array.from(t.y || [])}}))"""
    )


def check_explorer(page) -> None:
    """Every explorer view is drawn; clicking a layer bar opens that layer's matrices in the heatmap."""
    page.wait_for_function("() => document.querySelector('#layer-graph .trace.bars .point path')")
    next_token = plotted(page, "next-token-graph")
    assert [trace["name"] for trace in next_token] == ["p (model)", "μ (sampler)"]
    labels = next_token[0]["x"]
    assert len(labels) == len(set(labels)), labels  # colliding token texts get '#id'
    assert any("centered" in trace["name"] for trace in plotted(page, "spectrum-graph"))
    layers = plotted(page, "layer-graph")[0]
    assert len(plotted(page, "kind-graph")[0]["x"]) >= 3
    assert len(plotted(page, "response-graph")) == 4  # totals, running sum, p(y_t), chi^2
    assert page.locator("#top-coordinates tr").count() > 2

    tallest = max(range(len(layers["y"])), key=lambda i: layers["y"][i])
    page.locator("#layer-graph").scroll_into_view_if_needed()
    bar = page.locator("#layer-graph .trace.bars .point path").nth(tallest).bounding_box()
    page.mouse.click(bar["x"] + bar["width"] / 2, bar["y"] + bar["height"] - 2)
    layer = layers["x"][tallest]
    page.wait_for_function(
        f"() => (document.querySelector('#heatmap-scope')?.innerText || '').startsWith('layer {layer}:')",
        timeout=30_000,
    )
    page.wait_for_function(
        "() => (document.querySelector('#heatmap-graph .js-plotly-plot')?.data || [])"
        ".some(t => t.type === 'heatmap')",
        timeout=60_000,
    )


def check_arrays_download(page) -> None:
    """'Prepare' polls the safetensors route until the file exists, then offers the link."""
    page.click("#arrays-prepare")
    page.wait_for_function(
        "() => (document.querySelector('#arrays-status')?.innerText || '').startsWith('ready')",
        timeout=120_000,
    )
    assert page.get_attribute("#arrays-link", "href").endswith("/safetensors")
    assert page.locator("#arrays-link").is_visible()


def record_outside_requests(context, outside: list[str]) -> None:
    """Append to `outside` every request the browser context sends beyond 127.0.0.1 (data: and blob:
    URLs stay in the page): the dashboard must load nothing from the internet."""
    context.on(
        "request",
        lambda request: (
            outside.append(request.url)
            if not request.url.startswith(("http://127.0.0.1", "data:", "blob:"))
            else None
        ),
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dashboard_in_a_real_browser(service: Service):
    playwright_api = pytest.importorskip("playwright.sync_api")
    outside: list[str] = []
    with playwright_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        record_outside_requests(context, outside)
        page = context.new_page()
        page.goto(f"{service.url}/?model={service.model}&temperature=0.7")  # off-policy: mean shift > 0
        wait_for_restore(page)
        page.fill("#prefix", PREFIX)
        page.fill("#continuation", " coffee and")
        page.wait_for_selector("#token-chips .chip")
        assert page.locator("#token-chips .chip").count() >= 4
        page.click("#run")
        wait_for_reading(page)
        assert page.inner_text("#slide-counter") == "1 / 10"
        page.wait_for_function(
            "() => document.querySelector('#slide-formula').innerHTML.includes('mjx-container')",
            timeout=60_000,
        )

        go_to_slide(page, 3)
        centered = slide_values(page)
        assert centered
        page.click("#centering label:has-text('uncentered')")
        page.wait_for_function(
            "() => document.querySelector('#slide-reading').innerText.includes('Shown: uncentered')"
        )
        uncentered = slide_values(page)
        assert set(uncentered) == set(centered)
        assert all(uncentered[name] >= centered[name] for name in centered)
        assert any(uncentered[name] > centered[name] for name in centered)
        page.click("#centering label:has-text('centered (Fisher)')")

        check_explorer(page)
        check_arrays_download(page)

        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        for number in range(1, 11):
            go_to_slide(page, number)
            wait_for_reading(page, 30_000)
            page.wait_for_timeout(400)
            page.locator(".slide").screenshot(path=str(SCREENSHOTS / f"slide_{number:02d}.png"))

        computed_before = service.computed()
        runs_before = service.engine_runs()
        assert runs_before >= 1
        link = page.input_value("#share-link")
        assert "slide=10" in link and "prefix=She+drank" in link
        fresh = browser.new_context(viewport={"width": 1400, "height": 1000})
        record_outside_requests(fresh, outside)
        shared = fresh.new_page()
        shared.goto(link)
        wait_for_reading(shared, 30_000)
        assert shared.input_value("#prefix") == PREFIX
        assert shared.input_value("#continuation") == " coffee and"
        assert shared.inner_text("#slide-counter") == "10 / 10"
        assert shared.inner_text("#progress-stage") == "cached"
        assert service.computed() == computed_before
        assert service.engine_runs() == runs_before  # the API's own counter: nothing computed anew

        shared.goto(f"{service.url}/?prefix=x&temperature=0&slide=12")
        shared.wait_for_selector(".message div")
        message = shared.inner_text(".message")
        assert "temperature must be a number > 0" in message
        assert "slide must be an integer from 1 to 10" in message
        browser.close()
    assert outside == []
