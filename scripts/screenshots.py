"""Screenshots of every slide and of the explorer on the real SmolLM2-135M (not part of the test suite).

Starts `fisherscope serve` (embedded mode) on a free port with a temporary results folder, opens the
dashboard in headless Debian Chromium and saves full-page screenshots (controls, slide and explorer) to
docs/screenshots/smollm2/slideNN.png and explorer.png. Four analyses of "She drank a cup of" are used,
each for the slides it has content for; an exact analysis takes about 15 s to a minute on a CPU.

    .venv/bin/python scripts/screenshots.py [--out docs/screenshots/smollm2] [--model smollm2-135m]

`--slides 9` retakes only the slides named (and computes only their analyses), without the explorer.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlencode

from frontend.devserver import CHROMIUM, ServiceDidNotStart, embedded_service, launch_chromium

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "She drank a cup of"
CONTINUATION = " coffee with milk"

# Which analysis each slide is shown on: the one where its figure has something to say.
VIEWS: dict[str, dict[str, str]] = {
    "on-policy": {},
    "reward": {"temperature": "0.7", "reward": " tea:1; coffee:0"},
    "response on-policy": {"continuation": CONTINUATION},
    "response data": {"continuation": CONTINUATION, "sampler": "data"},
}
SLIDE_VIEW = {
    1: "on-policy",
    2: "reward",
    3: "on-policy",
    4: "response on-policy",
    5: "reward",
    6: "on-policy",
    7: "on-policy",
    8: "response data",
    9: "response data",
    10: "reward",
}


def view_url(base: str, model: str, view: str, slide: int) -> str:
    query = {"model": model, "prefix": PREFIX, **VIEWS[view], "slide": str(slide)}
    return f"{base}/?{urlencode(query)}"


def wait_until_drawn(page, timeout_ms: int) -> None:
    """The analysis is in (cached or computed), the reading is written and MathJax has typeset."""
    page.wait_for_function(
        "() => ['done', 'cached'].includes((document.querySelector('#progress-stage')?.innerText || ''))"
        " && (document.querySelector('#slide-reading')?.innerText || '').trim().length > 20",
        timeout=timeout_ms,
    )
    page.wait_for_function(
        "() => document.querySelector('#slide-formula').innerHTML.includes('mjx-container')", timeout=60_000
    )
    page.wait_for_timeout(1500)


def shown(path: Path) -> Path:
    """The path as printed: relative to the checkout when it lies inside it (--out may be anywhere)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def shoot(base: str, model: str, out: Path, slides: list[int]) -> None:
    """Screenshot the given slides; the explorer too when every slide is taken."""
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        for slide in slides:
            view = SLIDE_VIEW[slide]
            page.goto(view_url(base, model, view, slide))
            wait_until_drawn(page, 600_000)
            path = out / f"slide{slide:02d}.png"
            page.screenshot(path=str(path), full_page=True)
            print(f"{shown(path)}: {view}: {page.inner_text('#slide-reading')}", flush=True)
        if sorted(slides) != sorted(SLIDE_VIEW):
            browser.close()
            return

        page.goto(view_url(base, model, "response on-policy", 4))
        wait_until_drawn(page, 600_000)
        page.locator("#layer-graph").scroll_into_view_if_needed()
        bar = page.locator("#layer-graph .trace.bars .point path").nth(1).bounding_box()  # layer 0
        page.mouse.click(bar["x"] + bar["width"] / 2, bar["y"] + bar["height"] - 2)
        page.wait_for_function(
            "() => (document.querySelector('#heatmap-graph .gtitle')?.textContent || '')"
            ".includes('layers.0')",
            timeout=60_000,
        )
        page.wait_for_timeout(1000)
        page.locator(".explorer").screenshot(path=str(out / "explorer.png"))
        print(shown(out / "explorer.png"), flush=True)
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
        help="results folder to reuse (analyses computed there open at once); default: a new temp one",
    )
    parser.add_argument(
        "--slides",
        type=int,
        nargs="+",
        choices=sorted(SLIDE_VIEW),
        default=sorted(SLIDE_VIEW),
        metavar="N",
        help="slides to take (1..10); default: all, and then the explorer too",
    )
    args = parser.parse_args()
    if not Path(CHROMIUM).exists():
        raise SystemExit("Debian chromium is missing: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="fisherscope-shots-") as folder:
        results = args.cache or Path(folder)
        try:
            with embedded_service(results / "results", results / "exports", args.port) as base:
                shoot(base, args.model, args.out.resolve(), args.slides)
        except ServiceDidNotStart as error:
            raise SystemExit(str(error)) from None


if __name__ == "__main__":
    sys.exit(main())
