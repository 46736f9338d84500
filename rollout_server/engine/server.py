"""The embedded engine's HTTP server: SGLang's native HTTP API over a
``Scheduler``, assembled from the routers in ``rollout_server.engine.routes``.

With an API key every request, on every route, must carry ``Authorization: Bearer <key>``; any other is
answered 401 ``{"error": "Unauthorized"}``, as SGLang's ``--api-key`` does (which exempts /health and
/metrics; here only a caller with the key learns anything)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import Counter
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.net import LOOPBACK_NAMES, guarded_http
from rollout_server.engine.protocol import GenerateSpec
from rollout_server.engine.routes import generate, info, lora, memory, object_error, weights
from rollout_server.engine.scheduler import EngineFailure, Scheduler

log = logging.getLogger(__name__)
REASON_BYTES = 500  # of a refusal's body, logged as its reason
LOOPBACK_HOSTS = ["127.0.0.1", *sorted(LOOPBACK_NAMES)]  # Host names a keyless engine answers


class BearerAuth:
    """Refuses (401) every HTTP request whose ``Authorization`` is not ``Bearer <key>``."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RefusalLog:
    """Logs every 4xx the engine answers with the reason its body gives, and counts it by status: whichever route,
    middleware or validator refused the request."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, body = 0, b""

        async def watched(message: Message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif 400 <= status < 500 and len(body) < REASON_BYTES:
                body += message.get("body", b"")
            await send(message)

        await self.app(scope, receive, watched)
        if 400 <= status < 500:
            self.counter.labels(status=str(status)).inc()
            client = scope.get("client") or ("?", 0)
            log.warning("refused %s %s from %s (%d): %s", scope["method"], scope["path"], client[0], status,
                        body[:REASON_BYTES].decode(errors="replace"))


def create_app(engine: Scheduler, spec: GenerateSpec, api_key: str | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and closes ``engine``. With ``api_key`` every route needs it."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    app = FastAPI(lifespan=lifespan, title="rollwave embedded engine")
    app.state.engine = engine
    app.state.spec = spec
    app.state.weight_session = weights.WeightSession()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        exc_str, errors_str = str(exc), str(exc.errors())
        message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
        return object_error(message, 400)

    @app.exception_handler(EngineFailure)
    async def engine_failure(_: Request, exc: EngineFailure) -> JSONResponse:
        return object_error(f"engine failure: {exc}", 500)

    for module in (generate, weights, memory, lora, info):
        app.include_router(module.router)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)
    else:  # keyless, so on loopback: a web page that rebinds its own name to 127.0.0.1 gets 400, not the routes
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=LOOPBACK_HOSTS)
    app.add_middleware(RefusalLog, counter=engine.metrics.http_refused)  # outermost: it sees BearerAuth's 401s too

    def refused(client: tuple[str, int] | None, reason: str, detail: str) -> None:
        engine.metrics.http_refused.labels(status="400").inc()
        log.warning("refused a request from %s (400 %s): %s", client[0] if client else "?", reason, detail)

    # uvicorn's ``http=`` for this app: what it refuses before the app sees it (``guarded_http``) is counted here
    app.state.http_protocol = guarded_http(refused)
    return app
