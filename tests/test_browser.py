"""Browser tests in headless Debian Chromium (Playwright, never a downloaded browser).

Against the real service: `fisherscope serve` in embedded mode (`frontend.devserver.embedded_service`,
model tiny-random) in a subprocess with its own result folder. The test types a prefix, runs, waits for
the figures, toggles centering, steps slides with the arrow keys, opens the share link in a fresh context
(nothing recomputed), checks a bad link's message and that no request leaves 127.0.0.1, and saves a
screenshot of every slide into artifacts/browser/ (not tracked; the committed screenshots of the real
model come from scripts/screenshots.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from frontend.devserver import CHROMIUM, embedded_service, launch_chromium
from tests.requirements import require

SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "browser"
PREFIX = "She drank a cup of"
MODEL = "tiny-random"


@dataclass
class Service:
    """Where the embedded service (API and dashboard on one port) is, and where it writes results."""

    url: str
    results_dir: Path

    def computed(self) -> int:
        """Files in the service's result folder: a new analysis writes one, a cache hit none."""
        return sum(1 for path in self.results_dir.rglob("*") if path.is_file())

    def engine_runs(self) -> int:
        """The API's own count of engine runs (GET /api/v1/stats); cache hits do not add to it."""
        return int(httpx.get(f"{self.url}/api/v1/stats", timeout=10).json()["engine_runs"])


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    require(Path(CHROMIUM).exists(), "Debian chromium (apt-get install chromium)")
    tmp = tmp_path_factory.mktemp("service")
    results = tmp / "results"
    with embedded_service(results, tmp / "exports") as url:
        yield Service(url, results)


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
    import playwright.sync_api as playwright_api  # a declared dev dependency: never skipped

    outside: list[str] = []
    with playwright_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        record_outside_requests(context, outside)
        page = context.new_page()
        page.goto(f"{service.url}/?model={MODEL}&temperature=0.7")  # off-policy: mean shift > 0
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
