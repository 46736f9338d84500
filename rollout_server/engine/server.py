"""The embedded engine's HTTP server: SGLang's native HTTP API over a
``Scheduler``, assembled from the routers in ``rollout_server.engine.routes``.

With an API key every request, on every route, must carry ``Authorization: Bearer <key>``; any other is
answered 401 ``{"error": "Unauthorized"}``, as SGLang's ``--api-key`` does (which exempts /health and
/metrics; here only a caller with the key learns anything)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_server.engine.protocol import GenerateSpec
from rollout_server.engine.routes import generate, info, lora, memory, object_error, weights
from rollout_server.engine.scheduler import Scheduler


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

    for module in (generate, weights, memory, lora, info):
        app.include_router(module.router)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key)
    return app
