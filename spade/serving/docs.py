"""``/docs`` served with Swagger UI's own assets from this process, so the page works offline.

FastAPI's default ``/docs`` and ``/redoc`` load their scripts and styles from a CDN: behind a
firewall (or on a laptop without a network) they render blank. ``install_offline_docs`` serves
Swagger UI from the ``swagger-ui-bundle-v2`` package instead; create the app with
``docs_url=None, redoc_url=None`` and call it once.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles

ASSETS = "/docs/assets"


def install_offline_docs(app: FastAPI, *, path: str = "/docs") -> None:
    """Serve Swagger UI for ``app``'s OpenAPI document at ``path``, every asset from this process."""
    from swagger_ui_bundle import swagger_ui_path

    if app.docs_url or app.redoc_url:
        raise ValueError("create the app with docs_url=None and redoc_url=None: their pages load assets from a CDN")
    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get(path, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{app.title}: API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
        )
