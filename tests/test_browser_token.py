"""A shared server in headless Chromium: the dashboard asks for the token, then works as without one.

`fisherscope serve` with FISHERSCOPE_API_TOKEN: a browser without it gets 401 and nothing else; a
browser that gave it (HTTP Basic, as a person types it into the browser's prompt) runs an analysis,
every request of the page answered without a 4xx, and the share link it writes carries no token.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from frontend.devserver import CHROMIUM, embedded_service, wait_until_ready
from tests.requirements import require
from tests.test_browser import (  # noqa: F401
    SCREENSHOTS,
    VIEWPORT,
    Watch,
    browser,
    wait_for_restore,
    wait_until_done,
)

TOKEN = "browser-test-token-0123456789abcdef"


@pytest.mark.slow
def test_a_shared_server_asks_for_the_token_and_never_shows_it(tmp_path: Path, browser) -> None:  # noqa: F811
    require(Path(CHROMIUM).exists(), "Debian chromium (apt-get install chromium)")
    extra = {"FISHERSCOPE_API_TOKEN": TOKEN}
    with embedded_service(
        tmp_path / "results", tmp_path / "exports", landing_analysis=False, extra_env=extra
    ) as url:
        wait_until_ready(url)
        assert (
            httpx.post(f"{url}/api/v1/analyses", json={"model": "tiny-random", "prefix": "a"}).status_code
            == 401
        )

        stranger = browser.new_context(viewport=VIEWPORT)  # Chromium itself gives up on a page it
        assert stranger.request.get(url + "/").status == 401  # has no credentials for
        with pytest.raises(Exception, match="AUTH"):
            stranger.new_page().goto(url + "/")
        stranger.close()

        watch = Watch()
        context = browser.new_context(
            viewport=VIEWPORT, http_credentials={"username": "colleague", "password": TOKEN}
        )
        watch.attach(context)
        page = context.new_page()
        page.goto(f"{url}/?model=tiny-random&prefix=Tea+or+coffee%3F&slide=3")
        wait_for_restore(page)
        wait_until_done(page)
        share = page.input_value("#share-link")
        assert TOKEN not in share and TOKEN not in page.content() and TOKEN not in page.url
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "shared-server.png"))
        watch.check()
        context.close()
