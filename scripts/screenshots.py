"""Screenshots of every slide, the explorer and the compare view on the real SmolLM2-135M (not a test).

Starts `fisherscope serve` (embedded mode) on a free port with a temporary results folder, opens the
dashboard in headless Debian Chromium and saves, to docs/screenshots/smollm2/:

- landing/slide01.png ... slide10.png: the first page a person sees, the essays' example that
  `fisherscope serve` computes at start ("She drank a cup of" + " tea with her", a reward over ' tea'
  and ' coffee', temperature 0.7, top-k 50), at every slide.
- slide01.png ... slide10.png: the page (controls with the drawn response's chips, and the slide) for a
  response of 8 tokens sampled (seed 0) after "She drank a cup of" at temperature 0.7, top-k 50, with a
  reward of 1 on ' tea', exact. One analysis for all ten slides, chosen so that each has something to
  show: the sampler differs from the model (mean shift, slides 5, 8, 10), top-k makes the rank bound
  n - 1 = 49 binding (slide 7), the reward gives slide 2 a gradient, and the response feeds slides 4, 8
  and 9. Off the model's own distribution rho needs the d = 576 directions of the Fisher under p at
  every position: the page draws the first answer and takes the slides once its rho stage is done.
- explorer.png: the explorer on that analysis, at a later response position, with a layer opened.
- compare.png: the compare panel, "She drank a cup of" at temperature 1 (the landing view) against 0.7.

On a 2-core CPU the whole run takes about four minutes, the rho stages included; `--cache` keeps the
analyses for the next run.

    .venv/bin/python scripts/screenshots.py [--out docs/screenshots/smollm2] [--model smollm2-135m]

`--slides 9` retakes only the slides named (the explorer and compare view are taken with all ten).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlencode

from backend.vocabulary import LANDING_PREFIX
from frontend.devserver import (
    CHROMIUM,
    ServiceDidNotStart,
    embedded_service,
    launch_chromium,
    wait_until_ready,
)

ROOT = Path(__file__).resolve().parents[1]
SLIDES = range(1, 11)
VIEW = {  # the sampled analysis every slide is shown on
    "prefix": LANDING_PREFIX,
    "temperature": "0.7",
    "top_k": "50",
    "reward": " tea=1",
    "sample_seed": "0",
    "sample_tokens": "8",
}
EXPLORER_POSITION = 3  # a response position, to show that the explorer reads any of them
COMPARED = {"b_temperature": "0.7"}  # B against the landing view (temperature 1)
WAIT_MS = 3_600_000  # a computation on a shared CPU; cached ones open at once


def view_url(base: str, model: str, slide: int) -> str:
    return f"{base}/?{urlencode({'model': model, **VIEW, 'slide': str(slide)})}"


def wait_until_drawn(page, timeout_ms: int = WAIT_MS) -> None:
    """The analysis is in (cached or computed), the reading is written and MathJax has typeset."""
    page.wait_for_function(
        "() => ['done', 'cached', 'failed'].includes(document.querySelector('#progress-stage')?.innerText)"
        " && (document.querySelector('#slide-reading')?.innerText || '').trim().length > 20",
        timeout=timeout_ms,
    )
    if page.inner_text("#progress-stage") == "failed":
        raise SystemExit(f"the analysis failed: {page.inner_text('#message')}")
    page.wait_for_function(
        "() => document.querySelector('#slide-formula').innerHTML.includes('mjx-container')", timeout=60_000
    )
    page.wait_for_timeout(1500)


def shown(path: Path) -> Path:
    """The path as printed: relative to the checkout when it lies inside it (--out may be anywhere)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def shoot_slides(page, base: str, model: str, out: Path, slides: list[int]) -> None:
    """The controls and the slide, down to the export row (the explorer has its own picture)."""
    for slide in slides:
        page.goto(view_url(base, model, slide))
        wait_until_drawn(page)
        bottom = page.locator(".exports").bounding_box()
        path = out / f"slide{slide:02d}.png"
        page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": 1500, "height": bottom["y"] + 50})
        print(f"{shown(path)}: {page.inner_text('#slide-reading')}", flush=True)


def shoot_landing(page, base: str, model: str, out: Path, slides: list[int]) -> None:
    """The landing example (a link without a prefix opens it) at each slide."""
    out.mkdir(parents=True, exist_ok=True)
    for slide in slides:
        page.goto(f"{base}/?{urlencode({'model': model, 'slide': str(slide)})}")
        wait_until_drawn(page)
        bottom = page.locator(".exports").bounding_box()
        path = out / f"slide{slide:02d}.png"
        page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": 1500, "height": bottom["y"] + 50})
        print(f"{shown(path)}: {page.inner_text('#slide-reading')}", flush=True)


def shoot_explorer(page, base: str, model: str, out: Path) -> None:
    """The explorer at a later response position, with the first hidden layer's matrices opened."""
    page.goto(view_url(base, model, 4))
    wait_until_drawn(page)
    page.locator("#explorer-position").click()
    option = page.get_by_role("option", name=re.compile(rf"^{EXPLORER_POSITION + 1}: after \d+ tokens"))
    context = re.search(r"after (\d+) tokens", option.inner_text()).group(1)
    option.click()
    page.wait_for_function(
        "(n) => (document.querySelector('#next-token-graph .gtitle')?.textContent || '')"
        ".includes(`after ${n} tokens`)",
        arg=context,
        timeout=60_000,
    )
    page.locator("#layer-graph").scroll_into_view_if_needed()
    bar = page.locator("#layer-graph .trace.bars .point path").nth(1).bounding_box()  # layer 0
    page.mouse.click(bar["x"] + bar["width"] / 2, bar["y"] + bar["height"] - 2)
    page.wait_for_function(
        "() => (document.querySelector('#heatmap-graph .gtitle')?.textContent || '').includes('layers.0')",
        timeout=60_000,
    )
    page.mouse.move(5, 5)  # no hover label left over the bar just clicked
    page.wait_for_timeout(1000)
    page.locator(".explorer").screenshot(path=str(out / "explorer.png"))
    print(shown(out / "explorer.png"), flush=True)


def shoot_compare(page, base: str, model: str, out: Path) -> None:
    """The landing view (temperature 1) against temperature 0.7, from the compare panel's controls."""
    page.goto(f"{base}/?{urlencode({'model': model, 'prefix': LANDING_PREFIX})}")
    wait_until_drawn(page)
    for key, value in COMPARED.items():
        page.fill(f"#{key}", value)
    page.click("#compare-run")
    page.wait_for_function(
        "() => (document.querySelector('#compare-heatmap-graph .js-plotly-plot')?.data || [])"
        ".some(t => t.type === 'heatmap')",
        timeout=WAIT_MS,
    )
    page.wait_for_timeout(1500)
    page.locator(".compare").screenshot(path=str(out / "compare.png"))
    print(f"{shown(out / 'compare.png')}: {page.inner_text('#compare-reading')}", flush=True)


def shoot(base: str, model: str, out: Path, slides: list[int]) -> None:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        shoot_landing(page, base, model, out / "landing", slides)
        shoot_slides(page, base, model, out, slides)
        if sorted(slides) == list(SLIDES):
            shoot_explorer(page, base, model, out)
            shoot_compare(page, base, model, out)
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots" / "smollm2")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--port", type=int, default=0, help="0 = a free port")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="folder to reuse (its results/ open at once, new ones are kept there); default: a new temp one",
    )
    parser.add_argument(
        "--slides",
        type=int,
        nargs="+",
        choices=list(SLIDES),
        default=list(SLIDES),
        metavar="N",
        help="slides to take (1..10); default: all, and then the explorer and the compare view too",
    )
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        raise SystemExit("Debian chromium is missing: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="fisherscope-shots-") as folder:
        results = args.cache or Path(folder)
        try:
            with embedded_service(results / "results", results / "exports", args.port) as base:
                wait_until_ready(base)
                shoot(base, args.model, args.out.resolve(), args.slides)
        except ServiceDidNotStart as error:
            raise SystemExit(str(error)) from None


if __name__ == "__main__":
    sys.exit(main())
