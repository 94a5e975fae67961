"""The study page (/studies/) in headless Debian Chromium, against the real embedded service.

One study on tiny-random, typed into the form as a person would (3 prompts with targets, K = 2, L = 3,
a regex reward): the page follows it prompt by prompt to the end, then shows the 6 responses, where the
mask lands, the estimators against the exact F and the paper's statistics, with numbers equal to the
API's own summary. The page's share link, opened in a fresh browser context, shows the same study at
once and runs nothing (the API's engine run count stays put); a bad or unknown study id in a link is a
sentence, never a stack trace. Every context is watched: no console error and no 4xx/5xx answer to the
page's own requests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from frontend.devserver import CHROMIUM, embedded_service, launch_chromium, wait_until_ready
from frontend.studies.form import (
    DEFAULTS,
    parse_densities,
    parse_prompts,
    parse_query,
    request_body,
    study_id_in,
    to_query,
)
from tests.requirements import require

SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "browser"
MODEL = "tiny-random"
# a tab and ' =>' both separate a target; ' five' keeps its leading space
PROMPTS = "She drank a cup of => tea\nThe capital of France is => Paris\nTwo plus three is\t five"
# tiny-random answers with noise: '[aeiou]' lets some responses earn a reward and others not, so the
# policy gradient (and the paper's overlap) is defined
PATTERN = "{target}|[aeiou]"
VIEWPORT = {"width": 1400, "height": 1000}
# whether a page ever showed a progress bar (a study it had to wait for), from its first paint on
SAW_PROGRESS = """
window.sawProgress = false;
new MutationObserver(() => { if (document.querySelector('.parts')) { window.sawProgress = true; } })
    .observe(document, {childList: true, subtree: true});
"""


@dataclass
class Service:
    url: str

    @property
    def api(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.url}/api/v1", timeout=60)

    def engine_runs(self) -> int:
        """The API's own count of engine runs; a study read from the cache does not add to it."""
        return int(self.api.get("/stats").json()["engine_runs"])


@dataclass
class Watch:
    """Console errors and 4xx/5xx answers to a context's own requests."""

    console: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def attach(self, context) -> None:
        context.on("response", self.on_response)
        context.on("page", self.on_page)

    def on_page(self, page) -> None:
        page.on("console", lambda m: self.console.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda error: self.console.append(f"page error: {error}"))

    def on_response(self, response) -> None:
        if response.status >= 400:
            self.failed.append(f"{response.status} {response.request.method} {response.url}")

    def check(self) -> None:
        assert self.console == [], self.console
        assert self.failed == [], self.failed


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    require(Path(CHROMIUM).exists(), "Debian chromium (apt-get install chromium)")
    tmp = tmp_path_factory.mktemp("study-page")
    with embedded_service(tmp / "results", tmp / "exports", landing_analysis=False) as url:
        wait_until_ready(url)
        yield Service(url)


@pytest.fixture
def browser():
    import playwright.sync_api as playwright_api

    with playwright_api.sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        yield browser
        browser.close()


def watched_page(browser):
    watch = Watch()
    context = browser.new_context(viewport=VIEWPORT)
    context.add_init_script(SAW_PROGRESS)
    watch.attach(context)
    return context, context.new_page(), watch


def study_id_of(url: str) -> str:
    return parse_qs(urlparse(url).query)["study"][0]


def run_study(page, service: Service) -> None:
    """Type the study into the form and press Run; the page shows its progress per prompt."""
    page.goto(f"{service.url}/studies/")
    page.wait_for_selector("#run")
    page.click("#model")
    page.get_by_role("option", name=MODEL).click()
    page.fill("#prompts", PROMPTS)
    page.fill("#samples", "2")
    page.fill("#max_tokens", "3")
    page.get_by_label("regex").check()
    page.fill("#pattern", PATTERN)
    page.click("#run")
    page.wait_for_selector(".parts .part", timeout=15_000)  # a bar per prompt while it runs
    assert page.locator(".parts .part").count() == 3


def shows(text: str, value: float, digits: int = 4) -> bool:
    """A number as the page writes it ('1,357', '623.3', '60.1%') equals `value` to its digits."""
    shown = float(text.replace(",", "").rstrip("%")) / (100 if text.endswith("%") else 1)
    half_unit = 0.5 * 10 ** (math.floor(math.log10(abs(value))) - digits + 1) if value else 1e-12
    return abs(shown - value) <= half_unit * (1 + 1e-9)


def check_results(page, summary: dict, url: str, study_id: str) -> None:
    """What a finished study shows, against the API's summary."""
    assert page.locator("#responses-table tbody tr").count() == 6
    assert shows(page.inner_text("#total-fisher"), summary["totals"]["fisher"])
    mc = summary["estimators"]["mc_fisher"]
    assert shows(page.locator("#estimator-table .rel-l2").first.inner_text(), mc["relative_l2_vs_fisher"])
    fisher_cells = page.locator("#responses-table .fisher-total").all_inner_texts()
    assert len(fisher_cells) == 6
    assert all(
        shows(t, r["totals"]["fisher"]) for t, r in zip(fisher_cells, summary["responses"], strict=True)
    )
    shares = summary["masks"]["by_q"]["0.01"]
    assert page.locator("#tensor-table tbody tr").count() == len(shares["tensors"])
    assert page.locator("#layers-figure .bars path").count() >= len(shares["layers"])
    assert page.locator("#kinds-figure .bars path").count() >= 1
    overlap = summary["paper"]["fisher_vs_policy_gradient"]["overlap"]
    assert overlap is not None, summary["paper"]["fisher_vs_policy_gradient"]
    assert shows(page.inner_text("#paper-overlap"), overlap, digits=3)
    ratio = summary["paper"]["model_vs_uniform"]["ratio_model_to_uniform"]
    assert shows(page.inner_text("#paper-ratio"), ratio)
    assert "THIS model (tiny-random)" in page.inner_text("#paper-section")
    assert page.get_attribute("#masks-link", "href") == f"{url}/api/v1/studies/{study_id}/masks"
    assert page.locator(".prompt-cell", has_text="The capital of France is").count() == 3  # 1 + its 2


def check_heatmap(page, service: Service, study_id: str, summary: dict) -> str:
    """The densest tensor's mask is drawn at once; another picked from the list is drawn with the API's
    count in its title. Returns the tensor in view."""
    page.wait_for_selector("#mask-heatmap .heatmaplayer")
    tensors = summary["masks"]["by_q"]["0.01"]["tensors"]
    densest = max(tensors, key=lambda row: row["count"])["name"]
    assert densest in (page.text_content("#mask-heatmap .gtitle") or "")
    chosen = next(row for row in tensors if row["name"].endswith("mlp.down_proj.weight"))
    page.click("#mask-tensor")
    page.get_by_role("option", name=chosen["name"], exact=True).click()
    page.wait_for_selector(f"#mask-heatmap .gtitle >> text={chosen['name']}")
    view = service.api.get(f"/studies/{study_id}/masks/{chosen['name']}", params={"q": 0.01}).json()
    assert view["count"] == chosen["count"]
    assert f"{chosen['count']:,} in the top-1% mask" in (page.text_content("#mask-heatmap .gtitle") or "")
    return chosen["name"]


def check_comparison(page, service: Service, study_id: str) -> str:
    """A second study (another sampler) through the API, pasted as a share link: the page's overlap is
    the API's. Returns the other study's id."""
    body = service.api.get(f"/studies/{study_id}").json()["request"]
    create = {
        "model": MODEL,
        "prompts": [{"prompt": "She drank a cup of", "target": " tea"}],
        "samples": 1,
        "max_tokens": 2,
        "sampler": {"top_k": 3},
        "q": body["q"],
    }
    other = service.api.post("/studies", json=create).json()["id"]
    deadline = time.monotonic() + 120
    while service.api.get(f"/studies/{other}").json()["status"] != "done":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    page.fill("#compare-id", f"{service.url}/studies/?study={other}&q=0.01")
    page.press("#compare-id", "Enter")
    page.wait_for_selector("#compare-table .compare-overlap")
    compared = service.api.get("/studies/compare", params={"a": study_id, "b": other}).json()
    cells = page.locator("#compare-table .compare-overlap").all_inner_texts()
    assert len(cells) == len(compared["q"])
    assert all(shows(t, v, digits=3) for t, v in zip(cells, compared["overlap"], strict=True))
    page.fill("#compare-id", "not an id")
    page.press("#compare-id", "Enter")
    page.wait_for_selector("#compare-section >> text=neither a study id")
    page.fill("#compare-id", other)
    page.press("#compare-id", "Enter")
    page.wait_for_selector("#compare-table .compare-overlap")
    return other


@pytest.mark.slow
def test_study_page_runs_shares_and_refuses_bad_links(service: Service, browser) -> None:
    started = time.monotonic()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    context, page, watch = watched_page(browser)
    run_study(page, service)
    page.wait_for_selector("#total-fisher", timeout=90_000)
    assert page.evaluate("window.sawProgress") is True  # it had to wait for this one
    study_id = study_id_of(page.url)
    study = service.api.get(f"/studies/{study_id}").json()
    assert study["status"] == "done" and [p["target"] for p in study["request"]["prompts"]] == [
        " tea",
        " Paris",
        " five",
    ]
    check_results(page, study["summary"], service.url, study_id)
    page.get_by_role("button", name="parameters").click()  # sort the tensor table by size
    page.wait_for_selector("#tensor-table th >> text=parameters ▼")
    sizes = [
        int(t.replace(",", "")) for t in page.locator("#tensor-table tbody td:nth-child(2)").all_inner_texts()
    ]
    assert sizes == sorted(sizes, reverse=True)
    masks = httpx.get(page.get_attribute("#masks-link", "href") or "", timeout=30)
    assert masks.status_code == 200 and len(masks.content) > 1000
    tensor = check_heatmap(page, service, study_id, study["summary"])
    other = check_comparison(page, service, study_id)
    page.screenshot(path=SCREENSHOTS / "study-tiny-random.png", full_page=True)
    share = page.input_value("#share-link")
    assert parse_qs(urlparse(share).query)["tensor"] == [tensor]
    assert parse_qs(urlparse(share).query)["compare"] == [other]
    watch.check()
    context.close()

    runs = service.engine_runs()
    context, page, watch = watched_page(browser)
    opened = time.monotonic()
    page.goto(share)
    page.wait_for_selector("#total-fisher", timeout=20_000)
    assert time.monotonic() - opened < 20  # a few seconds; the bound leaves room for 2 busy cores
    assert page.evaluate("window.sawProgress") is False  # done from the first answer: never a bar
    assert study_id_of(page.url) == study_id
    assert page.input_value("#prompts") == PROMPTS and page.input_value("#pattern") == PATTERN
    check_results(page, study["summary"], service.url, study_id)
    page.wait_for_selector("#compare-table .compare-overlap")  # the link's comparison, and matrix
    assert tensor in (page.text_content("#mask-heatmap .gtitle") or "")
    assert service.engine_runs() == runs
    watch.check()
    context.close()

    context, page, watch = watched_page(browser)
    page.goto(f"{service.url}/studies/?study=zzz")
    page.wait_for_selector("#message div")
    assert "'zzz' is not a study id" in page.inner_text("#message")
    page.goto(f"{service.url}/studies/?study={'0' * 64}&model={MODEL}")
    page.wait_for_selector("#message div")
    assert "There is no study 000000000000" in page.inner_text("#message")
    assert page.locator("#results").is_hidden()
    assert "Traceback" not in page.content()
    page.goto(f"{service.url}/studies/")  # the API's refusal, and the form's own, say what to fix
    page.wait_for_selector("#run")
    page.fill("#samples", "64")
    page.fill("#max_tokens", "256")
    page.click("#run")
    page.wait_for_selector("#message div")
    assert "the API refused the study" in page.inner_text("#message")
    assert "over the budget" in page.inner_text("#message")
    page.fill("#prompts", "no target here\nThe capital of France is => Paris")
    page.click("#run")
    page.wait_for_selector("#message >> text=line(s) 1 have none")
    watch.check()
    context.close()
    assert service.engine_runs() == runs
    print(f"study page test: {time.monotonic() - started:.0f} s after the service was ready")


def test_prompt_lines_split_at_a_tab_or_an_arrow() -> None:
    prompts, errors = parse_prompts("a => b\n\n  \nc\t d\ne => \nf =>g => h\n => x")
    assert [(p.line, p.prompt, p.target) for p in prompts] == [
        (1, "a", " b"),
        (4, "c", " d"),
        (5, "e", None),
        (6, "f =>g", " h"),
    ]
    assert errors == ["line 7 has a target but no prompt before the separator"]
    assert parse_prompts(" \n")[1] == ["write at least one prompt (one per line)"]


def test_the_form_round_trips_through_the_url() -> None:
    values = {**DEFAULTS, "model": MODEL, "prompts": PROMPTS, "top_k": 5, "pattern": PATTERN, "samples": 3}
    study = "ab" * 32
    other = "cd" * 32
    link, errors = parse_query(to_query(values, study, "0.05", "model.norm.weight", other))
    assert errors == [] and link.values == values and (link.study, link.view_q) == (study, "0.05")
    assert (link.tensor, link.compare) == ("model.norm.weight", other)
    assert study_id_in(f"http://host/studies/?q=0.01&study={other}") == other
    assert study_id_in(f"  {other} ") == other and study_id_in("http://host/studies/?study=zz") is None
    assert to_query(DEFAULTS) == ""


def test_a_bad_link_says_what_is_wrong_and_keeps_the_rest() -> None:
    link, errors = parse_query("?study=zzz&samples=0&sampler=data&top_p=2&seed=x&model=" + MODEL)
    assert link.study is None and link.values == {**DEFAULTS, "model": MODEL}
    assert [e.split(" ")[0] for e in errors] == ["samples", "seed", "sampler", "top_p", "the"]
    assert "'zzz' is not a study id" in errors[-1]


def test_the_form_becomes_the_api_request() -> None:
    values = {**DEFAULTS, "prompts": PROMPTS, "top_k": 40, "pattern": PATTERN, "densities": "5, 0.1%, 1"}
    body, errors = request_body(values)
    assert errors == [] and body is not None
    assert body["prompts"][2] == {"prompt": "Two plus three is", "target": " five"}
    assert body["sampler"] == {
        "kind": "model",
        "temperature": 1.0,
        "top_k": 40,
        "top_p": 1.0,
        "engine": "model",
    }
    assert body["reward"] == {"kind": "regex", "pattern": PATTERN} and body["q"] == [0.001, 0.01, 0.05]
    body, errors = request_body({**values, "prompts": "a => b\nc", "samples": None, "method": "mc:x"})
    assert body is None and len(errors) == 3, errors
    assert "line(s) 2 have none" in errors[-1]
    assert parse_densities("0, 100, x") == (
        [],
        [
            "mask density 0% must be between 0 and 100 (exclusive)",
            "mask density 100% must be between 0 and 100 (exclusive)",
            "mask density 'x' is not a number; write percents, e.g. 0.1, 1, 5",
        ],
    )


def test_numbers_read_back_to_their_digits() -> None:
    assert shows("1,357", 1357.416) and shows("623.3", 623.337) and shows("60.1%", 0.6006, digits=3)
    assert not shows("623.4", 623.337) and not shows("61.1%", 0.6006, digits=3)


def test_long_studies_list_their_first_responses_and_spell_out_control_characters() -> None:
    from backend.study_summary import ResponseRecord
    from frontend.studies.tables import MAX_RESPONSES, responses_table, visible

    response = ResponseRecord(
        prompt_index=0,
        response_index=0,
        seed=0,
        input_ids=[0],
        continuation_ids=[1],
        text="a\nb\x14",
        reward=None,
        totals={"fisher": 1.0, "uncentered": 1.0},
    )
    shown = responses_table([response] * (MAX_RESPONSES + 1), ["prompt"])
    table, note = shown.children
    assert len(table.children[1].children) == MAX_RESPONSES
    assert (
        note.children
        == f"the first {MAX_RESPONSES} of {MAX_RESPONSES + 1} responses; all are in the API's summary"
    )
    assert visible("a\nb\tc\x14\u200b\ufffd") == "a⏎b⇥c\\x14\\u200b\ufffd"


def test_the_study_links_to_its_prompts_in_the_dashboard() -> None:
    from backend.study_schemas import StudyJob
    from backend.vocabulary import Method, Sampler
    from frontend.state import parse_query as parse_dashboard_query
    from frontend.studies.links import dashboard_link

    request = StudyJob(
        model=MODEL,
        weights_digest="sha256:0",
        prompts=[],
        samples=1,
        max_tokens=1,
        seed=0,
        sampler=Sampler(temperature=0.7, top_k=8),
        method=Method(),
        q=[0.01],
    )
    link = dashboard_link(request, "She drank a cup of")
    assert link is not None and link.startswith("/?")
    state, errors = parse_dashboard_query(link[1:])
    assert errors == [] and (state.model, state.prefix, state.temperature, state.top_k) == (
        MODEL,
        "She drank a cup of",
        0.7,
        8,
    )
    assert dashboard_link(request, None) is None
    body, _ = request_body({**DEFAULTS, "name": "  capitals  "})
    assert body is not None and body["name"] == "capitals"
    assert "name" not in (request_body(DEFAULTS)[0] or {})


def test_recent_studies_open_from_the_list_and_link_their_prompts(service: Service, browser) -> None:
    """Studies POSTed over the API show in the page's list with name and status; a click opens one,
    whose prompts link to their analyses in the dashboard (the dashboard's own URL)."""
    from frontend.state import DashboardState
    from frontend.state import to_query as dashboard_query

    body = {"model": MODEL, "prompts": [{"prompt": "The sky is"}], "samples": 1, "max_tokens": 2}
    named = service.api.post("/studies", json={**body, "name": "sky study"}).json()
    other = service.api.post("/studies", json={**body, "prompts": [{"prompt": "Grass is"}]}).json()
    deadline = time.monotonic() + 120
    while any(service.api.get(f"/studies/{s['id']}").json()["status"] != "done" for s in (named, other)):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    context, page, watch = watched_page(browser)
    page.goto(f"{service.url}/studies/")
    page.wait_for_selector(".recent-study >> text=sky study")
    lines = page.locator(".recent-study").all_inner_texts()
    assert lines[0].startswith(other["id"][:12]) and "done" in lines[0]
    assert any(line.startswith("sky study") and "done" in line for line in lines)
    page.click(".recent-study-link >> text=sky study")
    page.wait_for_selector("#total-fisher", timeout=30_000)
    assert study_id_of(page.url) == named["id"]
    link = page.get_attribute("#prompts-table .prompt-link", "href")
    sampler = named["request"]["sampler"]
    expected = DashboardState(
        model=MODEL, prefix="The sky is", top_k=sampler["top_k"], temperature=sampler["temperature"]
    )
    assert link == "/" + dashboard_query(expected)
    page.screenshot(path=SCREENSHOTS / "study-recent-list.png", full_page=True)
    watch.check()
    context.close()


@pytest.mark.slow
def test_the_study_page_compares_a_fine_tuned_checkpoint(tmp_path, monkeypatch, capsys, browser) -> None:
    """A checkpoint trained from the study's model, registered beside it: the page compares the two and
    draws where the run changed the weights beside where the mask lands, with the API's numbers."""
    import shutil

    from backend import registry
    from tests.test_registry import run_cli
    from tests.test_updates_api import _tuned

    require(Path(CHROMIUM).exists(), "Debian chromium (apt-get install chromium)")
    tiny = registry.model_dir(MODEL)
    cache = tmp_path / "cache"
    monkeypatch.setenv(registry.CACHE_ENV, str(cache))
    shutil.copytree(tiny, registry.model_dir(MODEL))
    source = tmp_path / "tiny-src"
    shutil.copytree(tiny, source, ignore=shutil.ignore_patterns(registry.MANIFEST_NAME))
    assert run_cli(capsys, "models", "add", "tiny-tuned", str(_tuned(source, tmp_path / "tuned")))[0] == 0
    extra = {registry.CACHE_ENV: str(cache)}
    with embedded_service(
        tmp_path / "results", tmp_path / "exports", landing_analysis=False, extra_env=extra
    ) as url:
        wait_until_ready(url)
        service = Service(url)
        context, page, watch = watched_page(browser)
        run_study(page, service)
        page.wait_for_selector("#total-fisher", timeout=90_000)
        study_id = study_id_of(page.url)
        page.click("#updates-run")  # nothing chosen yet: the page says what to do
        page.wait_for_selector("#updates-caption >> text=choose the fine-tuned checkpoint first")
        page.click("#updates-after")
        page.get_by_role("option", name="tiny-tuned").click()
        page.click("#updates-run")
        page.wait_for_selector("#updates-caption >> text=visibly in bf16", timeout=60_000)
        body = {"before": MODEL, "after": "tiny-tuned", "study": study_id}
        summary = service.api.post("/updates", json=body).json()["summary"]  # the page's, from the cache
        caption = page.inner_text("#updates-caption")
        assert f"{summary['total']['params']:,} parameters" in caption
        assert "inside the top-1% Fisher mask (chance: 1%)" in caption
        bars = page.evaluate(
            "() => document.querySelector('#updates-kinds .js-plotly-plot').data.map(t => [t.name, t.x])"
        )
        assert [name for name, _ in bars][0] == "the run's updates (bf16)"
        assert sorted(bars[0][1]) == sorted(row["group"] for row in summary["kinds"])
        page.locator("#updates").screenshot(path=str(SCREENSHOTS / "study-updates.png"))
        watch.check()
        context.close()
