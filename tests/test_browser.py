"""Browser tests in headless Debian Chromium (Playwright, never a downloaded browser).

Against the real service: `fisherscope serve` in embedded mode (`frontend.devserver.embedded_service`,
models tiny-random and SmolLM2-135M) in a subprocess with its own result folder. Every page is watched
(`Watch`): no console error, no 4xx/5xx answer to the page's own requests, no request beyond 127.0.0.1,
and no Dash callback body above a fixed size, however long the analysed response (the browser holds
ids, never a summary). The tests type and run a continuation, sample one (32 tokens on tiny-random, 16
on SmolLM2), step every slide, open share links in fresh contexts (nothing recomputed), follow an
off-policy analysis to its rho stage, and compare two samplers side by side against the API's own
compare and against the top-q sets computed here from the API's full arrays. Screenshots of the
slides go to artifacts/browser/ (not tracked; the committed screenshots of the real model come from
scripts/screenshots.py).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import httpx
import numpy as np
import pytest

from backend.vocabulary import LANDING_PREFIX, STATS
from frontend.devserver import CHROMIUM, embedded_service, launch_chromium, wait_until_ready
from frontend.state import DashboardState, parse_query, to_query, to_request
from tests.requirements import require

SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "browser"
PREFIX = "She drank a cup of"
MODEL = "tiny-random"
VIEWPORT = {"width": 1400, "height": 1000}
# A Dash callback posts its inputs and states: ids and view state only. The whole summary used to go
# along (390 KB for a 10-token response, then 413); this bound holds for any length of response.
MAX_CALLBACK_BODY = 8_000


@dataclass
class Service:
    """Where the embedded service (API and dashboard on one port) is, and where it writes results."""

    url: str
    results_dir: Path

    @property
    def api(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.url}/api/v1", timeout=60)

    def computed(self) -> int:
        """Files in the service's result folder: a new analysis writes one, a cache hit none."""
        return sum(1 for path in self.results_dir.rglob("*") if path.is_file())

    def engine_runs(self) -> int:
        """The API's own count of engine runs (GET /api/v1/stats); cache hits do not add to it."""
        return int(self.api.get("/stats").json()["engine_runs"])

    def analysis(self, body: dict[str, Any]) -> dict[str, Any]:
        """The finished analysis of a request the page already ran: a cache hit (200), never a new run."""
        answer = self.api.post("/analyses", json=body)
        assert answer.status_code == 200, answer.text[:300]
        return answer.json()


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    require(Path(CHROMIUM).exists(), "Debian chromium (apt-get install chromium)")
    tmp = tmp_path_factory.mktemp("service")
    results = tmp / "results"
    # the tiny-random tests would queue behind SmolLM2's landing analysis in the one worker; the SmolLM2
    # test opens the landing page, which asks for it then
    with embedded_service(results, tmp / "exports", landing_analysis=False) as url:
        wait_until_ready(url)  # no page asks for a model while serve still preloads the default one
        yield Service(url, results)


@dataclass
class Watch:
    """What a browser context did that it must not: console errors, 4xx/5xx answers to its own
    requests, requests beyond 127.0.0.1; and the largest Dash callback body it posted."""

    console: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    callback_bodies: list[int] = field(default_factory=list)

    def attach(self, context) -> None:
        context.on("request", self.on_request)
        context.on("response", self.on_response)
        context.on("page", self.on_page)

    def on_page(self, page) -> None:
        page.on(
            "console", lambda message: self.console.append(message.text) if message.type == "error" else None
        )
        page.on("pageerror", lambda error: self.console.append(f"page error: {error}"))

    def on_request(self, request) -> None:
        if not request.url.startswith(("http://127.0.0.1", "data:", "blob:")):
            self.outside.append(request.url)
        if "_dash-update-component" in request.url:
            self.callback_bodies.append(len(request.post_data_buffer or b""))

    def on_response(self, response) -> None:
        if response.status >= 400:
            self.failed.append(f"{response.status} {response.request.method} {response.url}")

    def check(self) -> None:
        assert self.console == [], self.console
        assert self.failed == [], self.failed
        assert self.outside == [], self.outside
        assert 0 < max(self.callback_bodies, default=0) <= MAX_CALLBACK_BODY, max(self.callback_bodies)


@pytest.fixture
def browser():
    import playwright.sync_api as playwright_api  # a declared dev dependency: never skipped

    with playwright_api.sync_playwright() as playwright:
        chromium = launch_chromium(playwright)
        yield chromium
        chromium.close()


def open_page(browser, watch: Watch, url: str):
    context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
    watch.attach(context)
    page = context.new_page()
    page.goto(url)
    return page


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


def wait_until_done(page, caption: str = "", timeout_ms: int = 240_000) -> None:
    """The analysis the page waits for is finished and drawn: its stage is done (or cached), the slide
    has its reading, and the continuation's caption (what the analysed response is) contains `caption`."""
    page.wait_for_function(
        """(caption) => (document.querySelector('#progress-stage')?.innerText === 'failed')
            || (['done', 'cached'].includes(document.querySelector('#progress-stage')?.innerText || '')
                && (document.querySelector('#continuation-caption')?.innerText || '').includes(caption)
                && (document.querySelector('#slide-reading')?.innerText || '').trim().length > 20)""",
        arg=caption,
        timeout=timeout_ms,
    )
    assert page.inner_text("#progress-stage") != "failed", page.inner_text("#message")


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
    """The traces (name, type, x, y, z) of a Plotly graph in the page."""
    return page.evaluate(
        f"""() => (document.querySelector('#{graph_id} .js-plotly-plot')?.data || [])
            .map(t => ({{name: t.name || '', type: t.type || 'scatter', x: Array.from(t.x || []),
                         y: Array.from(t.y || []), z: t.z || null}}))"""
    )


def has_points(traces: list[dict[str, Any]]) -> bool:
    """A drawn figure: some trace with points (a message figure has none, only its annotation)."""
    return any(trace["y"] or trace["z"] for trace in traces)


def check_every_slide(page, screenshots: Path | None = None) -> None:
    """Each slide draws a figure from the analysis (not a message) and a reading with its numbers."""
    for number in range(1, 11):
        go_to_slide(page, number)
        page.wait_for_function(
            "() => (document.querySelector('#slide-graph .js-plotly-plot')?.data || []).length > 0",
            timeout=30_000,
        )
        wait_for_reading(page, 30_000)
        assert has_points(plotted(page, "slide-graph")), f"slide {number} drew no figure"
        if screenshots:
            page.wait_for_timeout(300)
            page.locator(".slide").screenshot(path=str(screenshots / f"slide_{number:02d}.png"))


def check_along_the_response(page, service: Service, analysis_id: str, length: int) -> None:
    """Slide 4's bars are the per-position Fisher totals the API reports, one per response token."""
    go_to_slide(page, 4)
    wait_for_reading(page, 30_000)
    bars = next(trace for trace in plotted(page, "slide-graph") if trace["type"] == "bar")
    positions = [service.api.get(f"/analyses/{analysis_id}/positions/{t}").json() for t in range(length)]
    assert bars["y"] == [position["totals"]["fisher"] for position in positions]
    overview = service.api.get(f"/analyses/{analysis_id}/overview").json()
    assert bars["y"] == overview["response"]["fisher_total"]
    assert len(overview["positions"]) == 1 and len(overview["position_index"]) == length


def sampled_request(
    model: str, seed: int, tokens: int, method: str = "exact", **sampler: Any
) -> dict[str, Any]:
    """The POST body the page sends for a response sampled from the prefix with these settings."""
    return {
        "model": model,
        "prefix": PREFIX,
        "continuation_sample": {"seed": seed, "max_tokens": tokens},
        "sampler": {
            "kind": "model",
            "temperature": 1.0,
            "top_k": None,
            "top_p": 1.0,
            "engine": "model",
            **sampler,
        },
        "reward": {},
        "method": method,
    }


def sample(page, seed: int, tokens: int, timeout_ms: int = 240_000) -> None:
    page.fill("#sample_tokens", str(tokens))
    page.fill("#sample_seed", str(seed))
    page.click("#sample")
    wait_until_done(page, f"sampled response, seed {seed}:", timeout_ms)


def response_chip_ids(page) -> list[int]:
    titles = page.eval_on_selector_all("#continuation-chips .chip", "chips => chips.map(c => c.title)")
    return [int(title.removeprefix("id ")) for title in titles]


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


def check_later_positions(page, service: Service, analysis_id: str) -> None:
    """Picking a later position draws that position's next-token view, as the API reports it."""
    page.locator("#explorer-position").click()
    page.get_by_role("option", name=re.compile(r"^3: after \d+ tokens")).click()
    position = service.api.get(f"/analyses/{analysis_id}/positions/2").json()
    page.wait_for_function(
        "(n) => (document.querySelector('#next-token-graph .gtitle')?.textContent || '')"
        ".includes(`after ${n} tokens`)",
        arg=position["context_length"],
        timeout=30_000,
    )
    assert plotted(page, "next-token-graph")[1]["y"] == [token["mu"] for token in position["p"]["top"]]


def check_arrays_download(page) -> None:
    """'Prepare' polls the safetensors route until the file exists, then offers the link."""
    page.click("#arrays-prepare")
    page.wait_for_function(
        "() => (document.querySelector('#arrays-status')?.innerText || '').startsWith('ready')",
        timeout=120_000,
    )
    href = page.get_attribute("#arrays-link", "href")  # the default choice: what a notebook reads first
    assert "/safetensors?" in href and "stats=fisher%2Cmean_shift" in href and "dtype=float16" in href, href
    assert page.locator("#arrays-link").is_visible()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dashboard_in_a_real_browser(service: Service, browser):
    watch = Watch()
    page = open_page(browser, watch, f"{service.url}/?model={MODEL}&temperature=0.7")  # off-policy
    wait_for_restore(page)
    wait_until_done(page)  # no prefix in the link: the landing example runs first
    assert page.input_value("#prefix") == LANDING_PREFIX
    assert "type your own prefix" in page.inner_text("#landing-note")
    page.fill("#prefix", PREFIX)
    page.fill("#continuation", " coffee and")
    page.wait_for_selector("#token-chips .chip")
    assert page.locator("#token-chips .chip").count() >= 4
    page.click("#run")
    # the landing has a continuation too: wait for the link of the view drawn to be the new one
    page.wait_for_function(
        "() => (document.querySelector('#share-link')?.value || '').includes('continuation=+coffee+and')",
        timeout=240_000,
    )
    wait_until_done(page, "analysed continuation:")
    assert page.inner_text("#landing-note") == ""
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
    below = {name: (value, uncentered[name]) for name, value in centered.items() if uncentered[name] < value}
    assert not below, below
    assert any(uncentered[name] > centered[name] for name in centered)
    page.click("#centering label:has-text('centered (Fisher)')")

    check_explorer(page)
    check_arrays_download(page)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    check_every_slide(page, SCREENSHOTS)

    computed_before = service.computed()
    runs_before = service.engine_runs()
    assert runs_before >= 1
    link = page.input_value("#share-link")
    assert "slide=10" in link and "prefix=She+drank" in link
    shared = open_page(browser, watch, link)
    wait_until_done(shared, "analysed continuation:", 30_000)
    assert shared.input_value("#prefix") == PREFIX
    assert shared.input_value("#continuation") == " coffee and"
    assert shared.inner_text("#slide-counter") == "10 / 10"
    assert shared.inner_text("#progress-stage") == "cached"
    assert shared.inner_text("#landing-note") == ""
    assert service.computed() == computed_before
    assert service.engine_runs() == runs_before  # the API's own counter: nothing computed anew
    watch.check()

    shared.goto(f"{service.url}/?prefix=x&temperature=0&slide=12&sample_seed=-3")
    shared.wait_for_selector(".message div")
    message = shared.inner_text(".message")
    assert "temperature must be a number > 0" in message
    assert "slide must be an integer from 1 to 10" in message
    assert "sample_seed must be an integer >= 0" in message


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sampled_response_draws_every_slide(service: Service, browser):
    """32 tokens drawn from tiny-random: the chips are the API's response, every slide draws, slide 4 is
    the API's per-position totals, and no callback body is larger than for a 5-token prefix."""
    watch = Watch()
    page = open_page(browser, watch, f"{service.url}/?model={MODEL}&prefix={PREFIX}")
    wait_until_done(page)
    prefix_bodies = len(watch.callback_bodies)
    page.fill("#continuation", " tea")
    sample(page, seed=5, tokens=32)
    assert page.input_value("#continuation") == ""  # sampling replaces the typed continuation
    query = parse_qs(urlparse(page.url).query)
    assert (query["sample_seed"], query["sample_tokens"]) == (["5"], ["32"])
    runs = service.engine_runs()
    analysis = service.analysis(sampled_request(MODEL, 5, 32))
    drawn = analysis["request"]["continuation_ids"]
    assert 0 < len(drawn) <= 32 and analysis["request"]["continuation_sample"] is None
    assert response_chip_ids(page) == drawn
    check_every_slide(page)
    check_along_the_response(page, service, analysis["id"], len(drawn))
    check_later_positions(page, service, analysis["id"])
    assert service.engine_runs() == runs
    watch.check()
    before, after = watch.callback_bodies[:prefix_bodies], watch.callback_bodies[prefix_bodies:]
    # 32 response tokens post back no more than a 5-token prefix did (give or take the typed seed's digits)
    assert max(after) <= max(before) + 64, (max(before), max(after))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_share_link_with_a_seed_reopens_the_same_response(service: Service, browser):
    watch = Watch()
    page = open_page(browser, watch, f"{service.url}/?model={MODEL}&prefix={PREFIX}&temperature=0.8")
    wait_until_done(page)
    sample(page, seed=11, tokens=8)
    drawn = response_chip_ids(page)
    link = page.input_value("#share-link")
    assert "sample_seed=11" in link and "sample_tokens=8" in link
    runs, computed = service.engine_runs(), service.computed()

    shared = open_page(browser, watch, link)  # a fresh context: nothing shared with the first but the link
    wait_until_done(shared, "sampled response, seed 11:", 60_000)
    assert response_chip_ids(shared) == drawn
    assert shared.inner_text("#progress-stage") == "cached"
    assert shared.input_value("#sample_seed") == "11" and shared.input_value("#continuation") == ""
    assert (service.engine_runs(), service.computed()) == (runs, computed)
    assert (
        service.analysis(sampled_request(MODEL, 11, 8, temperature=0.8))["request"]["continuation_ids"]
        == drawn
    )
    watch.check()


def watch_stages(page) -> None:
    """Record, from now on, each (stage line, slide greyed, slide reading) the page shows."""
    page.evaluate("""() => {
        window.__stages = [];
        const text = (selector) => document.querySelector(selector)?.innerText || '';
        new MutationObserver(() => window.__stages.push([
            text('#progress-stage'),
            document.querySelector('#slide-panel').classList.contains('stale'),
            text('#slide-reading'),
        ])).observe(document.body, {attributes: true, childList: true, subtree: true, characterData: true});
    }""")


def rho_bars(page) -> dict[str, Any]:
    """Slide 3's rho bars, once they have a value for every kind."""
    page.wait_for_function(
        "() => (document.querySelector('#slide-graph .js-plotly-plot')?.data || [])"
        ".some(t => t.name === 'rho' && t.y.length > 0 && Array.from(t.y).every(v => v !== null))",
        timeout=60_000,
    )
    return next(trace for trace in plotted(page, "slide-graph") if trace["name"] == "rho")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_off_policy_run_draws_rho_from_its_second_stage(service: Service, browser):
    """top-k 7 on tiny-random: the first answer comes without rho, and slide 3 says rho comes second;
    the page asks for the rho stage, keeps the first drawn (not greyed) while it computes, then draws
    the analysis with rho: two engine runs, and slide 3's rho bars are that analysis's."""
    watch = Watch()
    page = open_page(browser, watch, f"{service.url}/?model={MODEL}&prefix={PREFIX}&slide=3")
    wait_until_done(page)
    rho_bars(page)  # on the policy rho comes with the analysis
    runs = service.engine_runs()
    watch_stages(page)
    page.fill("#top_k", "7")
    page.click("#run")
    page.wait_for_function(
        "() => (document.querySelector('#share-link')?.value || '').includes('top_k=7')", timeout=120_000
    )
    wait_until_done(page)
    bars = rho_bars(page)
    seen = page.evaluate("() => window.__stages")
    during = [(stale, reading) for stage, stale, reading in seen if stage.startswith("rho: ")]
    assert any(not stale for stale, _ in during), seen  # the first analysis, drawn as it is
    assert any("computed as a second stage" in reading for _, reading in during), seen
    assert "stale" not in page.get_attribute("#slide-panel", "class")
    assert "second stage" not in page.inner_text("#slide-reading")
    assert service.engine_runs() == runs + 2  # the first answer, then its rho stage

    first = service.analysis(to_request(parse_query(f"model={MODEL}&prefix={PREFIX}&top_k=7")[0]))
    assert first["result"]["rho_available"] is False
    answer = service.api.post(f"/analyses/{first['id']}/rho")
    assert answer.status_code == 200 and answer.json()["id"] != first["id"]  # computed, for the page
    kinds = answer.json()["result"]["kinds"]
    assert bars["x"] == [kind["kind"] for kind in kinds]
    assert bars["y"] == pytest.approx([kind["totals"]["rho_mean"] for kind in kinds])
    assert service.engine_runs() == runs + 2
    watch.check()


def top_q_sets(arrays: dict[str, np.ndarray], names: list[str], fractions: list[float]) -> list[set[int]]:
    """The global top-q coordinates of the Fisher, computed here from the full arrays: ceil(q P) of them,
    the largest first, ties by coordinate index (tensors in the summary's order, each flattened)."""
    values = np.concatenate(
        [np.clip(arrays[f"fisher/{name}"].astype(np.float64).ravel(), 0, None) for name in names]
    )
    order = np.argsort(-values, kind="stable")
    return [set(order[: max(1, math.ceil(q * values.size))].tolist()) for q in fractions]


def full_arrays(service: Service, analysis_id: str) -> dict[str, np.ndarray]:
    """Every per-parameter array an analysis has (rho off the policy only where asked for), from the
    API's safetensors route (202 until written)."""
    from safetensors.numpy import load

    has_rho = service.api.get(f"/analyses/{analysis_id}/overview").json()["rho_available"]
    stats = [stat for stat in STATS if has_rho or stat != "rho"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        everything = {"stats": ",".join(stats), "dtype": "float32"}  # as computed: ties decide top-q sets
        answer = service.api.get(f"/analyses/{analysis_id}/safetensors", params=everything)
        if answer.status_code == 200:
            return load(answer.content)
        assert answer.status_code == 202, answer.text[:300]
        time.sleep(0.5)
    raise AssertionError(f"the arrays of {analysis_id} were not written within 300 s")


def overlap_in_page(page) -> list[float]:
    return next(t for t in plotted(page, "compare-sets-graph") if t["name"].startswith("overlap"))["y"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compare_two_samplers_side_by_side(service: Service, browser, tmp_path):
    """Temperature 1 against 0.7 on tiny-random: the overlap shown is the API's compare, and equals the
    overlap of the top-q sets computed here from both analyses' full arrays; the link reopens it all."""
    watch = Watch()
    page = open_page(browser, watch, f"{service.url}/?model={MODEL}&prefix={PREFIX}")
    wait_until_done(page)
    assert page.get_attribute("#b_temperature", "placeholder") == "as A (1)"
    page.fill("#b_temperature", "0.7")
    page.click("#compare-run")
    page.wait_for_function(
        "() => (document.querySelector('#compare-sets-graph .js-plotly-plot')?.data || []).length >= 4",
        timeout=120_000,
    )
    # B is off the policy and compare reads no rho: B settles with its first answer
    page.wait_for_function(
        "() => ['B: done', 'B: cached'].includes(document.querySelector('#b-status')?.innerText || '')",
        timeout=120_000,
    )
    query = parse_qs(urlparse(page.url).query)
    assert query["b_temperature"] == ["0.7"]
    b_id = query["compare"][0]
    a_id = service.analysis({"model": MODEL, "prefix": PREFIX})["id"]
    compare = service.api.get("/compare", params={"a": a_id, "b": b_id}).json()
    assert overlap_in_page(page) == compare["sets"]["overlap"]
    reading = page.inner_text("#compare-reading")
    assert reading.startswith("A: temperature 1 against B: temperature 0.7.")
    assert page.locator("#compare-sets-table tr").count() == len(compare["sets"]["q"]) + 1
    scatter = {t["name"]: t for t in plotted(page, "compare-tensors-graph")}
    assert "y = x" in scatter
    page.wait_for_function(
        "() => (document.querySelector('#compare-heatmap-graph .js-plotly-plot')?.data || [])"
        ".some(t => t.type === 'heatmap')",
        timeout=60_000,
    )

    names = [t["name"] for t in service.api.get(f"/analyses/{a_id}/overview").json()["tensors"]]
    sets_a = top_q_sets(full_arrays(service, a_id), names, compare["sets"]["q"])
    sets_b = top_q_sets(full_arrays(service, b_id), names, compare["sets"]["q"])
    assert [len(a & b) / len(a) for a, b in zip(sets_a, sets_b, strict=True)] == compare["sets"]["overlap"]
    assert [len(a & b) / len(a | b) for a, b in zip(sets_a, sets_b, strict=True)] == compare["sets"][
        "jaccard"
    ]

    with page.expect_download() as download:
        page.click("#compare-csv-button")
    text = Path(download.value.path()).read_text()
    set_rows = [line.split(",") for line in text.split("\n\n")[1].splitlines() if not line.startswith("#")][
        1:
    ]
    assert [float(row[1]) for row in set_rows] == compare["sets"]["overlap"]
    assert text.count("\n") > len(compare["tensors"])

    runs = service.engine_runs()
    link = page.input_value("#share-link")
    shared = open_page(browser, watch, link)
    shared.wait_for_function(
        "() => (document.querySelector('#compare-sets-graph .js-plotly-plot')?.data || []).length >= 4",
        timeout=60_000,
    )
    assert overlap_in_page(shared) == compare["sets"]["overlap"]
    assert shared.input_value("#b_temperature") == "0.7"
    assert service.engine_runs() == runs
    watch.check()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sampled_response_on_smollm2(service: Service, browser):
    """A response of the Sample button's 8 tokens drawn from SmolLM2-135M, on every slide.

    The link asks for the model's own distribution (no reward, T 1, no top-k: the landing's off-policy
    sampler would add the 576 directions of the Fisher under p at every position) and `truncated:0.02`,
    the top 2% of each position's directions (12 of 576): the exact method back-propagates all 576 at
    each position, minutes of this CPU, where every figure, and the equality of slide 4 with the API,
    reads the same either way. The landing example itself is the landing test's.
    """
    watch = Watch()
    state = DashboardState(prefix=PREFIX, method="truncated:0.02")
    page = open_page(browser, watch, f"{service.url}/{to_query(state)}")
    wait_for_restore(page)
    wait_until_done(page, timeout_ms=300_000)
    assert "model=smollm2-135m" in page.url and "method=truncated" in page.url
    sample(page, seed=0, tokens=8, timeout_ms=600_000)
    analysis = service.analysis(sampled_request("smollm2-135m", 0, 8, method="truncated:0.02"))
    drawn = analysis["request"]["continuation_ids"]
    assert 0 < len(drawn) <= 8 and response_chip_ids(page) == drawn
    check_every_slide(page)
    check_along_the_response(page, service, analysis["id"], len(drawn))
    watch.check()


def centering_disabled(page) -> list[bool]:
    """Whether each option of the centering toggle is disabled, in order."""
    return page.evaluate(
        "() => Array.from(document.querySelectorAll('#centering input')).map(i => i.disabled)"
    )


def check_the_toggle_follows_the_slide(page) -> None:
    """Disabled, with the reason as a tooltip, where the slide does not draw its statistic; after a click
    on it the arrow keys still step the slides (a focused radio would take them for itself)."""
    go_to_slide(page, 2)
    page.wait_for_function(
        "() => Array.from(document.querySelectorAll('#centering input')).every(i => i.disabled)"
    )
    titles = page.evaluate(
        "() => Array.from(document.querySelectorAll('#centering [title]')).map(e => e.title)"
    )
    assert titles and all("does not change with this" in title for title in titles), titles
    go_to_slide(page, 3)
    page.wait_for_function(
        "() => Array.from(document.querySelectorAll('#centering input')).every(i => !i.disabled)"
    )
    page.click("#centering label:has-text('uncentered')")
    page.wait_for_function(
        "() => document.querySelector('#slide-reading').innerText.includes('Shown: uncentered')"
    )
    page.keyboard.press("ArrowRight")
    page.wait_for_function("() => document.querySelector('#slide-counter').innerText.startsWith('4 /')")
    assert page.is_checked("#centering input[value='off']")  # the arrow stepped, it did not re-select
    page.click("#centering label:has-text('centered (Fisher)')")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_landing_page_teaches_on_every_slide(tmp_path, browser):
    """A fresh `serve` computes the essays' example on SmolLM2 at start; the first page reads it from the
    cache and every slide draws it: a figure with points and a reading with numbers, no placeholder."""
    require(Path(CHROMIUM).exists(), "Debian chromium (apt-get install chromium)")
    with embedded_service(tmp_path / "results", tmp_path / "exports", landing_analysis=True) as url:
        wait_until_ready(url)
        watch = Watch()
        page = open_page(browser, watch, f"{url}/")
        wait_for_restore(page)
        wait_until_done(page, "analysed continuation: 3 tokens", timeout_ms=600_000)  # a busy CPU
        assert page.input_value("#prefix") == LANDING_PREFIX
        assert "type your own prefix" in page.inner_text("#landing-note")
        # serve's: the example and its rho stage (off the policy), none for the page
        assert httpx.get(f"{url}/api/v1/stats").json()["engine_runs"] == 2
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        for number in range(1, 11):
            go_to_slide(page, number)
            wait_for_reading(page, 30_000)
            assert has_points(plotted(page, "slide-graph")), f"slide {number} drew no figure"
            reading = page.inner_text("#slide-reading")
            assert re.search(r"\d(\.\d|%)", reading), (number, reading)  # quotes its numbers
            assert "continuation" not in reading and "no shift" not in reading, (number, reading)
            page.locator(".slide").screenshot(path=str(SCREENSHOTS / f"landing_{number:02d}.png"))
        assert "√((1−p)/p)" in page.inner_text("#slide-reading")
        go_to_slide(page, 1)
        check_the_toggle_follows_the_slide(page)
        check_a_reward_change_reuses_the_fisher(page, url)
        watch.check()


def check_a_reward_change_reuses_the_fisher(page, url: str) -> None:
    """Another reward on the landing example is answered from its Fisher (one direction per position),
    not by another engine run, and so is its rho stage (from the example's own), and the page draws the
    new reward's numbers."""
    assert page.input_value("#reward") == " tea=1; coffee=0"
    page.fill("#reward", " tea=1; coffee=0.5")
    page.click("#run")
    page.wait_for_function(
        "() => (document.querySelector('#share-link')?.value || '').includes('0.5')", timeout=30_000
    )
    wait_until_done(page, "analysed continuation: 3 tokens", timeout_ms=120_000)
    stats = httpx.get(f"{url}/api/v1/stats").json()
    assert stats == {"engine_runs": 2, "reward_reuses": 2}, stats
    go_to_slide(page, 2)
    wait_for_reading(page, 30_000)
    assert "coffee" in page.inner_text("#slide-reading")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_running_response_draws_its_partial_result_and_is_cancelled(service: Service, browser):
    """8 tokens drawn from SmolLM2 at T 1, exact (about a minute and a half here): its first partial
    result draws slides 4, 8 and 9 with every position and says what is still partial, the stage says
    the expected time, and the cancel button stops the run."""
    watch = Watch()
    page = open_page(browser, watch, f"{service.url}/?model=smollm2-135m&prefix={PREFIX}&slide=4")
    wait_until_done(page, timeout_ms=300_000)
    page.fill("#temperature", "1")
    page.fill("#top_k", "")
    page.fill("#reward", "")
    page.fill("#method", "exact")
    page.fill("#sample_tokens", "8")
    page.fill("#sample_seed", "11")
    page.click("#sample")
    page.wait_for_function(
        "() => (document.querySelector('#slide-reading')?.innerText || '').startsWith('Still computing')",
        timeout=300_000,
    )
    assert "in all" in page.inner_text("#progress-stage")  # the estimate, beside the stage
    assert page.is_visible("#cancel")
    bars = next(trace for trace in plotted(page, "slide-graph") if trace["type"] == "bar")
    drawn = len(response_chip_ids(page))
    assert len(bars["y"]) == drawn > 1  # every position, from the first partial on
    opacity = page.evaluate(
        "() => document.querySelector('#slide-graph .js-plotly-plot').data"
        ".find(t => t.type === 'bar').marker.opacity"
    )
    assert isinstance(opacity, list) and min(opacity) < 1  # the positions still partial are pale
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator(".slide").screenshot(path=str(SCREENSHOTS / "partial_response_slide_04.png"))
    for number in (8, 9):
        go_to_slide(page, number)
        page.wait_for_function(
            "() => (document.querySelector('#slide-graph .js-plotly-plot')?.data || []).length > 0"
        )
        assert has_points(plotted(page, "slide-graph")), f"slide {number} drew no figure"
        assert page.inner_text("#slide-reading").startswith("Still computing")
        page.locator(".slide").screenshot(path=str(SCREENSHOTS / f"partial_response_slide_{number:02d}.png"))
    page.click("#cancel")
    page.wait_for_function(
        "() => (document.querySelector('#message')?.innerText || '').includes('was cancelled')",
        timeout=120_000,
    )
    assert page.inner_text("#progress-stage") == "failed" and not page.is_visible("#cancel")
    page.wait_for_function(  # what stays drawn is named: the cancelled run's last partial result
        "() => document.querySelector('#shown-banner').innerText.includes('its last partial result')"
    )
    page.locator("body").screenshot(path=str(SCREENSHOTS / "cancelled_response.png"))
    watch.check()
