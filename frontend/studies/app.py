"""The study page's Dash app: `create_study_app`, with every callback registered on it."""

from __future__ import annotations

from pathlib import Path

import dash

from frontend.api_client import ApiClient
from frontend.server_guard import guard_dash_server
from frontend.studies import callbacks, layout, results, updates
from frontend.studies.client import StudyClient

ASSETS = Path(__file__).parent / "assets"


def create_study_app(
    api_base_url: str,
    requests_pathname_prefix: str = "/studies/",
    public_api_url: str | None = None,
    api_token: str | None = None,
) -> dash.Dash:
    """The study page, calling the API at `api_base_url`; browsers download masks from `public_api_url`
    (default: `api_base_url`). ``api_token`` as for the dashboard (frontend.app)."""
    client = StudyClient(ApiClient(api_base_url, token=api_token), public_api_url)
    app = dash.Dash(
        __name__,
        requests_pathname_prefix=requests_pathname_prefix,
        assets_folder=str(ASSETS),
        title="fisherscope · studies",
        suppress_callback_exceptions=True,
    )
    app.layout = layout.page()
    callbacks.register(app, client)
    results.register(app, client)
    updates.register_updates(app, client)
    guard_dash_server(app, api_token)
    return app
