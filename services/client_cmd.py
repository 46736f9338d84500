"""``rollwave submit | status | jobs [delete] | trajectories``: the API from a terminal."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from tqdm import tqdm

from buffer.keys import TRAINER_CRASHED
from core.config import SECRETS, read_yaml
from core.text_files import TextFileError, line_of, read_text, yaml_key_lines
from services.cli import CliError

TOKEN_ENV = SECRETS["api.token"]
API_TIMEOUT_S = 60.0  # how long one request waits for the API: to connect, and then between bytes of its reply
REDIS_OUTAGE_S = 60.0  # how long a wait rides out the API's 503s (its Redis restarting), as the components do
# how long a wait gives a crashed trainer to be restarted and train again: Kubernetes' longest crash back-off
# (LocalStack and the Ray actors restart one after RestartBackoff's delay; the model load and resume come on top)
RESTART_WAIT_S = 300.0
# the failures after which a submit or a delete is sent again: its reply lost (a reset, a timeout), or the API not
# answering a while; a refused connection is only retried after an earlier try failed (before: no API is there, said
# at once)
RESUBMIT_ON = (httpx.NetworkError, httpx.TimeoutException, httpx.RemoteProtocolError)


def _token(args: argparse.Namespace) -> str | None:
    """The API token from ``--token-file``, else the environment: never from the command line, which others can read.
    One that an HTTP header cannot carry (two lines, a non-ASCII character) is refused naming where it came from, never
    its value (httpx's own error would print it)."""
    where = f"--token-file {args.token_file}" if args.token_file else TOKEN_ENV
    if args.token_file:
        try:
            token = read_text(args.token_file).strip()
        except TextFileError as exc:
            raise CliError(f"--token-file {exc}") from None
    else:
        token = os.environ.get(TOKEN_ENV, "")
    if not all(" " <= c <= "~" for c in token):
        raise CliError(f"{where}: the token holds a line break, a control or a non-ASCII character, which an HTTP "
                       "header cannot carry: give the run's api.token alone, on one line")
    return token or None


def _client(args: argparse.Namespace) -> httpx.Client:
    token = _token(args)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=args.api, headers=headers, timeout=API_TIMEOUT_S)


# the keys of the API's replies that the commands read: a reply without one is not the rollwave API's
STATUS_KEYS = ("run", "version", "trainer", "servers", "buffer")
JOB_KEYS = ("job_id", "kind", "state", "reason", "progress", "reward_mean", "accuracy")
JOBS_PAGE_KEYS, TRAJECTORIES_PAGE_KEYS, DELETED_KEYS = ("jobs", "next"), ("items", "next"), ("job_id", "kind")


def _get(client: httpx.Client, path: str, keys: tuple[str, ...], **params: Any) -> Any:
    return _json(client.get(path, params=params), keys=keys)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refused_field(error: Any, where: Callable[[list[Any]], str]) -> str:
    """One entry of a 422's ``detail``: ``field: msg`` for FastAPI's shape (``loc`` starts with where the field was:
    body, query), any other entry as it is."""
    if not isinstance(error, dict):
        return str(error)
    loc = error["loc"][1:] if isinstance(error.get("loc"), list) else []
    return f"{where(loc)}{'.'.join(str(p) for p in loc) or 'body'}: {error.get('msg', error)}"


def _json(
    reply: httpx.Response, where: Callable[[list[Any]], str] = lambda _loc: "", keys: tuple[str, ...] = ()
) -> Any:
    """The reply's body, or a CliError naming the call (its whole URL: which API answered) and what the API refused
    (exit 2 for 4xx, 1 for 5xx), or that a success carried no JSON object with the ``keys`` the command reads (exit 2:
    --api is some other server); ``where`` gives the ``file:line: `` of a refused field's location in the body (a job
    file's)."""
    status, what = reply.status_code, f"{reply.request.method} {reply.request.url}"
    if status < 400:
        try:
            body = reply.json()
        except ValueError:
            kind = reply.headers.get("content-type", "no content type")
            raise CliError(f"{what}: HTTP {status} with no JSON ({kind}): is --api the rollwave API?") from None
        if missing := [key for key in keys if not isinstance(body, dict) or key not in body]:
            raise CliError(f"{what}: HTTP {status}, but its JSON has no {', '.join(missing)} (got "
                           f"{_clip(reply.text, 100)}): is --api the rollwave API, of this version?")
        return body
    try:
        body = reply.json()
    except ValueError:  # not the rollwave API, or a proxy in front of it
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, list):  # FastAPI's validation errors: name each field
        detail = "; ".join(_refused_field(e, where) for e in detail)
    detail = _clip(str(detail), 1000) if detail is not None else _clip(reply.text, 200) or reply.reason_phrase
    hint = {
        401: f" (give the run's api.token in {TOKEN_ENV} or --token-file)",
        404: " (`rollwave jobs` lists the jobs; is --api the rollwave API?)",
        422: " (fix that field)",
    }.get(status, "")
    raise CliError(f"{what}: the API answered HTTP {status}: {detail}{hint}", 2 if status < 500 else 1)


# the flags that set a key of the job body (dotted)
JOB_FLAGS = (("source", "source.kind"), ("path", "source.path"), ("split", "source.split"), ("limit", "source.limit"),
             ("seed", "source.seed"), ("kind", "kind"), ("n", "n_samples"), ("max_turns", "max_turns"),
             ("reward", "reward"), ("temperature", "sampling.temperature"), ("tools", "tools"))


def job_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The job body: a YAML file's, with any flags given laid over it."""
    body: dict[str, Any] = {}
    if args.file:
        loaded = read_yaml(Path(args.file), "job file")
        if not isinstance(loaded, dict):
            raise CliError(f"{args.file}: a job file must be a mapping (the body of POST /v1/jobs)")
        for key in ("source", "sampling"):  # mappings in the body, which the flags below set keys in
            if key in loaded and not isinstance(loaded[key], dict):
                line = line_of(yaml_key_lines(args.file), [key])
                raise CliError(f"{args.file}:{line}: {key} must be a mapping, got {_clip(repr(loaded[key]), 60)}")
        if (unsent := _not_json(loaded)) is not None:
            loc, value = unsent
            line = line_of(yaml_key_lines(args.file), loc)
            raise CliError(f"{args.file}:{line}: {'.'.join(loc)}: YAML reads {_clip(str(value), 60)} as a "
                           f"{type(value).__name__}, which JSON cannot carry (quote it to send it as text)")
        body = loaded
    body.setdefault("source", {})
    for flag, key in JOB_FLAGS:
        if (value := getattr(args, flag)) is not None:
            *parents, leaf = key.split(".")
            target = body
            for part in parents:
                target = target.setdefault(part, {})
            target[leaf] = value
    return body


def _not_json(value: Any, loc: tuple[str, ...] = ()) -> tuple[tuple[str, ...], Any] | None:
    """Where in a job file's content the first value (or key) is that JSON cannot carry, and that value; else None."""
    if isinstance(value, list):
        value = dict(enumerate(value))
    if isinstance(value, dict):
        for key, item in value.items():
            if found := _not_json(key, (*loc, str(key))) or _not_json(item, (*loc, str(key))):
                return found
        return None
    if value is None or isinstance(value, str | int) or isinstance(value, float) and math.isfinite(value):
        return None
    return loc, value


def _job_file_lines(args: argparse.Namespace) -> Callable[[list[Any]], str]:
    """``file:line: `` of a field of the job body that the job file set (not a flag), else nothing."""
    if not args.file:
        return lambda _loc: ""
    lines = yaml_key_lines(args.file)
    flagged = [key for flag, key in JOB_FLAGS if getattr(args, flag) is not None]

    def where(loc: list[Any]) -> str:
        dotted = ".".join(map(str, loc))
        if any(f"{dotted}.".startswith(f"{key}.") for key in flagged):
            return ""
        line = line_of(lines, loc)
        return f"{args.file}:{line}: " if line is not None else ""

    return where


def submit(args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.wait:
        raise CliError("--timeout is how long --wait waits: give --wait too")
    with _client(args) as client:
        job = post_job(client, job_from_args(args), _job_file_lines(args))
        print(f"job {job['job_id']} ({job['kind']}): {job['progress']['submitted']} tasks")
        if args.wait:
            job = wait_for_job(client, job["job_id"], args.timeout)
            print(json.dumps({k: job[k] for k in ("job_id", "state", "progress", "reward_mean", "accuracy")}))
            if job["state"] == "cancelled":  # not done: a script must not take its partial results for the job's
                raise CliError(f"job {job['job_id']} was cancelled while --wait waited ({job['progress']['completed']} "
                               f"of its {job['progress']['submitted']} tasks rolled out): its results are partial", 1)
    return 0


def post_job(client: httpx.Client, body: dict[str, Any], where: Callable[[list[Any]], str] = lambda _loc: "",
             outage_s: float = REDIS_OUTAGE_S, retry_s: float = 1.0) -> dict[str, Any]:
    """POST /v1/jobs under an Idempotency-Key of its own, sent again with the same key every ``retry_s`` while the
    reply is lost (a connection reset, a timeout) or the API answers 503 (its Redis restarting), for up to
    ``outage_s`` after the first failure: a try the API did take is answered with its job, never made twice."""
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    reply, _ = _sent_again(lambda: client.post("/v1/jobs", json=body, headers=headers), outage_s, retry_s)
    return _json(reply, where, JOB_KEYS)


def _sent_again(send: Callable[[], httpx.Response], outage_s: float, retry_s: float) -> tuple[httpx.Response, bool]:
    """``send()``'s reply, sent again every ``retry_s`` while its reply is lost (a connection reset, a timeout) or the
    API answers 503, for up to ``outage_s`` after the first failure; and whether it was sent more than once (an
    earlier try may have done what it asked)."""
    failing_since: float | None = None
    sent_again = False
    while True:
        try:
            reply = send()
        except RESUBMIT_ON as exc:
            if failing_since is None and isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                raise
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since >= outage_s:  # judged as the try ends: one that began in time and
                raise  # waited out its timeout is the last, not followed by one more (a timeout's worth over)
        else:
            failing_since = failing_since or time.monotonic()
            if reply.status_code != 503 or time.monotonic() - failing_since >= outage_s:
                return reply, sent_again
        time.sleep(retry_s)
        sent_again = True


def _trainer_crashed(client: httpx.Client) -> bool:
    """The run's trainer crashed (its end says so) rather than ended, or was killed without recording its end: it
    kept a lease and let it lapse (the API reads that as a crash too, ``cluster.LEASE_LAPSED``)."""
    trainer = _get(client, "/v1/status", STATUS_KEYS)["trainer"] or {}
    if "finished_reason" in trainer:
        return str(trainer["finished_reason"]).startswith(TRAINER_CRASHED)
    return bool(trainer.get("leased")) and not trainer.get("alive")


def wait_for_job(client: httpx.Client, job_id: str, timeout_s: float | None = None, poll_s: float = 1.0,
                 outage_s: float = REDIS_OUTAGE_S, restart_wait_s: float = RESTART_WAIT_S) -> dict[str, Any]:
    """Poll until the job is done or cancelled, with a progress bar of finished tasks; ``TimeoutError`` once
    ``timeout_s`` passed (None: as long as the job runs); a ``CliError`` (exit 1) saying why as soon as the job
    is ``stalled`` by a trainer that finished with groups of this train job left (waiting longer cannot help), or
    once it has been stalled ``restart_wait_s`` by a trainer that crashed (a supervisor restarts that one, and the
    job runs on once the restart trains: meanwhile the wait says why it waits), or once the job is deleted. The API
    answers 503 while its Redis is away (a restart): polls keep the last progress through ``outage_s`` of those (the
    first poll waits them out), and of polls that get no reply (the API itself restarting, a reply lost). No poll
    waits past ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    path = f"{_job_path(job_id)}?summary=true"  # progress only: not the inline tasks, at each poll
    first_outage_s = outage_s if timeout_s is None else min(outage_s, timeout_s)  # the first poll's 503s too

    def poll() -> httpx.Response:
        """One poll, never waiting past the deadline (nor past ``API_TIMEOUT_S``: the client's own may be longer)."""
        left = API_TIMEOUT_S if deadline is None else max(0.1, min(API_TIMEOUT_S, deadline - time.monotonic()))
        return client.get(path, timeout=left)

    job = _json(_sent_again(poll, first_outage_s, poll_s)[0], keys=JOB_KEYS)
    outage_since: float | None = None
    crashed_since: float | None = None
    with tqdm(total=job["progress"]["submitted"], desc=f"job {job_id}", unit="task") as bar:
        while True:
            p = job["progress"]
            bar.n = p["completed"] + p["dead_lettered"] + p["cancelled"]
            bar.set_postfix(reward=job["reward_mean"])
            bar.refresh()
            if job["state"] in ("done", "cancelled"):
                return job
            if job["state"] != "stalled":
                crashed_since = None
            elif crashed_since is None and _trainer_crashed(client):
                crashed_since = time.monotonic()
                bar.write(f"job {job_id} is stalled: {job['reason']}; waiting up to {restart_wait_s:g} s for the "
                          "trainer to be restarted")
            elif crashed_since is None or time.monotonic() - crashed_since >= restart_wait_s:
                waited = "" if crashed_since is None else f" (no trainer took it up within {restart_wait_s:g} s)"
                raise CliError(f"job {job_id} at {client.base_url} is stalled: {job['reason']}{waited}", 1)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} at {client.base_url}: still {job['state']} after {timeout_s:g} s, "
                                   f"{bar.n} of {p['submitted']} tasks finished (is a rollout server up? see "
                                   "rollwave status)")
            time.sleep(poll_s)
            try:
                reply = poll()
            except RESUBMIT_ON:  # a lost reply, the API restarting: ridden out as its 503s are
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since < outage_s or deadline is not None and \
                        time.monotonic() >= deadline:  # the deadline's own error says more
                    continue
                raise
            if reply.status_code == 503:
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since < outage_s:
                    continue
            outage_since = None
            if reply.status_code == 404:  # it was there: no mistake in the input, and no hint to list the jobs
                raise CliError(f"job {job_id} at {client.base_url} was deleted while the wait polled it (last seen "
                               f"{job['state']}, {bar.n} of {p['submitted']} tasks finished)", 1)
            job = _json(reply, keys=JOB_KEYS)


def _job_rows(jobs: list[dict[str, Any]]) -> list[str]:
    rows = [f"{'JOB':14} {'KIND':6} {'STATE':10} {'DONE':>11} {'DEAD':>5} {'TRAINED':>8} {'REWARD':>7} {'ACC':>6}"]
    for j in jobs:
        p = j["progress"]
        reward = "-" if j["reward_mean"] is None else f"{j['reward_mean']:.3f}"
        acc = "-" if j["accuracy"] is None else f"{j['accuracy']:.3f}"
        done = f"{p['completed']}/{p['submitted']}"
        rows.append(
            f"{j['job_id']:14} {j['kind']:6} {j['state']:10} {done:>11} {p['dead_lettered']:>5} "
            f"{p['trained']:>8} {reward:>7} {acc:>6}"
        )
    return rows


def jobs(args: argparse.Namespace) -> int:
    """A page of jobs, newest first; ``--all`` follows the pages to the oldest."""
    with _client(args) as client:
        page = _get(client, "/v1/jobs", JOBS_PAGE_KEYS, limit=args.limit)
        listed = page["jobs"]
        while args.all and page["next"]:
            page = _get(client, "/v1/jobs", JOBS_PAGE_KEYS, cursor=page["next"], limit=args.limit)
            listed += page["jobs"]
        print("\n".join(_job_rows(listed)))
        if page["next"]:
            print(f"(more: rollwave jobs --all, or --limit above {args.limit})")
    return 0


def _job_path(job: str) -> str:
    """``/v1/jobs/<job>``, the id one path segment as typed: escaped, and ``.`` and ``..`` too, which a URL reads as
    "here" and "up" (``rollwave jobs cancel .`` asked about ``POST /v1/jobs/cancel``)."""
    segment = quote(job, safe="")
    return f"/v1/jobs/{segment.replace('.', '%2E') if segment in ('.', '..') else segment}"


def delete_job(args: argparse.Namespace) -> int:
    """``DELETE /v1/jobs/{job}``, sent again while its reply is lost or the API answers 503, as a submit is: a 404 to
    a try sent again means that an earlier one, whose answer never came, deleted the job (said so); to the first,
    that there is no such job (exit 2)."""
    with _client(args) as client:
        path = _job_path(args.job)
        reply, retried = _sent_again(lambda: client.delete(path), REDIS_OUTAGE_S, 1.0)
        if retried and reply.status_code == 404:
            print(f"job {args.job} deleted (by an earlier try, whose reply was lost or a 503: this one found it gone)")
            return 0
        deleted = _json(reply, keys=DELETED_KEYS)
        print(f"job {deleted['job_id']} ({deleted['kind']}) deleted")
    return 0


def cancel_job(args: argparse.Namespace) -> int:
    """``POST /v1/jobs/{job}/cancel``, sent again while its reply is lost or the API answers 503 (a cancelled job
    reads as it is: a cancel sent again cancels nothing twice); then what is left of it, and how to delete it."""
    with _client(args) as client:
        path = f"{_job_path(args.job)}/cancel"
        job = _json(_sent_again(lambda: client.post(path), REDIS_OUTAGE_S, 1.0)[0], keys=JOB_KEYS)
        print(f"job {job['job_id']} ({job['kind']}) {job['state']}: its tasks not rolled out yet and groups not "
              f"trained are acked away untrained; `rollwave jobs delete {job['job_id']}` deletes it")
    return 0


def _last_push(push: dict[str, Any] | None) -> str:
    if push is None:
        return "-"
    if push["ok"]:
        return f"v{push['version']} ok"
    return f"v{push['version']} FAILED {push['stage']}/{push['reason']}"


def _status_table(status: dict[str, Any]) -> str:
    lines = [f"run {status['run']}   policy version {status['version']} (published)"]
    trainer = status["trainer"] or {}
    finished = f"  finished at step {trainer['finished_step']} ({trainer['finished_reason']})" \
        if "finished_step" in trainer else ""
    if not finished and trainer.get("leased") and not trainer.get("alive"):
        finished = "  NOT RUNNING: its lease lapsed with no end recorded (killed?)"
    lines.append(f"trainer: step {trainer.get('step', '-')}  version {trainer.get('version', '-')}  "
                 f"pushed {trainer.get('pushed_version', '-')}{finished}")
    lines.append(f"{'SERVER':14} {'ALIVE':6} {'VERSION':>8} {'BEAT AGE':>9}  {'LAST PUSH':28} ENGINE")
    for s in status["servers"]:
        age = f"{s['heartbeat_age_s']:.1f}s"
        push = _last_push(s["last_push"])
        lines.append(f"{s['server_id']:14} {str(s['alive']):6} {s['version']:>8} {age:>9}  {push:28} "
                     f"{s['engine_url']}")
    stragglers = [s for s in status["servers"] if s["straggler"]]
    for s in stragglers:
        lines.append(f"straggler {s['server_id']}: serves v{s['last_push']['serves']}, last push failed: "
                     f"{s['last_push']['error']}")
    depths = [f"{k} {v['length']} ({v['pending']} pending)" for k, v in status["buffer"].items()]
    lines.append("buffer: " + "  ".join(depths))
    return "\n".join(lines)


def status(args: argparse.Namespace) -> int:
    """One table, or with ``--watch`` a table redrawn until Ctrl-C (the way to leave it, so exit 0, whether it comes
    between refreshes or during one)."""
    with _client(args) as client:
        if not args.watch:
            print(_status_table(_get(client, "/v1/status", STATUS_KEYS)))
            return 0
        try:
            while True:
                table = _status_table(_get(client, "/v1/status", STATUS_KEYS))
                sys.stdout.write("\x1b[2J\x1b[H" + table + "\n")
                sys.stdout.flush()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


def trajectories(args: argparse.Namespace) -> int:
    with _client(args) as client:
        cursor = ""
        while True:
            page = _get(client, f"{_job_path(args.job)}/trajectories", TRAJECTORIES_PAGE_KEYS,
                        cursor=cursor, limit=args.limit)
            for item in page["items"]:
                print(json.dumps(item) if args.json else _format_trajectory(item))
            cursor = page["next"]
            if not cursor or not args.all:
                return 0


# the control characters but tab and line feed (C0, DEL and C1), each as its escape: a trajectory holds what the model
# wrote and what a job's submitter sent, and an escape sequence among it drove the terminal of whoever read it
TERMINAL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(9), *range(11, 32), *range(127, 160))}


def _format_trajectory(item: dict[str, Any]) -> str:
    lines = [f"── {item['group_id']} sample {item['sample_index']}: reward {item['reward']} ({item['finish_reason']})"]
    for m in item["messages"]:
        content = m.get("content") or ""
        calls = m.get("tool_calls") or []
        lines.append(f"  [{m['role']}] {content}".rstrip())
        lines += [f"    → {c['function']['name']}({json.dumps(c['function']['arguments'])})" for c in calls]
    return "\n".join(lines).translate(TERMINAL_ESCAPES)
