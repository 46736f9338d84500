"""``create_app(config)``: the FastAPI app under ``/v1`` with its lifespan (Redis, the metrics sampler)."""

from __future__ import annotations

import asyncio
import os
import secrets
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import redis
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from buffer.keys import Keys
from buffer.redis_server import connect
from buffer.registry import ServerRegistry
from buffer.task_queue import TaskQueue
from core.config import Config
from core.jobs import JobSpec
from services.api.cluster import ClusterView, InvalidCursor, NotFound
from services.api.sampler import MetricsSampler

STATIC = Path(__file__).resolve().parent.parent / "static"


class ApiState:
    """What the routes share: the Redis client, the run's keys, the queue and the cluster view."""

    def __init__(self, cfg: Config, client: redis.Redis) -> None:
        self.cfg = cfg
        self.redis = client
        self.keys = Keys(cfg.run.name)
        self.queue = TaskQueue(client, self.keys, cfg.buffer)
        self.cluster = ClusterView(client, self.keys, ServerRegistry(client, self.keys), self.queue)
        self.sampler = MetricsSampler(self.cluster)
        self.registry = CollectorRegistry()
        self.jobs_submitted = Counter(
            "rollwave_api_jobs_submitted_total", "Jobs accepted", ["kind"], registry=self.registry
        )
        self.jobs_rejected = Counter("rollwave_api_jobs_rejected_total", "Jobs rejected", registry=self.registry)


def _state(request: Request) -> ApiState:
    return request.app.state.api


def _auth(request: Request) -> None:
    token = request.app.state.api.cfg.api.token
    if token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


State = Annotated[ApiState, Depends(_state)]


def create_app(cfg: Config, client: redis.Redis | None = None, url: str | None = None) -> FastAPI:
    """The API for one run. Without ``client`` it connects per ``cfg.redis`` (embedded Redis if no URL).

    ``url``, where this API is served, is published under ``Keys.api``: with ``api.port=0`` that is how
    the launcher that started it finds it.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        owned = None
        conn = client
        if conn is None:
            conn, owned = connect(cfg.redis, cfg.run.path)
        api = ApiState(cfg, conn)
        api.queue.ensure_groups()
        if url is not None:
            conn.hset(api.keys.api, mapping={"url": url, "pid": os.getpid()})
        app.state.api = api
        sampler = asyncio.create_task(api.sampler.run())
        try:
            yield
        finally:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            if owned is not None:
                owned.stop()

    app = FastAPI(title="rollwave", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(NotFound)
    async def not_found(_request: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    v1 = [Depends(_auth)]

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

    @app.post("/v1/jobs", status_code=201, dependencies=v1, tags=["jobs"])
    def create_job(spec: JobSpec, api: State) -> dict[str, Any]:
        try:
            tasks = spec.source.load()
        except (ValueError, OSError) as exc:
            api.jobs_rejected.inc()
            raise HTTPException(422, [{"loc": ["body", "source"], "msg": str(exc), "type": "value_error"}]) from None
        if not tasks:
            api.jobs_rejected.inc()
            raise HTTPException(422, [{"loc": ["body", "source"], "msg": "no tasks", "type": "value_error"}])
        job_id = secrets.token_hex(6)
        api.queue.submit(job_id, [t.model_dump() for t in tasks], spec.kind, spec.model_dump_json())
        api.jobs_submitted.labels(kind=spec.kind).inc()
        return api.cluster.job(job_id)

    @app.get("/v1/jobs", dependencies=v1, tags=["jobs"])
    def list_jobs(api: State) -> dict[str, Any]:
        return {"jobs": api.cluster.jobs()}

    @app.get("/v1/jobs/{job_id}", dependencies=v1, tags=["jobs"])
    def get_job(job_id: str, api: State) -> dict[str, Any]:
        return api.cluster.job(job_id)

    @app.post("/v1/jobs/{job_id}/cancel", dependencies=v1, tags=["jobs"])
    def cancel_job(job_id: str, api: State) -> dict[str, Any]:
        return api.cluster.cancel(job_id)

    @app.get("/v1/jobs/{job_id}/trajectories", dependencies=v1, tags=["jobs"])
    def trajectories(
        job_id: str,
        api: State,
        cursor: Annotated[
            str, Query(pattern=r"^(|[0-9]{1,20}-[0-9]{1,20})$", description="`next` of the previous page")
        ] = "",
        limit: Annotated[int, Query(ge=1, le=200)] = 20,
    ) -> dict[str, Any]:
        try:
            return api.cluster.trajectories(job_id, cursor, limit)
        except InvalidCursor as exc:
            raise HTTPException(422, [{"loc": ["query", "cursor"], "msg": str(exc), "type": "value_error"}]) from None

    @app.get("/v1/status", dependencies=v1, tags=["cluster"])
    def status(api: State) -> dict[str, Any]:
        return api.cluster.status()

    @app.get("/v1/metrics/summary", dependencies=v1, tags=["cluster"])
    def metrics_summary(api: State) -> dict[str, Any]:
        return api.sampler.summary()

    @app.get("/", include_in_schema=False)
    def dashboard() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC, check_dir=False), name="static")
    return app
