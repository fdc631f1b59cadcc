"""The API process: REST endpoints over one connection pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response

from chimes import __version__, dashboard, metrics
from chimes.api import (
    actors,
    audit,
    calendars,
    errors,
    health,
    homes,
    jobs,
    notifications,
    openapi,
    runs,
    schedules,
    standby,
    unavailable,
    whoami,
)
from chimes.api.limits import BodySizeLimit, LimitSettings, RequestLimits
from chimes.api.moved import ReplayMovedRequests
from chimes.api.responses import JSONResponse
from chimes.clock import SYSTEM_CLOCK, Clock
from chimes.security.refusals import Refused
from chimes.security.secrets import Keyring, default_keyring
from chimes.services.jobs import JobService
from chimes.services.owners import check_secret_key
from chimes.store.db import ROLE_COMMAND_TIMEOUT_SEC, Conn, command_timeout, create_pool, when_ready
from chimes.store.owners import count_jobs_up_to
from chimes.store.runs import RunStore
from chimes.store.shards import ShardPools, load_map

API_POOL = 10  # connections per database an API process opens at most, unless told otherwise


def create_app(dsn: str, *, max_body_bytes: int | None = None, pool_size: int = API_POOL,
               limits: LimitSettings | None = None, keyring: Keyring | None = None,
               clock: Clock | None = None, follow_map_every_sec: float = homes.MAP_FOLLOW_SEC) -> FastAPI:
    """The API app; ``clock`` is the "now" its endpoints and pages read (chimes.api.clock), the host's by default;
    ``follow_map_every_sec``: how often it reads the shard map's version."""
    limits = limits or LimitSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ring = keyring or default_keyring()
        pool = await create_pool(dsn, max_size=pool_size, command_timeout=command_timeout(ROLE_COMMAND_TIMEOUT_SEC))
        try:
            # Another key than the workers' fails here, not in every run.
            await when_ready(lambda: check_secret_key(pool, ring))
            # With shards, job-scoped requests go to the job's shard (chimes.api.homes); the map is
            # read here, then followed every second (homes.follow_map).
            shard_map = await when_ready(lambda: load_map(pool))
        except BaseException:
            await pool.close()
            raise
        app.state.pool = pool
        def job_store(over: Any) -> JobService:
            return JobService(over, keyring=ring, default_job_quota=limits.default_job_quota)

        def home_job_store(home: Any) -> JobService:
            """With shards, the service of one home's jobs: owners from the catalog, quotas across homes."""
            async def jobs_elsewhere(owner: str, limit: int, catalog: Conn | None) -> int:
                counted = 0 if catalog is None else await count_jobs_up_to(catalog, owner, limit)
                for other in (await app.state.shards.homes())[1:]:  # the shards (the catalog comes first)
                    if other is not home and counted < limit:
                        counted += await count_jobs_up_to(other, owner, limit - counted)
                return counted

            return JobService(home, keyring=ring, default_job_quota=limits.default_job_quota,
                              catalog=None if home is pool else pool, jobs_elsewhere=jobs_elsewhere)

        app.state.jobs = job_store(pool)
        app.state.runs = RunStore(pool)
        app.state.standby = standby.Standby(dsn, job_store)  # reads while no primary is reachable
        # A shard's pool opens at its first request, with one try: a shard that is down answers 503 at
        # once instead of holding the request for the whole --database-wait.
        app.state.shards = ShardPools(pool, shard_map, max_size=pool_size,
                                      command_timeout=command_timeout(ROLE_COMMAND_TIMEOUT_SEC),
                                      connect_wait_sec=0)
        app.state.home_services = {}
        app.state.job_service_for = home_job_store
        following = asyncio.create_task(homes.follow_map(app.state.shards, follow_map_every_sec))
        try:
            yield
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            await app.state.standby.close()
            await app.state.shards.close()
            await pool.close()

    app = FastAPI(title="Chimes", version=__version__, lifespan=lifespan,
                  default_response_class=JSONResponse, docs_url=None, redoc_url=None)
    app.state.clock = clock or SYSTEM_CLOCK
    errors.install(app)
    unavailable.install(app)
    app.add_exception_handler(Refused, _refused)  # type: ignore[arg-type]
    openapi.install(app)
    app.include_router(jobs.router)
    app.include_router(runs.router)
    app.include_router(notifications.router)
    app.include_router(whoami.router)
    app.include_router(audit.router)
    app.include_router(schedules.router)
    app.include_router(calendars.router)

    @app.get("/healthz", tags=["health"])
    async def healthz(request: Request) -> JSONResponse:
        status, body = await health.check(request.app.state.pool, dsn)
        shards = homes.sharded(request)
        if shards is not None and status == 200:
            body["shards"] = await health.shard_states(shards)
        headers = {"Retry-After": str(unavailable.RETRY_AFTER_SEC)} if status != 200 else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.get("/metrics", tags=["health"])
    async def prometheus_metrics(request: Request) -> Response:
        shards = homes.sharded(request)
        await metrics.collect_fleet(*(await shards.homes() if shards is not None else [request.app.state.pool]))
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    dashboard.install(app)
    app.add_middleware(ReplayMovedRequests)  # inside the body limit: it keeps a body that was let through
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes if max_body_bytes is None else max_body_bytes)
    app.add_middleware(RequestLimits, settings=limits)
    app.add_middleware(standby.StandbyReads)  # inside the deadline: a read from the standby is bounded too
    app.add_middleware(unavailable.RequestDeadline, seconds=limits.request_timeout_sec)
    app.add_middleware(metrics.LatencyMiddleware)
    app.add_middleware(actors.RequestIds)  # outermost: every answer, errors included, carries the id
    return app


async def _refused(_: Request, exc: Refused) -> JSONResponse:
    return JSONResponse(errors.error_body(exc.code, exc.message, exc.field), exc.status, headers=exc.headers)
