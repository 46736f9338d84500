"""The API's origin runs only its own scripts: the dashboard keeps the bearer token in that origin's localStorage,
so a page there that loads a script from a CDN (FastAPI's /docs and /redoc do) hands the token to that CDN."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from buffer.redis_server import EmbeddedRedis
from core.config import load_config
from services.api import create_app
from tests.http_harness import serve_app


def test_no_page_of_the_api_loads_a_script_from_elsewhere(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        app = create_app(load_config(None, ["run.name=api-pages", f"redis.url={server.url}"], env={}))
        pages = [route.path for route in app.routes if "GET" in (getattr(route, "methods", None) or ())
                 and not route.path.startswith("/v1/") and route.path not in ("/healthz", "/readyz", "/metrics")]
        with serve_app(app) as url:
            for path in [*pages, "/static/index.html", "/static/app.js"]:
                reply = httpx.get(f"{url}{path}", follow_redirects=True)
                assert reply.status_code == 200, (path, reply.status_code)
                assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", reply.text), (path, reply.text[:500])
