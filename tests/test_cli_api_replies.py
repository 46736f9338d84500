"""The CLI's reading of API replies: each error line names the whole URL it called (which API answered), and a
server at --api that is not the rollwave API is named as such, not a JSON parser's complaint."""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route

from tests.http_harness import serve_app
from tests.test_cli_errors import TOKEN, assert_one_error_line, live_api, rollwave

__all__ = ["live_api"]  # the fixture, used here by name


def test_an_api_refusal_names_the_url_it_called(live_api: str, tmp_path: Path) -> None:
    proc = rollwave("trajectories", "nosuchjob", "--api", live_api, cwd=tmp_path, env={"ROLLWAVE_API_TOKEN": TOKEN})
    assert_one_error_line(proc, 2, f"GET {live_api}/v1/jobs/nosuchjob/trajectories?cursor=&limit=")


def test_a_server_that_is_not_the_api_is_named_with_the_call(tmp_path: Path) -> None:
    """Some other web server at --api answers 200 with a page: the line says so, with the URL, exit 2."""
    page = Starlette(routes=[Route("/{path:path}", lambda _request: HTMLResponse("<html>hello</html>"))])
    with serve_app(page) as url:
        proc = rollwave("status", "--api", url, cwd=tmp_path)
    line = assert_one_error_line(proc, 2, f"GET {url}/v1/status: HTTP 200 with no JSON (text/html")
    assert "is --api the rollwave API?" in line


def test_a_job_id_is_one_path_segment_whatever_it_holds(live_api: str, tmp_path: Path) -> None:
    """An id with ``?`` or ``#`` (a paste gone wrong), or ``.`` or ``..`` (which a URL reads as "here" and "up": a
    cancel of ``.`` asked about ``POST /v1/jobs/cancel``), is asked about as typed, never cut into another call."""
    for command in (["trajectories"], ["jobs", "cancel"], ["jobs", "delete"]):
        for job in ("nosuchjob?x", "nosuchjob#", ".", ".."):
            proc = rollwave(*command, job, "--api", live_api, cwd=tmp_path, env={"ROLLWAVE_API_TOKEN": TOKEN})
            assert_one_error_line(proc, 2, f"HTTP 404: job {job!r} not found")
