"""The embedded engine's HTTP server: SGLang's native HTTP API over a
``Scheduler``, assembled from the routers in ``rollout_server.engine.routes``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from rollout_server.engine.protocol import GenerateSpec
from rollout_server.engine.routes import generate, info, object_error, weights
from rollout_server.engine.scheduler import Scheduler


def create_app(engine: Scheduler, spec: GenerateSpec) -> FastAPI:
    """The FastAPI app; its lifespan starts and closes ``engine``."""

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

    for module in (generate, weights, info):
        app.include_router(module.router)
    return app
