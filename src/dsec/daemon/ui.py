"""The web dashboard at ``/ui``: static HTML, JavaScript and CSS shipped as package data, no build step.

Owns only the mount. The page holds no data of its own: its script calls the same ``/v1`` API as the SDK
(``/v1/overview``, ``/v1/sandboxes``, ``/v1/audit``, ``/v1/events``...) with the token the operator gives
it, so the node daemon and the cluster gateway (which reuses the app) serve the same dashboard.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

__all__ = ["DASHBOARD_DIR", "mount_ui"]

DASHBOARD_DIR = Path(__file__).with_name("dashboard")
"""The dashboard's files (``index.html``, ``dashboard.js``, ``dashboard.css``)."""


def mount_ui(app: FastAPI) -> None:
    """Serve the dashboard at ``/ui/`` (``/ui`` and ``/``, where a browser pointed at the daemon lands, redirect
    there)."""

    @app.get("/", include_in_schema=False)
    @app.get("/ui", include_in_schema=False)
    async def ui_root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    app.mount("/ui/", StaticFiles(directory=DASHBOARD_DIR, html=True), name="ui")
