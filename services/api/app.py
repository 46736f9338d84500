"""``create_app(config)``: the FastAPI app under ``/v1`` with its lifespan (Redis, the metrics sampler).

Bounded and guarded: ``/v1`` needs ``api.token`` (a bind off loopback refuses to start without one),
checked before any body is read; requests must name an allowed Host (``api.allowed_hosts``, against DNS
rebinding; the unauthenticated ops probes are exempt, kubelet and Prometheus reach them by pod IP); bodies
over ``api.max_body_bytes`` get 413; a write from a browser page of another origin gets 403 (a loopback API may
have no token, and a page may POST to it); jobs read files only under ``api.data_root``, hold at most
``api.max_job_tasks`` tasks, name reward functions, agents and tools the run allows, set nothing this run cannot
honour (``_inapplicable``), and give each tool a task gets the create kwargs it requires; a train job submitted
once the run's trainer finished gets 409 (nothing would train it; once it crashed one is taken: its restart trains
it), and so do the cancel of a job that is done and the delete of one that is not (``DELETE /v1/jobs/{id}`` removes
a finished job and all the run keeps of it). A submit may carry an ``Idempotency-Key`` header: a retry with the
same key and spec is answered with the job the first one made (200, ``Idempotent-Replayed: true``, no new tasks,
counted), the key with another spec gets 422 naming the header. Each refusal is logged and counted. While Redis is
away or stuck a request is answered 503 naming it within about ``redis.timeout_s``: the API does not ride out the
outage the other components do. A ``/v1`` route refuses a query parameter it does not take, or one given twice (422
naming it), a submit refuses a body not sent as JSON (415 naming the Content-Type), and a URL or method the API does
not serve is a JSON 404 or 405 naming the request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Protocol
from urllib.parse import urlsplit

import pydantic_core
import redis
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.dependencies.models import Dependant
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import SecretStr
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from buffer.keys import Keys
from buffer.redis_server import connect, shorten_outage_retries
from buffer.registry import ServerRegistry
from buffer.task_queue import IDEMPOTENCY_TTL_S, IdempotencyKeyUsed, TaskQueue
from core.config import Config, ConfigError, require_secret
from core.jobs import JobSpec
from core.net import guarded_http, is_loopback
from core.rewards import BUILTIN as BUILTIN_REWARDS
from core.tasks import Task
from core.text_files import json_path, lone_surrogate_at
from rollout_server.tools.registry import ToolConfigError, tool_requirements
from services.api.cluster import ClusterView, InvalidCursor, NotCancellable, NotDeletable, NotFound
from services.api.sampler import MetricsSampler

STATIC = Path(__file__).resolve().parent.parent / "static"
OPS_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
IDEMPOTENCY_KEY = "Idempotency-Key"
_CONTROL_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 127)}
# characters of a refusal's detail that are logged: it may quote what the client sent (a name, every error of 10,000
# inline tasks), up to the whole body
LOGGED_DETAIL_CHARS = 2000
# objects and lists within each other in a field of an inline task: the stored spec holds the field 4 levels down, and
# the rollout servers read that spec with pydantic's JSON parser, which stops at 200 levels (its serializer at 255)
MAX_TASK_NESTING = 100
# the dashboard's page and files: the page runs its own script and reads its own API only (job text that reached the
# DOM as HTML could load and send nothing), is never framed by another site's page (its token form), and no file of
# it is read as another type than it is served as, nor used from a cache unchecked (the page of one version with the
# script of another, after an upgrade)
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
log = logging.getLogger(__name__)


class Refuse(Protocol):
    """Logs a refused request with the reason (and what was wrong) and counts it by reason."""

    def __call__(self, reason: str, scope: Scope, detail: str = "") -> None: ...


def check_api_config(cfg: Config) -> None:
    """An API reachable from other hosts must have a token: ConfigError when it would bind off loopback without,
    or when the config holds a masked token given nowhere else (never run without the token an operator set)."""
    if cfg.masked_unset("api.token"):
        require_secret(cfg, "api.token")
    if cfg.api.token is None and not is_loopback(cfg.api.host):
        raise ConfigError(
            f"api.token is not set and api.host={cfg.api.host} is not loopback: anyone who reaches it could submit "
            "jobs; set ROLLWAVE_API_TOKEN or api.token_file, or bind 127.0.0.1"
        )


def _unmet_create_kwargs(spec: JobSpec, tasks: list[Task], requires: dict[str, tuple[str, ...] | None]) -> str | None:
    """Why a task cannot start a tool it will get, or None: its every episode would fail at the tool's create and
    the task be dead-lettered. A job's ``tools`` replace each task's own, never its ``tools_kwargs``; ``requires``
    maps each tool to its ``create_requires`` (None: not known here)."""
    replaced = "; the job's tools replace the task's tools, not its tools_kwargs" if spec.tools is not None else ""
    for i, task in enumerate(tasks):
        if spec.source.kind == "inline":
            at = f"source.tasks[{i}]"
        elif "file" in task.meta and "line" in task.meta:  # a row of a file, named as its load errors name it
            at = f"{task.meta['file']}:{task.meta['line']}"
        else:
            at = f"task {task.task_id!r}"
        for name in spec.tools if spec.tools is not None else task.tools:
            label = f"tools_kwargs.{name}.create_kwargs"
            given = task.tools_kwargs.get(name, {}).get("create_kwargs", {})
            if not isinstance(given, dict):
                return f"{at}: field '{label}' must be dict, got {type(given).__name__}"
            if missing := [key for key in requires.get(name) or () if key not in given]:
                return f"{at}: tool {name} needs create_kwargs {', '.join(missing)} ({label}){replaced}"
    return None


def _nesting(value: Any) -> int:
    """How many objects and lists ``value`` holds within each other (a scalar: 0); counted without recursion, as a
    body may nest as deep as Python's JSON parser goes."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _unstorable(spec: JobSpec) -> str | None:
    """Why an inline task cannot be stored, or None: a free-form field nested deeper than ``MAX_TASK_NESTING``, or
    a string (or key) in one holding a lone UTF-16 surrogate (the typed fields refuse one). The spec could not be
    written as JSON (a 500) or, stored, not be read back by the rollout servers (every task failed)."""
    for i, task in enumerate(spec.source.tasks or ()):
        for name in ("messages", "tools_kwargs", "reward", "meta"):
            value = getattr(task, name)
            if (depth := _nesting(value)) > MAX_TASK_NESTING:
                return (f"field 'source.tasks[{i}].{name}' holds objects and lists {depth} levels within each other; "
                        f"at most {MAX_TASK_NESTING}")
            if (at := lone_surrogate_at(value)) is not None:
                where = _escape(json_path((f"source.tasks[{i}].{name}", *at)))
                return (f"field '{where}' holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape not paired as JSON "
                        "writes a character outside the BMP), which is no character: no UTF-8 text can hold it")
    return None


def _named_twice(names: list[str]) -> str | None:
    """Why a job's ``tools`` cannot replace its tasks' own, or None: an episode makes one instance of each tool
    named, and a second of one name would never be released (a task's own list is refused so too)."""
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            return f"field 'tools[{i}]': tool {name!r} is named twice (first at tools[{first[name]}])"
        first[name] = i
    return None


def _query_names(dependant: Dependant) -> set[str]:
    """The query parameters a route (its endpoint and dependencies) declares."""
    return {field.alias for field in dependant.query_params}.union(*map(_query_names, dependant.dependencies))


def _inapplicable(spec: JobSpec, cfg: Config) -> tuple[str, str] | None:
    """A setting of the job that this run could not honour, as (dotted field, why), or None: refused, where the
    rollout servers would drop it without a word."""
    if spec.agent is not None and spec.max_turns is not None:
        return "max_turns", ("an agent job's agent decides how many turns it takes (rollout.max_total_tokens and "
                             "rollout.agent_timeout_s bound an episode): max_turns applies to the built-in loop only")
    max_new, total = spec.sampling.max_new_tokens, cfg.rollout.max_total_tokens
    if max_new is not None and max_new >= total:
        return "sampling.max_new_tokens", (f"{max_new} tokens a turn can never be generated: "
                                           f"rollout.max_total_tokens={total} bounds the prompt and all turns together")
    if spec.kind == "train" and spec.n_samples == 1 and cfg.trainer.advantage != "gae":
        return "n_samples", (f"a group of 1 sample has advantage 0 under trainer.advantage={cfg.trainer.advantage} "
                             "(its baseline is the group's other samples), so the job would train on no reward; "
                             "give 2 or more, or kind=eval")
    return None


class ApiState:
    """What the routes share: the Redis client, the run's keys, the queue and the cluster view."""

    def __init__(self, cfg: Config, client: redis.Redis, registry: CollectorRegistry, refused: Counter) -> None:
        self.cfg = cfg
        self.redis = client
        self.keys = Keys(cfg.run.name)
        self.queue = TaskQueue(client, self.keys, cfg.buffer)
        self.cluster = ClusterView(client, self.keys, ServerRegistry(client, self.keys), self.queue)
        self.sampler = MetricsSampler(self.cluster)
        self.registry = registry
        self.refused = refused
        self.jobs_submitted = Counter(
            "rollwave_api_jobs_submitted_total", "Jobs accepted", ["kind"], registry=self.registry
        )
        self.jobs_rejected = Counter("rollwave_api_jobs_rejected_total", "Jobs rejected", registry=self.registry)
        self.jobs_deleted = Counter(
            "rollwave_api_jobs_deleted_total", "Finished jobs deleted", ["kind"], registry=self.registry
        )
        self.jobs_replayed = Counter("rollwave_api_jobs_replayed_total", "Job submits answered with the job an "
                                     "earlier submit with their Idempotency-Key made", registry=self.registry)


def _state(request: Request) -> ApiState:
    return request.app.state.api


def _one_line(text: str) -> str:
    """``text`` with its control characters escaped: a client's path (``%0a`` decodes to a newline) or field name
    must not forge log lines or drive the operator's terminal."""
    return text.translate(_CONTROL_ESCAPES)


def _refused(counter: Counter) -> Refuse:
    def refuse(reason: str, scope: Scope, detail: str = "") -> None:
        client = scope.get("client") or ("?", 0)
        if len(detail) > LOGGED_DETAIL_CHARS:
            detail = f"{detail[:LOGGED_DETAIL_CHARS]}... ({len(detail) - LOGGED_DETAIL_CHARS} more characters)"
        log.warning("refused %s %s from %s: %s%s", scope.get("method"), _one_line(scope.get("path", "")), client[0],
                    reason, f": {_one_line(detail)}" if detail else "")
        counter.labels(reason=reason).inc()

    return refuse


def _validation_body(exc: RequestValidationError) -> bytes:
    """FastAPI's 422 body, also where an input cannot go into JSON as it is: NaN and infinities (which Python's JSON
    parser takes) are written as strings, lone surrogates as their escapes, and an input nested deeper than
    ``MAX_TASK_NESTING`` (the serializer stops at 255 levels) is named, not echoed. FastAPI's own handler raised on
    them, and the client got a 500. (A body that is not JSON, whose bytes it could not write either, is refused before
    it is validated: ``json_body``.)"""
    return b'{"detail":[' + b",".join(map(_error_json, exc.errors())) + b"]}"


def _error_json(error: dict[str, Any]) -> bytes:
    """One validation error as JSON (``_validation_body``)."""
    try:
        return pydantic_core.to_json(error, inf_nan_mode="strings", fallback=str)
    except pydantic_core.PydanticSerializationError:  # a lone surrogate in it, or an input nested past the limit
        error = _escaped(error)
        if (depth := _nesting(error.get("input"))) > MAX_TASK_NESTING:
            error["input"] = f"(not echoed: objects and lists {depth} levels within each other)"
        return pydantic_core.to_json(error, inf_nan_mode="strings", fallback=lambda v: _escape(str(v)))


def _escape(text: str) -> str:
    """``text`` with each lone UTF-16 surrogate written as its escape (``\\ud800``): JSON's ``"\\ud800"`` reads as
    one (Python's parser takes it), and no UTF-8 can carry it, so a reply or a stored spec holding it cannot be
    written."""
    return text.encode("utf-8", "backslashreplace").decode()


def _escaped(value: Any) -> Any:
    """A copy of ``value`` with every string and key ``_escape``d; copied without recursion, as a body may nest as deep
    as Python's JSON parser goes."""
    root = [value]
    stack: list[tuple[Any, Any, Any]] = [(root, 0, value)]
    while stack:
        parent, at, item = stack.pop()
        if isinstance(item, str):
            parent[at] = _escape(item)
        elif isinstance(item, dict):
            parent[at] = copy = {_escape(k) if isinstance(k, str) else k: v for k, v in item.items()}
            stack.extend((copy, k, v) for k, v in copy.items())
        elif isinstance(item, list | tuple):
            parent[at] = copy = list(item)
            stack.extend((copy, i, v) for i, v in enumerate(copy))
    return root[0]


class HostGuard:
    """Starlette's TrustedHostMiddleware on every path but the ops probes, then no write from another origin: a web
    page can POST to a loopback API that has no token (a form, a no-cors fetch), and its browser names the page's
    origin. Refusals (400, 403) are counted."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str], refuse: Refuse) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPS_PATHS:
            await self.app(scope, receive, send)
            return
        passed = False

        async def inner(scope: Scope, receive: Receive, send: Send) -> None:
            nonlocal passed
            passed = True
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if scope["method"] in READ_METHODS or origin is None or \
                    urlsplit(origin).netloc.lower() == headers.get("host", "").lower():
                await self.app(scope, receive, send)
                return
            self.refuse("origin", scope, origin)
            detail = f"a write from a page of another origin ({origin}) is refused; send it without an Origin header"
            await JSONResponse({"detail": detail}, status_code=403)(scope, receive, send)

        await TrustedHostMiddleware(inner, allowed_hosts=self.allowed_hosts)(scope, receive, send)
        if not passed:
            self.refuse("host", scope)


class TokenGuard:
    """401 for a ``/v1`` request without the bearer token, before anything reads its body: a stranger's malformed
    or oversized body is refused as unauthenticated, never parsed, and never counts as a rejected job."""

    def __init__(self, app: ASGIApp, token: SecretStr | None, refuse: Refuse) -> None:
        self.app = app
        self.token = None if token is None else token.get_secret_value().encode()  # None: loopback only
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.token is None or scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        scheme, _, given = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and given and secrets.compare_digest(given.encode(), self.token):
            await self.app(scope, receive, send)
            return
        self.refuse("auth", scope)
        reply = JSONResponse({"detail": "missing or wrong bearer token"}, 401, {"WWW-Authenticate": "Bearer"})
        await reply(scope, receive, send)


class BodyLimit:
    """413 for a request body over ``max_bytes``: by its Content-Length up front, or counted as it streams in; 408 for
    one not all in ``timeout_s`` after the app first reads it (a client that stalls or trickles it, each byte within
    any idle timeout, held a connection and its task for ever)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, refuse: Refuse) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            self.refuse("body_size", scope)
            await JSONResponse({"detail": self._detail}, status_code=413)(scope, receive, send)
            return
        received, deadline, whole = 0, None, False

        async def counted() -> Message:
            nonlocal received, deadline, whole
            if whole:  # then only the disconnect is awaited, for as long as a response streams
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + self.timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                self.refuse("body_timeout", scope)
                raise HTTPException(408, f"request body not received in {self.timeout_s:g} s "
                                         f"(api.body_timeout_s): {received} bytes came") from None
            whole = message["type"] != "http.request" or not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI passes an HTTPException from the body read through
                    self.refuse("body_size", scope)
                    raise HTTPException(413, self._detail)
            return message

        await self.app(scope, counted, send)

    @property
    def _detail(self) -> str:
        return f"request body over {self.max_bytes} bytes (api.max_body_bytes)"


class NoSniff:
    """``X-Content-Type-Options: nosniff`` on every reply, the guards' refusals and the 500 of an unexpected error
    included (``Api``): a JSON reply may quote what a client sent (a job's name), and no browser may read it as HTML
    or a script. uvicorn's own replies carry ``HEADERS`` too (``guarded_http``)."""

    HEADERS = {"X-Content-Type-Options": "nosniff"}

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_nosniff(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(self.HEADERS)
            await send(message)

        await self.app(scope, receive, send_nosniff)


class Api(FastAPI):
    """FastAPI with ``NoSniff`` around all of its middleware: one added with ``add_middleware`` sits inside Starlette's
    ServerErrorMiddleware, whose 500 for a handler's unexpected exception went out without its headers."""

    def build_middleware_stack(self) -> ASGIApp:
        return NoSniff(super().build_middleware_stack())


class PageFiles(StaticFiles):
    """The dashboard's files, each with ``PAGE_HEADERS``. ``/static/index.html`` sends the browser to the page at
    ``/`` (``../``, so under a proxy's path prefix too): the page names its files and API calls relative to itself, and
    from ``/static/`` they were ``/static/static/app.js`` and ``/static/v1/status``."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        if scope["method"] not in ("GET", "HEAD"):  # as StaticFiles refuses it, saying what it serves
            raise StarletteHTTPException(405, headers={"Allow": "GET, HEAD"})
        if path == "index.html":
            return RedirectResponse("../", status_code=307, headers=PAGE_HEADERS)
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


State = Annotated[ApiState, Depends(_state)]


def create_app(cfg: Config, client: redis.Redis | None = None, url: str | None = None) -> FastAPI:
    """The API for one run. Without ``client`` it connects per ``cfg.redis`` (embedded Redis if no URL).

    ``url``, where this API is served, is published under ``Keys.api``: with ``api.port=0`` that is how
    the launcher that started it finds it.
    """
    check_api_config(cfg)
    try:  # the tools a job may name and the create kwargs each needs; only the rollout servers build them
        tools: dict[str, tuple[str, ...] | None] | None = tool_requirements(cfg.rollout.tools)
    except ToolConfigError as exc:
        log.warning("cannot read rollout.tools here (%s): jobs' tools are checked by the rollout servers", exc)
        tools = None
    registry = CollectorRegistry()
    refused = Counter(
        "rollwave_api_requests_refused_total",
        "Requests refused (auth, host, origin, body_size, body_timeout, content_type, validation, cursor, not_found, "
        "route, method, trainer_finished, not_cancellable, not_deletable, idempotency_key, redis, bad_http, "
        "header_size)",
        ["reason"],
        registry=registry,
    )
    refuse = _refused(refused)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        owned = None
        conn = client
        if conn is None:
            conn, owned = connect(cfg.redis, cfg.run.path)
        api = ApiState(cfg, conn, registry, refused)
        api.queue.ensure_groups()
        if url is not None:
            conn.hset(api.keys.api, mapping={"url": url, "pid": os.getpid()})
        shorten_outage_retries(conn, cfg.redis.timeout_s)  # started (Redis rode out meanwhile): requests next
        app.state.api = api
        sampler = asyncio.create_task(api.sampler.run())
        try:
            yield
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            if owned is not None:
                owned.stop()

    # no /docs or /redoc: their pages load scripts from a CDN, on the origin whose localStorage keeps the
    # dashboard's token; /openapi.json serves the schema
    app = Api(title="rollwave", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(NotFound)
    async def not_found(request: Request, exc: NotFound) -> JSONResponse:
        refuse("not_found", request.scope, str(exc))
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(NotCancellable)
    async def not_cancellable(request: Request, exc: NotCancellable) -> JSONResponse:
        refuse("not_cancellable", request.scope, str(exc))
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(NotDeletable)
    async def not_deletable(request: Request, exc: NotDeletable) -> JSONResponse:
        refuse("not_deletable", request.scope, str(exc))
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(InvalidCursor)
    async def invalid_cursor(request: Request, exc: InvalidCursor) -> JSONResponse:
        refuse("cursor", request.scope, str(exc))
        detail = [{"loc": ["query", "cursor"], "msg": str(exc), "type": "value_error"}]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(redis.RedisError)
    async def redis_unavailable(request: Request, exc: redis.RedisError) -> JSONResponse:
        """Redis gone, stuck or refusing: a 503 naming it (its errors name the server), not a 500."""
        refuse("redis", request.scope, f"{type(exc).__name__}: {exc}")
        return JSONResponse({"detail": f"the run's Redis failed this request ({type(exc).__name__}: {exc}); try "
                                       "again once it answers (GET /readyz says when)"}, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        """FastAPI's 422, logged and counted; a job spec that fails its schema is also a rejected job."""
        refuse("validation", request.scope, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                      for e in exc.errors()))
        if request.method == "POST" and request.url.path == "/v1/jobs":
            request.app.state.api.jobs_rejected.inc()
        return Response(_validation_body(exc), status_code=422, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """FastAPI answers a body it cannot parse at all (nested deeper than Python's parser goes, bytes that are not
        UTF-8, an integer of over 4300 digits) with a bare 400 that says neither why nor is counted: it is a 422
        naming the cause, as a body that is not JSON is. A URL or a method the API does not serve got a bare "Not
        Found" or "Method Not Allowed", not counted, whose Allow header named the methods of one route of the path
        only (``POST`` for ``/v1/jobs``, which GET lists): they name the request, and the 405 every method served."""
        if exc.status_code == 400 and (cause := exc.__cause__) is not None:
            why = f"the body is not JSON this API can read ({type(cause).__name__}: {cause})"
            error = {"type": "json_invalid", "loc": ("body",), "msg": why, "input": {}}
            return await invalid_request(request, RequestValidationError([error]))
        path = request.scope["path"]  # as sent: request.url reads //x as a host
        asked = f"{request.method} {path}"
        if exc.status_code == 404:
            refuse("route", request.scope)
            return JSONResponse({"detail": f"nothing is served at {asked} (GET /openapi.json lists the API's "
                                           "routes)"}, status_code=404)
        if exc.status_code == 405:
            served = sorted({method for route in request.app.router.routes
                             if route.matches(request.scope)[0] is not Match.NONE
                             for method in getattr(route, "methods", None) or ()})
            if not served and exc.headers and "Allow" in exc.headers:  # a mount's files (``PageFiles``) say theirs
                served = exc.headers["Allow"].split(", ")
            refuse("method", request.scope)
            return JSONResponse({"detail": f"{asked}: {path} serves {', '.join(served)} only"},
                                status_code=405, headers={"Allow": ", ".join(served)})
        return await http_exception_handler(request, exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """A handler's unexpected exception (a bug): a 500 in JSON, as every other reply of the API, naming the request
        and the exception's type; Starlette's was a bare "Internal Server Error" text that a client parsing JSON
        choked on. Its message and traceback go to the log only (uvicorn's, as Starlette re-raises it after this
        reply): they may quote the run's internals."""
        return JSONResponse({"detail": f"{request.method} {request.scope['path']} failed: an unexpected "
                                       f"{type(exc).__name__} in the API (its log has the traceback)"},
                            status_code=500)

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    def readyz(api: State) -> JSONResponse:
        try:
            api.redis.ping()
        except redis.RedisError as exc:
            return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", tags=["ops"])
    def metrics(api: State) -> Response:
        return Response(generate_latest(api.registry), media_type=CONTENT_TYPE_LATEST)

    def reject(api: ApiState, request: Request, field: str, msg: str) -> HTTPException:
        """A 422 naming the dotted ``field`` of the job, logged and counted: a rejected job, and a request refused
        for its validation as one the schema refuses is."""
        api.jobs_rejected.inc()
        refuse("validation", request.scope, f"{field}: {msg}")
        return HTTPException(422, [{"loc": ["body", *field.split(".")], "msg": msg, "type": "value_error"}])

    def known_query(request: Request) -> None:
        """A 422 naming a query parameter the route does not take, or one given twice: FastAPI ignores the one (``POST
        /v1/jobs?dry_run=1`` made a job) and takes the last of the other, so either was answered as if not sent."""
        route = request.scope["route"]
        takes = _query_names(route.dependant)
        for name in request.query_params:
            given = request.query_params.getlist(name)
            if name not in takes:
                why = f"{route.path} takes no query parameter {name!r}; it takes {', '.join(sorted(takes)) or 'none'}"
            elif len(given) > 1:
                why = f"query parameter {name!r} is given {len(given)} times; give it once"
            else:
                continue
            raise RequestValidationError([{"type": "value_error", "loc": ("query", name), "msg": why, "input": given}])

    def json_body(api: State, request: Request) -> None:
        """415 naming the header for a job not sent as JSON (no Content-Type, or ``curl -d``'s form type): FastAPI
        validated its bytes as the spec and answered that a JSON object was no valid dictionary."""
        given = request.headers.get("content-type")
        media = (given or "").partition(";")[0].strip().lower()
        if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
            return
        api.jobs_rejected.inc()
        refuse("content_type", request.scope, f"Content-Type {given!r}")
        msg = f"a job is a JSON object sent with Content-Type: application/json, not {given or 'no Content-Type'}"
        raise HTTPException(415, [{"loc": ["header", "Content-Type"], "msg": msg, "type": "value_error"}])

    v1 = [Depends(known_query)]  # every /v1 route's

    def key_used(api: ApiState, request: Request, response: Response, used: IdempotencyKeyUsed) -> dict[str, Any]:
        """The answer to a submit whose Idempotency-Key names a job already: that job (200), when it has the same spec
        (a client retrying a submit whose reply it lost), else a 422 naming the header."""
        if not used.same_spec:
            api.jobs_rejected.inc()
            refuse("idempotency_key", request.scope, str(used))
            msg = (f"{used}: a key names one job, for {IDEMPOTENCY_TTL_S} s; send a new key for a new job, the same "
                   "spec to retry that one")
            raise HTTPException(422, [{"loc": ["header", IDEMPOTENCY_KEY], "msg": msg, "type": "value_error"}])
        try:
            job = api.cluster.job(used.job_id)
        except NotFound:  # deleted since the key was found naming it: the key is free now
            msg = (f"the {IDEMPOTENCY_KEY} named job {used.job_id}, which was deleted while this submit ran; send it "
                   "again: the key is free now")
            api.jobs_rejected.inc()
            refuse("idempotency_key", request.scope, msg)
            raise HTTPException(409, msg) from None
        api.jobs_replayed.inc()
        log.info("POST /v1/jobs: its %s was used for job %s with the same spec: answered with that job, nothing added",
                 IDEMPOTENCY_KEY, used.job_id)
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
        return job

    @app.post("/v1/jobs", status_code=201, tags=["jobs"], dependencies=[*v1, Depends(json_body)],
              responses={415: {"description": "the body is not sent as JSON"}})
    def create_job(
        spec: JobSpec,
        api: State,
        request: Request,
        response: Response,
        idempotency_key: Annotated[str | None, Header(
            alias=IDEMPOTENCY_KEY, min_length=1, max_length=255, pattern=r"^[\x20-\x7e]+$",
            description="a client's key for this submit (e.g. a UUID), sent again with each retry of it: the same key "
                        f"and spec within {IDEMPOTENCY_TTL_S} s are answered with the job the first made (200)",
        )] = None,
    ) -> dict[str, Any]:
        if len(keys := request.headers.getlist(IDEMPOTENCY_KEY)) > 1:  # FastAPI takes one: which retry is this?
            raise RequestValidationError([{"type": "value_error", "loc": ("header", IDEMPOTENCY_KEY), "input": keys,
                                           "msg": f"header {IDEMPOTENCY_KEY} is given {len(keys)} times; give it "
                                                  "once"}])
        if (unstorable := _unstorable(spec)) is not None:  # before the spec is written as JSON, which it cannot be
            raise reject(api, request, "source", unstorable)
        spec_json = spec.model_dump_json()
        if idempotency_key is not None:  # a retry is answered before the checks a new job needs, which may now fail
            try:
                api.queue.check_idempotency_key(idempotency_key, spec_json)
            except IdempotencyKeyUsed as used:
                return key_used(api, request, response, used)
        if spec.kind == "train" and (end := api.cluster.trainer_end()) is not None and not end.crashed:
            msg = (f"{end}: a train job submitted now would never be trained; start the trainer again "
                   f"(python -m trainer --resume, trainer.total_steps above {end.step}), then submit")
            api.jobs_rejected.inc()
            refuse("trainer_finished", request.scope, msg)
            raise HTTPException(409, msg)
        allowed = {*BUILTIN_REWARDS, *cfg.rollout.reward_allowlist}
        if spec.reward is not None and spec.reward not in allowed:
            names = ", ".join(sorted(allowed))
            raise reject(api, request, "reward", f"reward {spec.reward!r} is not one this run allows: {names}")
        if spec.agent is not None and spec.agent not in cfg.rollout.agent_allowlist:
            names = ", ".join(cfg.rollout.agent_allowlist) or "none"
            raise reject(api, request, "agent",
                         f"agent {spec.agent!r} is not in this run's rollout.agent_allowlist: {names}")
        if spec.tools is not None and (twice := _named_twice(spec.tools)) is not None:
            raise reject(api, request, "tools", twice)
        if (inapplicable := _inapplicable(spec, cfg)) is not None:
            raise reject(api, request, *inapplicable)
        cap = cfg.api.max_job_tasks
        if spec.source.limit is not None and spec.source.limit > cap:  # refused before a task is made or read
            raise reject(api, request, "source.limit", f"{spec.source.limit} tasks; a job may hold at most "
                                                       f"api.max_job_tasks={cap}")
        # a source without a limit is read one task past the cap, no further: a file of millions of rows was read
        # and checked whole, for seconds, before the job was refused
        bounded = spec if spec.source.limit is not None else \
            spec.model_copy(update={"source": spec.source.model_copy(update={"limit": cap + 1})})
        try:
            tasks = bounded.load_tasks(cfg.api.data_root, cfg.rollout.reward)
        except (ValueError, OSError) as exc:
            raise reject(api, request, "source", str(exc)) from None
        if not tasks:
            raise reject(api, request, "source", "no tasks")
        asked = {name for t in tasks for name in (spec.tools if spec.tools is not None else t.tools)}
        if tools is not None and (unknown := sorted(asked - set(tools))):
            field = "tools" if spec.tools is not None else "source"
            raise reject(api, request, field, f"unknown tool(s) {', '.join(unknown)}; this run's tools "
                                              f"(rollout.tools): {', '.join(tools) or 'none'}")
        # an agent job's agent calls its tools itself: the registry's tools are never created for it
        if tools is not None and spec.agent is None and (unmet := _unmet_create_kwargs(spec, tasks, tools)):
            raise reject(api, request, "tools" if spec.tools is not None else "source", unmet)
        if len(tasks) > cap:
            raise reject(api, request, "source", f"over {cap} tasks; a job may hold at most api.max_job_tasks={cap} "
                                                 "(source.limit picks that many)")
        job_id = secrets.token_hex(6)
        try:  # all or nothing (TaskQueue.submit): a failed submit leaves no job behind
            api.queue.submit(job_id, [t.model_dump() for t in tasks], spec.kind, spec_json, idempotency_key)
        except IdempotencyKeyUsed as used:  # a submit with the key ran since the check above: it decides
            return key_used(api, request, response, used)
        except redis.RedisError as exc:
            api.jobs_rejected.inc()
            refuse("redis", request.scope, f"job {job_id}: Redis did not take its {len(tasks)} tasks: {exc}")
            why = str(exc).rpartition("of pipeline caused error: ")[2]  # not the command redis-py quotes
            retry = f"; sending it again with the same {IDEMPOTENCY_KEY} makes no second job" if idempotency_key else ""
            raise HTTPException(503, f"Redis did not take the job's {len(tasks)} tasks ({type(exc).__name__}: "
                                     f"{why}); a job is written whole or not at all: GET /v1/jobs/{job_id} says "
                                     f"which (404: nothing was submitted){retry}") from None
        api.jobs_submitted.labels(kind=spec.kind).inc()
        try:
            return api.cluster.job(job_id)
        except redis.RedisError as exc:  # it is written whole: a 503 ("try again") would have it made twice
            log.warning("job %s: its %d tasks are submitted, but Redis failed as it was read back (%s: %s): answered "
                        "with it as submitted", job_id, len(tasks), type(exc).__name__, exc)
            return api.cluster.submitted(job_id, spec.kind, spec_json, len(tasks))

    @app.get("/v1/jobs", tags=["jobs"], dependencies=v1)
    def list_jobs(
        api: State,
        cursor: Annotated[
            str, Query(pattern=r"^[A-Za-z0-9_.:-]{0,128}$", description="`next` of the previous page")
        ] = "",
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
    ) -> dict[str, Any]:
        """Newest first, a page at a time: ``{"jobs": [...], "next": cursor or null}``.

        Each job is as ``GET /v1/jobs/{job_id}`` has it, except that its spec's ``source`` never carries ``tasks``
        (it keeps every other field: ``kind``, ``offset``, ``limit``, ...). An inline source has ``task_count``
        instead: how many tasks it gave, before ``offset`` and ``limit`` picked the job's (``progress.submitted``
        counts those). So a page stays small whatever its jobs hold; ``GET /v1/jobs/{job_id}`` has the tasks."""
        return api.cluster.jobs(cursor, limit)

    @app.get("/v1/jobs/{job_id}", tags=["jobs"], dependencies=v1)
    def get_job(job_id: str, api: State, summary: bool = False) -> dict[str, Any]:
        """The job with its whole spec, an inline source's tasks included; with ``summary=true`` the spec as the
        listing has it (its tasks counted, not sent): what a client polling the job's progress reads, which would
        read and send every task at each poll (8 MB for 10,000 tasks)."""
        return api.cluster.job(job_id, summary)

    @app.post("/v1/jobs/{job_id}/cancel", tags=["jobs"], dependencies=v1)
    def cancel_job(job_id: str, api: State) -> dict[str, Any]:
        return api.cluster.cancel(job_id)

    @app.delete("/v1/jobs/{job_id}", tags=["jobs"], dependencies=v1)
    def delete_job(job_id: str, api: State) -> dict[str, Any]:
        """Delete a finished job (every task rolled out, a train job's every group trained or dropped) or a cancelled
        one, with what is left of it that no live consumer holds (409 while one does, or for a running job), its
        trajectories, eval results and its submit's Idempotency-Key: a long-lived run's Redis keeps only what it is
        asked to. A second delete gets 404."""
        deleted = api.cluster.delete(job_id)
        api.jobs_deleted.labels(kind=deleted["kind"]).inc()
        log.info("job %s (%s) deleted", _one_line(job_id), deleted["kind"])
        return deleted

    @app.get("/v1/jobs/{job_id}/trajectories", tags=["jobs"], dependencies=v1)
    def trajectories(
        job_id: str,
        api: State,
        cursor: Annotated[
            str, Query(pattern=r"^(|[0-9]{1,20}-[0-9]{1,20})$", description="`next` of the previous page")
        ] = "",
        limit: Annotated[int, Query(ge=1, le=200)] = 20,
    ) -> dict[str, Any]:
        return api.cluster.trajectories(job_id, cursor, limit)

    @app.get("/v1/status", tags=["cluster"], dependencies=v1)
    def status(api: State) -> dict[str, Any]:
        return api.cluster.status()

    @app.get("/v1/metrics/summary", tags=["cluster"], dependencies=v1)
    def metrics_summary(api: State) -> dict[str, Any]:
        return api.sampler.summary()

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers=PAGE_HEADERS)

    app.mount("/static", PageFiles(directory=STATIC, check_dir=False), name="static")
    app.add_middleware(BodyLimit, max_bytes=cfg.api.max_body_bytes, timeout_s=cfg.api.body_timeout_s, refuse=refuse)
    app.add_middleware(TokenGuard, token=cfg.api.token, refuse=refuse)
    app.add_middleware(HostGuard, allowed_hosts=cfg.api.allowed_hosts, refuse=refuse)
    # uvicorn's ``http=`` for this app: what it refuses before the app sees it (``guarded_http``) is counted here, and
    # its replies carry NoSniff's headers as the app's do
    app.state.http_protocol = guarded_http(lambda client, reason, detail: refuse(
        reason, {"method": "-", "path": "-", "client": client}, detail), headers=NoSniff.HEADERS)
    return app
