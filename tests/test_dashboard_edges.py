"""The built-in dashboard at its edges, in headless Chromium against the real API and Redis: the headers its page and
files carry (a Content-Security-Policy, never framed, never sniffed, revalidated), what a refused token and an API
without its Redis do to its polls (stopped until a token is saved, backed off: the API logs and counts each refusal),
a page that keeps to its window whatever a job's name, and an API that freezes, then goes: the page names it, where it
read "live" for ever. Also: the page works wherever it is opened (/static/index.html sends the browser to /), every API
reply is never sniffed, a browser without JavaScript is told where the facts are, a token given in a link leaves the
address, and a token saved or removed in one tab reaches the others.

The frozen API needs real time (``dump_dom``'s virtual time stands still while a fetch is pending), a token saved
needs a typist, and a page's address or other tabs need asking: those tests drive Chromium over its DevTools pipe
(``Browser``)."""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import pytest
import redis

from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from core.config import load_config
from services.api import create_app
from tests.chromium_harness import FLAGS, chromium_binary, dump_dom, elements
from tests.http_harness import serve_app

ROOT = Path(__file__).resolve().parents[1]
TOKEN = secrets.token_urlsafe(32)


def _refused(url: str, reason: str) -> int:
    """The API's count of requests it refused for ``reason`` (its ``/metrics``, which needs no token)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.search(rf'^rollwave_api_requests_refused_total\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return int(float(found.group(1))) if found else 0


def _error(html: str) -> str:
    return html.split('id="error"', 1)[1].split("</p>", 1)[0]


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedRedis(tmp_path_factory.mktemp("dash-edges") / "redis", aof=False) as server:
        cfg = load_config(None, ["run.name=dash-edges", f"redis.url={server.url}", f"api.token={TOKEN}"], env={})
        with serve_app(create_app(cfg)) as url:
            yield url


def test_the_page_and_its_files_carry_a_policy_that_runs_only_their_own_scripts(api_url: str) -> None:
    for path in ("/", "/static/index.html", "/static/app.js", "/static/style.css"):
        headers = httpx.get(f"{api_url}{path}", timeout=10).headers
        policy = dict(part.strip().partition(" ")[::2]
                      for part in headers.get("content-security-policy", "").split(";"))
        assert policy.get("default-src") == "'none'" and policy.get("script-src") == "'self'", (path, headers)
        assert policy.get("connect-src") == "'self'" and policy.get("frame-ancestors") == "'none'", (path, headers)
        assert headers.get("x-content-type-options") == "nosniff", (path, headers)
        assert headers.get("referrer-policy") == "no-referrer", (path, headers)
        assert headers.get("cache-control") == "no-cache", (path, headers)  # revalidated: no stale script
    html = dump_dom(f"{api_url}/#token={TOKEN}", virtual_time_ms=1000)  # and the page works under it
    assert elements(html, "body")[0].attrs["data-state"] == "ok", _error(html)


def test_the_page_loads_its_files_and_calls_the_api_wherever_it_is_opened(api_url: str) -> None:
    """Opened at /static/index.html, the page's relative links named /static/static/app.js and .../style.css (404: a
    page that never ran) and its calls /static/v1/status: that address sends the browser to the page at /."""
    for path in ("/", "/static/index.html"):
        reply = httpx.get(f"{api_url}{path}", timeout=10, follow_redirects=True)
        assert reply.status_code == 200, (path, reply.status_code)
        page = str(reply.url)
        files = [e.attrs["src"] for e in elements(reply.text, "script")] + \
            [e.attrs["href"] for e in elements(reply.text, "link") if e.attrs.get("rel") == "stylesheet"]
        assert len(files) == 2, (path, files)
        for file in files:
            assert httpx.get(urljoin(page, file), timeout=10).status_code == 200, (path, urljoin(page, file))
        assert urljoin(page, "v1/status") == f"{api_url}/v1/status", (path, page)


def test_every_reply_of_the_api_is_never_sniffed(api_url: str) -> None:
    """A JSON reply may quote what a client sent (a job's name): no browser may read it as HTML or script. The API's
    answers, its errors and the refusals of its guards alike."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for path, headers, status in [("/v1/status", auth, 200), ("/v1/jobs/nope", auth, 404), ("/v1/status", {}, 401),
                                  ("/v1/status", auth | {"Host": "elsewhere.example"}, 400), ("/healthz", {}, 200)]:
        reply = httpx.get(f"{api_url}{path}", headers=headers, timeout=10)
        assert reply.status_code == status, (path, headers, reply.status_code, reply.text)
        assert reply.headers.get_list("x-content-type-options") == ["nosniff"], (path, status, reply.headers)


def test_without_javascript_the_page_says_so_and_where_the_same_facts_are(api_url: str) -> None:
    """A browser that runs no script showed an empty page that read "connecting…" for ever."""
    html = httpx.get(f"{api_url}/", timeout=10).text
    body = html.split("<body", 1)[1]
    assert body.count("<noscript>") == 1, body
    message = re.sub(r"<[^>]+>|\s+", " ", body.split("<noscript>", 1)[1].split("</noscript>", 1)[0])
    for words in ("needs JavaScript", "GET /v1/status", "/openapi.json", "rollwave status", "rollwave jobs"):
        assert words in message, (words, message)


def test_a_refused_token_stops_the_polls_and_says_how_to_go_on(api_url: str) -> None:
    """20 s with a wrong token: one poll (its three calls refused), not one every 2 s, each refusal logged."""
    before = _refused(api_url, "auth")
    html = dump_dom(f"{api_url}/#token=not-the-token", virtual_time_ms=20_000)
    body = elements(html, "body")[0].attrs
    assert body["data-state"] == "error" and body["data-polls"] == "1", body
    assert _refused(api_url, "auth") - before == 3
    error = _error(html)
    assert "v1/status: HTTP 401: missing or wrong bearer token (enter the API token above)" in error, error
    assert "polling stopped: save a token to try again" in error, error


def test_the_polls_back_off_while_the_api_has_no_redis(tmp_path: Path) -> None:
    """30 s (of the page's time) without Redis: polls 4, 8 and 16 s apart, not 15 polls of two refused calls each (the
    metrics summary is the API's own memory)."""
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        cfg = load_config(None, ["run.name=dash-backoff", f"redis.url={server.url}", "redis.timeout_s=1.5",
                                 f"api.token={TOKEN}"], env={})
        with serve_app(create_app(cfg)) as url:
            server.stop()
            html = dump_dom(f"{url}/#token={TOKEN}", virtual_time_ms=30_000)
            refused = _refused(url, "redis")
    body = elements(html, "body")[0].attrs
    assert body["data-state"] == "error" and body["data-polls"] == "4", body
    assert refused == 8
    assert "HTTP 503: the run's Redis failed this request" in _error(html) and "next try in 32 s" in _error(html)


class Browser:
    """Headless Chromium on a page, driven over its DevTools pipe (``--remote-debugging-pipe``: commands on fd 3,
    replies on fd 4, each a JSON object ended by a NUL byte), in real time. Stopped (its process group) on exit."""

    def __init__(self, url: str) -> None:
        self.profile = tempfile.TemporaryDirectory(prefix="rollwave-chromium-")
        commands, self._to_browser = os.pipe()
        self._from_browser, replies = os.pipe()
        argv = [chromium_binary(), *FLAGS, f"--user-data-dir={self.profile.name}", "--window-size=1280,900",
                "--remote-debugging-pipe", url]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{commands} 4>&{replies}', "bash", *argv],
                                     pass_fds=(commands, replies), start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands)
        os.close(replies)
        self._buffer, self._next_id = b"", 0
        [page] = [t for t in self._call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        self._session = self._call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]

    def _call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params} | ({"sessionId": session} if session
                                                                               else {})
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 30
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    assert "error" not in reply, (method, reply)
                    return reply["result"]
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_browser], [], [], max(left, 0))
            assert ready, f"chromium: no reply to {method} over its DevTools pipe in 30 s"
            chunk = os.read(self._from_browser, 65536)
            assert chunk, f"chromium: its DevTools pipe closed before its reply to {method} (exit {self.proc.poll()})"
            self._buffer += chunk

    def open(self, url: str) -> str:
        """Another tab of this browser (its profile, so the same localStorage) on ``url``: its session, the ``tab`` of
        ``evaluate`` and ``wait_for`` (the first tab's without one)."""
        target = self._call("Target.createTarget", url=url)["targetId"]
        return self._call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def evaluate(self, expression: str, tab: str | None = None) -> Any:
        result = self._call("Runtime.evaluate", tab or self._session, expression=expression, returnByValue=True)
        return result["result"].get("value")

    def wait_for(self, what: str, expression: str, timeout_s: float, tab: str | None = None) -> Any:
        """The value of ``expression`` in the page once it is truthy; an AssertionError naming ``what`` and the page's
        error line if it is not within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not (value := self.evaluate(expression, tab)):
            assert time.monotonic() < deadline, (f"dashboard: {what} not within {timeout_s:g} s", self.evaluate(
                "[document.body.dataset.state, document.getElementById('error').textContent]", tab))
            time.sleep(0.2)
        return value

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        self.profile.cleanup()


ERROR = "document.body.dataset.state === 'error' && document.getElementById('error').textContent"


def test_a_token_saved_after_a_refused_one_starts_the_polls_again(api_url: str) -> None:
    with Browser(f"{api_url}/#token=not-the-token") as page:
        page.wait_for("the refusal shown", f"{ERROR}.includes('polling stopped')", 30)
        page.evaluate(f"document.getElementById('token').value = {json.dumps(TOKEN)};"
                      "document.getElementById('token-form').requestSubmit()")
        page.wait_for("a poll answered", "document.body.dataset.state === 'ok'", 30)
        assert page.evaluate("localStorage.getItem('rollwave.token')") == TOKEN


def test_a_link_with_the_token_leaves_no_token_in_the_address_or_history(api_url: str) -> None:
    """Opened at /static/index.html#token=..., as at /: the page runs, stores the token, and its address is the page's
    without the fragment (replaced: Back does not lead to the token)."""
    with Browser(f"{api_url}/static/index.html#token={TOKEN}") as page:
        page.wait_for("a poll answered", "document.body.dataset.state === 'ok'", 30)
        assert page.evaluate("[location.href, history.length]") == [f"{api_url}/", 1]
        assert page.evaluate("localStorage.getItem('rollwave.token')") == TOKEN


def test_a_token_saved_or_removed_in_one_tab_reaches_the_others(api_url: str) -> None:
    """A tab whose polls a missing token stopped polls again when another tab saves one, and stops when it is
    removed there: it sat refused until reloaded, or polled with a token its user had removed."""
    with Browser(f"{api_url}/") as page:
        page.wait_for("the refusal shown", f"{ERROR}.includes('polling stopped')", 30)
        other = page.open(f"{api_url}/#token={TOKEN}")
        page.wait_for("the token saved in the other tab used", "document.body.dataset.state === 'ok' && "
                      f"document.getElementById('token').value === {json.dumps(TOKEN)}", 30)
        page.evaluate("document.getElementById('token').value = '';"
                      "document.getElementById('token-form').requestSubmit()", other)
        page.wait_for("the token removed in the other tab dropped",
                      f"{ERROR}.includes('polling stopped') && document.getElementById('token').value === ''", 30)


def test_the_page_keeps_to_the_window_and_asks_for_nothing_the_api_does_not_serve(api_url: str) -> None:
    """A job's name of 200 characters without a space, and the jobs' many columns, made the page wider than the
    window (scrolled sideways, charts and all); the browser's ask for /favicon.ico was refused and logged at each
    load."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    reply = httpx.post(f"{api_url}/v1/jobs", json={"name": "n" * 200, "source": {"kind": "arith", "limit": 1}},
                       headers=auth, timeout=30)
    assert reply.status_code == 201, reply.text
    before = _refused(api_url, "route")
    with Browser(f"{api_url}/#token={TOKEN}") as page:
        page.wait_for("the jobs table", "document.body.dataset.state === 'ok' && "
                                        f"document.getElementById('jobs-body').textContent.includes('{'n' * 200}')", 30)
        page_width, window, name_width = page.evaluate(
            "[document.documentElement.scrollWidth, window.innerWidth,"
            " document.querySelector('#jobs-body td:nth-child(2)').offsetWidth]")
    assert page_width <= window and name_width < window / 2, (page_width, window, name_width)
    assert _refused(api_url, "route") == before


def test_an_api_that_freezes_then_goes_is_named_not_left_showing_live(tmp_path: Path) -> None:
    """The API process stopped (SIGSTOP: connections are accepted, nothing answers), then killed (refused)."""
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        run = "dash-frozen"
        api = subprocess.Popen([sys.executable, "-m", "services.api", f"run.name={run}", f"redis.url={server.url}",
                                "api.port=0"], cwd=ROOT, start_new_session=True,
                               env={**os.environ, "ROLLWAVE_API_TOKEN": TOKEN})
        try:
            client, deadline = redis.Redis.from_url(server.url), time.monotonic() + 60
            while not (url := client.hget(Keys(run).api, "url")):
                assert api.poll() is None and time.monotonic() < deadline, f"the API did not start (exit {api.poll()})"
                time.sleep(0.1)
            with Browser(f"{url.decode()}/#token={TOKEN}") as page:
                page.wait_for("a poll answered", "document.body.dataset.state === 'ok'", 30)
                os.kill(api.pid, signal.SIGSTOP)
                error = page.wait_for("the frozen API named", ERROR, 40)
                assert "v1/status: the API did not answer (no answer in 20 s);" in error, error
                assert error.endswith("; next try in 4 s"), error
                os.kill(api.pid, signal.SIGKILL)
                error = page.wait_for("the gone API named", f"{ERROR}.includes('Failed to fetch') && {ERROR}", 30)
                assert "v1/status: the API did not answer (Failed to fetch);" in error, error
                assert error.endswith("; next try in 8 s"), error
        finally:
            os.kill(api.pid, signal.SIGKILL)
            api.wait()
