"""The Dash app: one instance, with every callback registered on it by `frontend.callbacks`.

The URL query string is the whole state (frontend.state); the API is reached only through
`frontend.api_client`; figures and slides are pure functions of the summary JSON, so the centering toggle
and slide steps never ask the API for anything.
"""

from __future__ import annotations

from pathlib import Path

import dash

from frontend import layout
from frontend.api_client import ApiClient
from frontend.callbacks import explorer, exports, run, slides, state

ASSETS = Path(__file__).parent / "assets"


def create_dash_app(
    api_base_url: str, requests_pathname_prefix: str = "/", public_api_url: str | None = None
) -> dash.Dash:
    """The dashboard, calling the API at `api_base_url`; browsers download from `public_api_url`."""
    api = ApiClient(api_base_url)
    public = ApiClient(public_api_url) if public_api_url else api
    app = dash.Dash(
        __name__,
        requests_pathname_prefix=requests_pathname_prefix,
        assets_folder=str(ASSETS),
        title="fisherscope",
        suppress_callback_exceptions=True,
    )
    app.layout = layout.page()
    state.register(app, api)
    run.register(app, api)
    slides.register(app)
    explorer.register(app, api)
    exports.register(app, api, public)
    return app
