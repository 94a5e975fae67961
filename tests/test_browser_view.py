"""The view never lies about what it shows, and reads on a phone: browser tests on tiny-random.

The harness (the embedded service, Chromium, the page watch) is tests/test_browser.py's. The page
names the analysis on screen whenever the controls describe another one, greys it while a newer one
computes or after a run failed, and its share link names what is drawn; at 390 px nothing is wider
than the screen. Screenshots at 1400x1000 and 390x844 go to artifacts/browser/.
"""

# ruff: noqa: F811  (the harness's fixtures are imported by name and taken as test arguments)
from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import pytest

from tests.test_browser import (  # noqa: F401  (service and browser are fixtures)
    MODEL,
    PREFIX,
    SCREENSHOTS,
    Watch,
    browser,
    open_page,
    service,
    wait_until_done,
)

PHONE = {"width": 390, "height": 844}
TOO_LONG = "word " * 300  # over the API's prefix limit: the run is refused


def link_of(page) -> dict[str, list[str]]:
    return parse_qs(urlparse(page.input_value("#share-link")).query)


def banner(page) -> str:
    return page.inner_text("#shown-banner")


def wait_for_banner(page, present: bool) -> None:
    page.wait_for_function(
        "(present) => ((document.querySelector('#shown-banner')?.innerText || '').trim().length > 0)"
        " === present",
        arg=present,
        timeout=30_000,
    )


def watch_staleness(page) -> None:
    """Record, from now on, whether the slide panel was ever greyed and what the banner said then."""
    page.evaluate("""() => {
        window.__stale = [];
        const panel = document.querySelector('#slide-panel');
        new MutationObserver(() => {
            if (panel.classList.contains('stale')) {
                window.__stale.push(document.querySelector('#shown-banner').innerText);
            }
        }).observe(document.body, {attributes: true, childList: true, subtree: true});
    }""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_page_names_greys_and_links_what_it_draws(service, browser):
    watch = Watch()
    page = open_page(browser, watch, f"{service.url}/?model={MODEL}&prefix={PREFIX}&slide=1")
    wait_until_done(page)
    wait_for_banner(page, False)
    assert "stale" not in page.get_attribute("#slide-panel", "class")
    link = link_of(page)
    assert (link["model"], link["prefix"]) == ([MODEL], [PREFIX])

    # the top coordinates name a vocabulary row by its token, not by its index
    page.wait_for_selector("#top-coordinates tr td")
    cells = page.eval_on_selector_all(
        "#top-coordinates td:nth-child(2)", "cells => cells.map(c => c.innerText)"
    )
    assert any(cell.startswith("'") for cell in cells), cells
    page.wait_for_function(  # the embedding's heatmap names its rows by token
        "() => (document.querySelector('#heatmap-graph .js-plotly-plot')?.layout?.yaxis?.ticktext || [])"
        '.some(t => t.startsWith("\'"))',
        timeout=30_000,
    )
    # the compare panel sits right under the slide, above the explorer
    compare_top = page.locator(".compare").bounding_box()["y"]
    assert compare_top < page.locator("#explorer-panel").bounding_box()["y"]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "view_1400.png"), full_page=False)
    page.locator("#explorer-panel").screenshot(path=str(SCREENSHOTS / "view_1400_explorer.png"))

    # edited controls: the banner names what is drawn, the link still describes it
    page.fill("#prefix", "He drank a cup of")
    wait_for_banner(page, True)
    assert "showing:" in banner(page) and PREFIX in banner(page) and "prefix" in banner(page)
    assert link_of(page)["prefix"] == [PREFIX]
    page.screenshot(path=str(SCREENSHOTS / "view_banner_1400.png"), full_page=False)
    page.fill("#prefix", PREFIX)
    wait_for_banner(page, False)

    # a run the API refuses: the old drawing is greyed and named, the link is unchanged
    page.fill("#prefix", TOO_LONG)
    page.click("#run")
    page.wait_for_function("() => document.querySelector('#slide-panel').classList.contains('stale')")
    assert "the last run failed" in banner(page) and PREFIX in banner(page)
    assert "stale" in page.get_attribute("#explorer-panel", "class")
    assert "over the limit" in page.inner_text("#message")
    assert link_of(page)["prefix"] == [PREFIX]

    # a new analysis: greyed while it computes, then drawn, matched, and linked
    page.fill("#prefix", PREFIX)
    page.fill("#continuation", " tea with")
    watch_staleness(page)
    page.click("#run")
    page.wait_for_function("() => document.querySelector('#progress-stage').innerText !== 'failed'")
    wait_until_done(page, "analysed continuation:")
    wait_for_banner(page, False)
    seen = page.evaluate("() => window.__stale")
    assert seen and any("computing" in text for text in seen), seen
    assert "stale" not in page.get_attribute("#slide-panel", "class")
    assert link_of(page)["continuation"] == [" tea with"]
    watch.check()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_phone_reads_one_column(service, browser):
    watch = Watch()
    context = browser.new_context(viewport=PHONE)
    watch.attach(context)
    page = context.new_page()
    page.goto(f"{service.url}/?model={MODEL}&prefix={PREFIX}")
    wait_until_done(page)
    page.wait_for_selector("#top-coordinates tr td")
    page.wait_for_timeout(500)  # the graphs' resize after the first drawing
    width = page.evaluate("() => document.documentElement.scrollWidth")
    assert width <= PHONE["width"] + 4, width
    title = page.locator("h2#slide-title")
    box = title.bounding_box()
    line = float(title.evaluate("t => parseFloat(getComputedStyle(t).lineHeight) || 30"))
    assert box["width"] > 250 and box["height"] < 4 * line, (box, line)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "view_390.png"), full_page=False)
    for panel in ("slide-panel", "explorer-panel"):
        page.locator(f"#{panel}").screenshot(path=str(SCREENSHOTS / f"view_390_{panel}.png"))
    watch.check()
