"""``rollwave`` with input it cannot send and APIs that misbehave, called in-process (``services.cli.main``): each
failure is one ``error:`` line naming what is wrong (the flag, the job file's key and line, the URL it called), exit 2
for input, 1 at run time, 130 for Ctrl-C; never a traceback, never the API token."""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from services import client_cmd
from services.cli import main
from tests.http_harness import LostReply, serve_app
from tests.test_cli_errors import dead_api

__all__ = ["dead_api"]  # the fixture, used here by name

JOB = {"job_id": "a1", "kind": "train", "state": "running", "reason": None,
       "progress": {"submitted": 2, "completed": 0, "dead_lettered": 0, "cancelled": 0}, "reward_mean": None,
       "accuracy": None}
STATUS = {"run": "r", "version": 0, "trainer": None, "servers": [], "buffer": {}}


@pytest.fixture(autouse=True)
def _no_rollwave_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ROLLWAVE_API", "ROLLWAVE_API_TOKEN", "ROLLWAVE_DEBUG"):
        monkeypatch.delenv(name, raising=False)


def cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """``rollwave ARGV``'s exit code and stderr (argparse's own errors exit through SystemExit)."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def one_error(capsys: pytest.CaptureFixture, argv: list[str], code: int, needle: str) -> str:
    got, err = cli(capsys, *argv)
    lines = err.splitlines()
    assert got == code and len(lines) == 1 and lines[0].startswith("error: "), (got, err)
    assert needle in lines[0], lines[0]
    return lines[0]


def test_values_that_cannot_be_sent_are_named_by_flag_or_by_key_and_line(
    tmp_path: Path, dead_api: str, capsys: pytest.CaptureFixture
) -> None:
    """YAML reads a date, !!binary, .nan or .inf where JSON has no such value, and float() reads "nan" and "inf": each
    is refused before anything is sent, naming the job file's key and line, or the flag."""
    files = {
        "date": ("kind: train\nsource: {kind: arith, limit: 2}\nnotes:\n  created: 2020-01-01\n",
                 "date.yaml:4: notes.created: YAML reads 2020-01-01 as a date, which JSON cannot carry"),
        "nan": ("source: {kind: arith, limit: 2}\nsampling: {temperature: .nan}\n",
                "nan.yaml:2: sampling.temperature: YAML reads nan as a float"),
        "binary": ("tools:\n  - calculator\n  - !!binary aGk=\n",
                   "binary.yaml:3: tools.1: YAML reads b'hi' as a bytes"),
        "date-key": ("source: {kind: arith}\n2020-01-01: x\n", "date-key.yaml:2: 2020-01-01: YAML reads 2020-01-01"),
    }
    for name, (text, needle) in files.items():
        (tmp_path / f"{name}.yaml").write_text(text)
        one_error(capsys, ["submit", "-f", str(tmp_path / f"{name}.yaml"), "--api", dead_api], 2, needle)
    for argv, needle in [
        (["submit", "--temperature", "nan"], "argument --temperature: must be a finite number, got nan"),
        (["submit", "--wait", "--timeout", "nan"], "argument --timeout: must be a finite number above 0, got nan"),
        (["submit", "--wait", "--timeout", "inf"], "argument --timeout: must be a finite number above 0, got inf"),
        (["status", "--watch", "--interval", "inf"], "argument --interval: must be a finite number above 0, got inf"),
        (["rollout", "--task", "arith", "--index", "-1"], "--index must be 0 or more, got -1"),
    ]:
        one_error(capsys, [*argv, "--api", dead_api] if argv[0] != "rollout" else argv, 2, needle)


def test_a_token_a_header_cannot_carry_is_refused_naming_its_source_not_its_value(
    tmp_path: Path, dead_api: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cr3t" * 6
    (tmp_path / "two-lines").write_text(f"{secret}\n{secret}\n")
    (tmp_path / "non-ascii").write_text(f"{secret}é\n")
    for name in ("two-lines", "non-ascii"):
        line = one_error(capsys, ["jobs", "--token-file", str(tmp_path / name), "--api", dead_api], 2,
                         f"--token-file {tmp_path / name}: the token holds a line break, a control or a non-ASCII")
        assert secret not in line
    monkeypatch.setenv("ROLLWAVE_API_TOKEN", f"{secret}\r\n")
    line = one_error(capsys, ["status", "--api", dead_api], 2, "ROLLWAVE_API_TOKEN: the token holds a line break")
    assert secret not in line


class FakeApi:
    """An API that answers each path with the reply set for it; one set to ``interrupt`` first sends Ctrl-C
    (SIGINT) to the main thread, which runs the CLI and is waiting for this reply."""

    def __init__(self) -> None:
        self.replies: dict[str, tuple[int, str, bool]] = {}
        self.app = Starlette(routes=[Route("/{path:path}", self.answer, methods=["GET", "POST", "DELETE"])])

    def set(self, path: str, status: int, body: object, interrupt: bool = False) -> None:
        self.replies[path] = (status, body if isinstance(body, str) else json.dumps(body), interrupt)

    async def answer(self, request: Request) -> Response:
        status, body, interrupt = self.replies[request.url.path]
        if interrupt:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return Response(body, status, media_type="application/json")


@pytest.fixture
def fake_api() -> Iterator[tuple[FakeApi, str]]:
    fake = FakeApi()
    with serve_app(fake.app) as url:
        yield fake, url


def test_api_replies_of_unexpected_shapes_are_one_line_naming_the_call(
    fake_api: tuple[FakeApi, str], capsys: pytest.CaptureFixture
) -> None:
    """A success without what the command reads (another server at --api, another version), or a refusal whose
    ``detail`` is not FastAPI's shape, or is long: one line naming the call, never a KeyError or a TypeError."""
    fake, url = fake_api
    cases = [
        (["status"], "/v1/status", 200, [], 2,
         f"GET {url}/v1/status: HTTP 200, but its JSON has no run, version, trainer, servers, buffer (got [])"),
        (["jobs"], "/v1/jobs", 200, {"items": []}, 2,
         f"GET {url}/v1/jobs?limit=50: HTTP 200, but its JSON has no jobs, next"),
        (["submit", "--limit", "2"], "/v1/jobs", 201, {"job_id": "a1"}, 2,
         f"POST {url}/v1/jobs: HTTP 201, but its JSON has no kind, state, reason, progress"),
        (["jobs", "delete", "a1"], "/v1/jobs/a1", 409, {"detail": ["busy", {"msg": "cancel it first"}]}, 2,
         f"DELETE {url}/v1/jobs/a1: the API answered HTTP 409: busy; body: cancel it first"),
        (["trajectories", "a1"], "/v1/jobs/a1/trajectories", 422, {"detail": [{"loc": None, "msg": "bad cursor"}]}, 2,
         "the API answered HTTP 422: body: bad cursor"),
        (["status"], "/v1/status", 500, {"detail": "x" * 5000}, 1, f"GET {url}/v1/status: the API answered HTTP 500: "),
    ]
    for argv, path, status, body, code, needle in cases:
        fake.set(path, status, body)
        line = one_error(capsys, [*argv, "--api", url], code, needle)
        assert len(line) < 1200, line  # a long detail is cut


def test_ctrl_c_ends_a_wait_with_130_and_a_watch_with_0(
    fake_api: tuple[FakeApi, str], capsys: pytest.CaptureFixture, ctrl_c_raises: None
) -> None:
    """Ctrl-C while ``submit --wait`` waits is exit 130 in one line; ``status --watch`` is left with Ctrl-C, exit 0,
    even when it comes while a refresh waits for the API."""
    assert threading.current_thread() is threading.main_thread()  # SIGINT is raised in the main thread
    fake, url = fake_api
    fake.set("/v1/jobs", 201, JOB)
    fake.set("/v1/jobs/a1", 200, JOB, interrupt=True)
    code, err = cli(capsys, "submit", "--limit", "2", "--wait", "--timeout", "60", "--api", url)
    assert code == 130 and "Traceback" not in err and err.splitlines()[-1] == "error: interrupted", err
    fake.set("/v1/status", 200, STATUS, interrupt=True)
    code, err = cli(capsys, "status", "--watch", "--api", url)
    assert code == 0 and "error" not in err, err


@pytest.fixture
def hung_api() -> Iterator[str]:
    """A 127.0.0.1 port that takes connections (the kernel's backlog) and never answers one."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_an_api_that_never_answers_or_breaks_off_is_named_with_the_call(
    hung_api: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request waits ``API_TIMEOUT_S``, and the error names the API and the call; so does a server that closes
    the connection unanswered. A submit sent again after a lost reply stops once a try ends ``outage_s`` after the
    first failure: a try that waited out its timeout is not followed by one more (a hung API cost three timeouts)."""
    monkeypatch.setattr(client_cmd, "API_TIMEOUT_S", 0.2)
    one_error(capsys, ["status", "--api", hung_api], 1,
              f"the API at {hung_api} did not answer GET {hung_api}/v1/status in time (ReadTimeout)")
    tries = []
    with httpx.Client(base_url=hung_api, timeout=0.2) as client:
        def send() -> httpx.Response:
            tries.append(1)
            return client.post("/v1/jobs", json={})

        with pytest.raises(httpx.ReadTimeout):
            client_cmd._sent_again(send, outage_s=0.1, retry_s=0.01)
    assert len(tries) == 2

    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        server.settimeout(30)  # the thread ends even if the CLI never connects

        def close_one() -> None:  # read the request, close unanswered
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)

        closer = threading.Thread(target=close_one, daemon=True)
        closer.start()
        one_error(capsys, ["status", "--api", url], 1, f"the API at {url} broke off GET {url}/v1/status: Server "
                  "disconnected without sending a response. (RemoteProtocolError)")
        closer.join()


def test_a_wait_rides_out_a_poll_that_gets_no_reply(capsys: pytest.CaptureFixture) -> None:
    """A poll whose reply is lost (the API restarting, a proxy closing the connection) is ridden out as the API's
    503s are: it ended an hours-long ``submit --wait`` with an error while the job ran on."""
    polls: list[str] = []

    async def job(request: Request) -> Response:
        polls.append(request.url.query)
        if len(polls) == 2:
            return LostReply()
        state = "running" if len(polls) == 1 else "done"
        return Response(json.dumps({**JOB, "state": state}), 200, media_type="application/json")

    app = Starlette(routes=[Route("/v1/jobs/a1", job)])
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        assert client_cmd.wait_for_job(client, "a1", timeout_s=60, poll_s=0.05)["state"] == "done"
    assert polls == ["summary=true"] * 3  # progress alone: a job's inline tasks are not read at each poll
