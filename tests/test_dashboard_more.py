"""The API and its dashboard where their earlier tests did not look: every reply the server sends is never sniffed,
the 500 of a handler's unexpected error and uvicorn's own refusals too (real HTTP on 127.0.0.1), and a dashboard
whose script did not run (not found, refused as another type, a syntax error, an error as it starts) says so, in
headless Chromium under the page's own Content-Security-Policy, where it read "connecting…" for ever. Also the token
in a link: a base64 token's "+" is kept (it was read as a space, and refused), and a token no header can carry is
named as such, its polls stopped (it read as an API that did not answer, polled for ever)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

from buffer.redis_server import EmbeddedRedis
from core.config import load_config
from services.api import create_app
from services.api.app import PAGE_HEADERS, STATIC
from tests.chromium_harness import dump_dom, elements
from tests.http_harness import serve_app
from tests.test_bad_http import NOT_HTTP, TOO_BIG_HEAD, send_raw
from tests.test_dashboard_edges import Browser, _error, _refused

TOKEN = f"a+b/{secrets.token_urlsafe(32)}="  # as a base64 token may read
# scripts that do not run, each in place of the dashboard's own
BROKEN_SCRIPTS = {
    "missing": lambda: Response(status_code=404),
    "not-javascript": lambda: Response("window.ran = 1;", media_type="text/plain"),  # with nosniff: never run
    "syntax-error": lambda: Response("(() => {", media_type="text/javascript"),
    "throws": lambda: Response("throw new Error('failed as it started');", media_type="text/javascript"),
}


def _with_broken_pages(app: FastAPI) -> None:
    """The dashboard's page at ``/<how>/`` for each of ``BROKEN_SCRIPTS``, with its headers and style sheet, and a
    script that does not run."""

    def page(how: str) -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    def file(how: str, name: str) -> Response:
        if name == "app.js":
            return BROKEN_SCRIPTS[how]()
        return FileResponse(STATIC / name, headers=PAGE_HEADERS)

    app.add_api_route("/{how}/", page)
    app.add_api_route("/{how}/static/{name}", file)


def _boom() -> None:
    raise RuntimeError("a bug in a handler")


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedRedis(tmp_path_factory.mktemp("dash-more") / "redis", aof=False) as server:
        app = create_app(load_config(None, ["run.name=dash-more", f"redis.url={server.url}", f"api.token={TOKEN}"],
                                     env={}))
        app.add_api_route("/v1/boom", _boom)
        _with_broken_pages(app)
        with serve_app(app) as url:
            yield url


def _nosniff(reply: bytes) -> list[bytes]:
    """The values of the X-Content-Type-Options headers of a raw HTTP reply."""
    head = reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
    return [value.strip() for name, _, value in (line.partition(b":") for line in head)
            if name.strip().lower() == b"x-content-type-options"]


def test_the_500_of_an_unexpected_error_is_json_and_never_sniffed(api_url: str) -> None:
    """Starlette's ServerErrorMiddleware, outside every middleware added to the app, sent it without the header, as
    bare text; it names the request and the exception's type, not its message (the log has that)."""
    reply = httpx.get(f"{api_url}/v1/boom", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert reply.status_code == 500, reply.text
    assert reply.headers.get_list("x-content-type-options") == ["nosniff"], reply.headers
    assert reply.json() == {"detail": "GET /v1/boom failed: an unexpected RuntimeError in the API (its log has the "
                                      "traceback)"}


def test_the_refusals_uvicorn_makes_itself_are_never_sniffed(api_url: str) -> None:
    """Bytes that are not HTTP, and a head over the limit, are answered 400 by the server before the app sees them;
    the app's replies after them carry the header once, as before."""
    for what, data in [*NOT_HTTP.items(), ("head_size", TOO_BIG_HEAD)]:
        reply = send_raw(api_url, data)
        assert reply.startswith(b"HTTP/1.1 400 "), (what, reply[:300])
        assert _nosniff(reply) == [b"nosniff"], (what, reply[:300])
    reply = httpx.get(f"{api_url}/healthz", timeout=10)
    assert reply.status_code == 200 and reply.headers.get_list("x-content-type-options") == ["nosniff"], reply.headers


def _shown(element_id: str) -> str:
    """A page's expression: the text of the element ``element_id`` while it is shown, else ''. Asked once the page is
    loaded: before its style sheet is, the browser draws nothing, but an element reads as shown."""
    element = f"document.getElementById({json.dumps(element_id)})"
    return f"document.readyState === 'complete' && {element}?.checkVisibility() && {element}.textContent"


class _Browser(Browser):
    def open_without_scripts(self, url: str) -> str:
        """Another tab on ``url`` that runs none of its scripts (a browser with JavaScript off): its session."""
        tab = self.open("about:blank")
        self._call("Emulation.setScriptExecutionDisabled", tab, value=True)
        self._call("Page.navigate", tab, url=url)
        return tab


def test_a_page_whose_script_did_not_run_says_so_and_one_that_ran_does_not(api_url: str) -> None:
    """Each broken page in a tab, loaded (its script tried): its words for a script that did not run stay; they show
    once a slow load has had its time (seen in the tab opened last, in front: a tab behind it draws nothing, and its
    style's clock stands still). The page whose script loads polls as before and shows no such words, and a browser
    with JavaScript off shows its noscript words only."""
    with _Browser(f"{api_url}/#token={TOKEN}") as browser:
        tabs = {how: browser.open(f"{api_url}/{how}/") for how in BROKEN_SCRIPTS}
        for how, tab in tabs.items():
            browser.wait_for(f"the page with a script that does not run ({how}) loaded",
                             f"location.pathname === '/{how}/' && document.readyState === 'complete'", 30, tab)
            state = "[document.body.dataset.state, window.ran, document.getElementById('not-started') !== null]"
            assert browser.evaluate(state, tab) == ["loading", None, True], how
        message = browser.wait_for(f"the words for a script that did not run ({how})", _shown("not-started"), 30, tab)
        assert "The dashboard's script (static/app.js) did not run" in message, message
        assert "the browser's console says why" in message and "GET /v1/status" in message, message
        assert browser.evaluate(_shown("conn"), tab) == "error"
        browser.wait_for("a poll answered", "document.body.dataset.state === 'ok'", 30)
        assert browser.evaluate("document.getElementById('not-started')") is None
        assert browser.evaluate(_shown("conn")).startswith("live · ")
        tab = browser.open_without_scripts(f"{api_url}/")
        browser.wait_for("the page without scripts loaded, its time for a slow load over", "location.pathname === '/' "
                         "&& document.readyState === 'complete' && document.getAnimations().length === 0", 30, tab)
        assert browser.evaluate(_shown("conn"), tab) == "error"
        assert browser.evaluate("document.querySelector('noscript').checkVisibility()", tab)
        assert not browser.evaluate(_shown("not-started"), tab)


def test_a_link_with_a_base64_token_is_let_in(api_url: str) -> None:
    html = dump_dom(f"{api_url}/#token={TOKEN}", virtual_time_ms=1000)
    assert elements(html, "body")[0].attrs["data-state"] == "ok", _error(html)


def test_a_token_no_header_can_carry_is_named_and_stops_the_polls(api_url: str) -> None:
    """A dash as a document's typography sets it ("–", not Latin-1): the browser cannot send it, so nothing reaches
    the API; 20 s of the page's time, one poll."""
    before = _refused(api_url, "auth")
    html = dump_dom(f"{api_url}/#token={quote(TOKEN.replace('/', '–'))}", virtual_time_ms=20_000)
    body = elements(html, "body")[0].attrs
    assert body["data-state"] == "error" and body["data-polls"] == "1", body
    error = _error(html)
    assert "v1/status: the token cannot be sent (" in error and "enter the API token above" in error, error
    assert "polling stopped: save a token to try again" in error, error
    assert _refused(api_url, "auth") == before
