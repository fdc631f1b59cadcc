"""The API process: REST endpoints over one connection pool."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request

from chimes import __version__
from chimes.api import errors, jobs, runs
from chimes.api.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from chimes.api.responses import JSONResponse
from chimes.store.db import create_pool
from chimes.store.jobs import JobStore
from chimes.store.runs import RunStore


def create_app(dsn: str, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, pool_size: int = 10) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = await create_pool(dsn, max_size=pool_size)
        app.state.pool = pool
        app.state.jobs = JobStore(pool)
        app.state.runs = RunStore(pool)
        try:
            yield
        finally:
            await pool.close()

    app = FastAPI(title="Chimes", version=__version__, lifespan=lifespan,
                  default_response_class=JSONResponse, docs_url=None, redoc_url=None)
    errors.install(app)
    app.include_router(jobs.router)
    app.include_router(runs.router)

    @app.get("/healthz", tags=["health"])
    async def healthz(request: Request) -> JSONResponse:
        try:
            await request.app.state.pool.fetchval("SELECT 1")
        except Exception as exc:  # any failure to reach the database is "unhealthy"
            return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app
