"""The Dash app: one instance, with every callback registered on it by `frontend.callbacks`.

The URL query string is the whole state (frontend.state); the browser holds analysis ids and view state,
never a summary (frontend.handles). The callbacks read what a figure needs by id through
`frontend.summaries` (the API's answers, kept by id), and figures and slides are pure functions of that
JSON, so the centering toggle and slide steps ask the API nothing after the first drawing.
"""

from __future__ import annotations

from pathlib import Path

import dash

from frontend import layout
from frontend.api_client import ApiClient
from frontend.callbacks import compare, explorer, exports, run, slides, state
from frontend.server_guard import guard_dash_server
from frontend.summaries import Summaries

ASSETS = Path(__file__).parent / "assets"


def create_dash_app(
    api_base_url: str,
    requests_pathname_prefix: str = "/",
    public_api_url: str | None = None,
    api_token: str | None = None,
) -> dash.Dash:
    """The dashboard, calling the API at `api_base_url`; browsers download from `public_api_url`.
    ``api_token`` (default $FISHERSCOPE_API_TOKEN): the server's token, sent to the API from here and
    asked of every browser that opens the dashboard."""
    api = ApiClient(api_base_url, token=api_token)
    public = ApiClient(public_api_url) if public_api_url else api
    app = dash.Dash(
        __name__,
        requests_pathname_prefix=requests_pathname_prefix,
        assets_folder=str(ASSETS),
        title="fisherscope",
        suppress_callback_exceptions=True,
    )
    app.layout = layout.page()
    summaries = Summaries(api)
    state.register(app, api, summaries)
    run.register(app, api, summaries)
    slides.register(app, summaries)
    explorer.register(app, summaries)
    exports.register(app, api, public, summaries)
    compare.register(app, api, summaries)
    guard_dash_server(app, api_token)
    return app
