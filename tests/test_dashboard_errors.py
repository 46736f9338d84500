"""The built-in dashboard in headless Chromium against the real API and Redis: what the run's data holds is shown
as text, never run as HTML (a job's name is whatever its submitter typed), and when the API refuses a call the page
says why, as the API worded it (here: its Redis is gone), not only the status code."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx

from buffer.redis_server import EmbeddedRedis
from core.config import load_config
from services.api import create_app
from tests.chromium_harness import dump_dom, elements
from tests.http_harness import serve_app

TOKEN = secrets.token_urlsafe(32)
NAME = '<img src=x onerror="document.body.dataset.pwned=1">'


def test_the_dashboard_shows_data_as_text_and_names_why_a_call_failed(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        cfg = load_config(None, ["run.name=dash-errors", f"redis.url={server.url}", "redis.timeout_s=1.5",
                                 f"api.token={TOKEN}"], env={})
        with serve_app(create_app(cfg)) as url:
            reply = httpx.post(f"{url}/v1/jobs", json={"name": NAME, "source": {"kind": "arith", "limit": 1}},
                               headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
            assert reply.status_code == 201, reply.text
            html = dump_dom(f"{url}/#token={TOKEN}", virtual_time_ms=3000)
            body = elements(html, "body")[0].attrs
            assert body["data-state"] == "ok" and "data-pwned" not in body, body
            assert "&lt;img src=x" in html and not [e for e in elements(html, "img")]
            server.stop()
            html = dump_dom(f"{url}/#token={TOKEN}", virtual_time_ms=3000)
    assert elements(html, "body")[0].attrs["data-state"] == "error"
    error = html.split('id="error"', 1)[1].split("</p>", 1)[0]
    assert f"v1/status: HTTP 503: the run's Redis failed this request (ConnectionError: Redis at {server.host}:" \
        in error, error
