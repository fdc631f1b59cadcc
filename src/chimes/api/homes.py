"""Where a request's job lives. Without shards, the one database, as always (and its standby for reads
while it is unreachable); with shards (docs/scaling.md, "Shards"), the job's shard by its id, and every
shard for what is not one job's."""

from __future__ import annotations

import asyncio
import heapq
import logging
import uuid

from fastapi import Request

from chimes.api import standby
from chimes.ids import new_job_id, new_job_id_in, partition_of_key
from chimes.services.jobs import JobService
from chimes.store import db
from chimes.store.db import Pool
from chimes.store.jobs import JobFilter, JobRecord
from chimes.store.runs import RunStore
from chimes.store.shards import ShardPools

MAP_FOLLOW_SEC = 1.0
log = logging.getLogger("chimes.api")


def sharded(request: Request) -> ShardPools | None:
    """The process's shard pools while the map gives partitions to shards; None while the catalog is
    the one database (requests then take the single-database paths, standby reads included)."""
    shards: ShardPools = request.app.state.shards
    return shards if shards.map.ranges else None


async def follow_map(shards: ShardPools, every_sec: float = MAP_FOLLOW_SEC) -> None:
    """Reload the map when its version changes (one primary-key read a second): a shard added to a
    running fleet is routed to within a second. Until then the catalog's fence refuses what this
    process would create in the shard's partitions (``create_routed``)."""
    while True:
        await asyncio.sleep(every_sec)
        await read_map_again(shards)


async def read_map_again(shards: ShardPools) -> bool:
    """Read the map's version, and the map when it changed: True then. The catalog unreachable: False
    (the requests say so; the map is read again next time)."""
    try:
        changed = await shards.refresh()
    except Exception as exc:
        log.debug("could not read the shard map: %s", db.describe(exc))
        return False
    if changed:
        log.info("shard map version %d: %d ranges", shards.map.version, len(shards.map.ranges))
    return changed


def _services(request: Request, pool: Pool) -> tuple[JobService, RunStore]:
    made: dict[int, tuple[JobService, RunStore]] = request.app.state.home_services
    if id(pool) not in made:
        made[id(pool)] = (request.app.state.job_service_for(pool), RunStore(pool))
    return made[id(pool)]


async def jobs_of(request: Request, job_id: uuid.UUID) -> JobService:
    shards = sharded(request)
    if shards is None:
        return standby.jobs(request)
    return _services(request, await shards.for_job(job_id))[0]


async def runs_of(request: Request, job_id: uuid.UUID) -> RunStore:
    shards = sharded(request)
    if shards is None:
        return standby.runs(request)
    return _services(request, await shards.for_job(job_id))[1]


async def runs_of_run(request: Request, run_id: uuid.UUID) -> RunStore:
    """The run store of the home that holds ``run_id`` (a run id does not name its job): every home is
    asked, by primary key, at once; none: the catalog's, which answers as for any unknown run. Two
    homes hold it while a move of its partition cleans up: the one the map gives the partition to. A
    home that cannot be reached matters only when no other has the run: then its error is raised (503)."""
    shards = sharded(request)
    if shards is None:
        return standby.runs(request)
    pools = await shards.homes()
    stores = [_services(request, pool)[1] for pool in pools]
    found = await asyncio.gather(*(store.run_partition(run_id) for store in stores), return_exceptions=True)
    holding = [(pool, store, partition) for pool, store, partition in zip(pools, stores, found, strict=True)
               if isinstance(partition, int)]
    for pool, store, partition in holding:
        if len(holding) == 1 or await shards.for_partition(partition) is pool:
            return store
    if holding:
        return holding[0][1]
    for error in found:
        if isinstance(error, BaseException):
            raise error
    return stores[0]


def new_job_id_for(request: Request, owner: str, idempotency_key: str | None) -> uuid.UUID | None:
    """The id of a job about to be created, chosen here with shards (None: the service makes it). With
    an idempotency key, in the key's partition: a retry goes to the shard that has the first one."""
    if sharded(request) is None:
        return None
    return new_job_id_in(partition_of_key(owner, idempotency_key)) if idempotency_key else new_job_id()


async def list_jobs(request: Request, owner: str | None, after: uuid.UUID | None, limit: int,
                    where: JobFilter | None = None) -> list[JobRecord]:
    """Jobs in creation order (by id) after the cursor ``after`` (those ``where`` lets through).
    With shards, each home's first ``limit`` after it, merged: as stable under concurrent writes as
    one database's list, since the cursor is a key and a job created later has a greater one."""
    shards = sharded(request)
    if shards is None:
        return await standby.jobs(request).list(owner, after, limit, where)
    pages = await asyncio.gather(*(_services(request, pool)[0].list(owner, after, limit, where)
                                   for pool in await shards.homes()))
    merged: list[JobRecord] = list(heapq.merge(*pages, key=_job_id))[:limit]
    return merged


def _job_id(job: JobRecord) -> uuid.UUID:
    return job.job_id


async def every_run_store(request: Request) -> list[RunStore]:
    """One run store per home: the one database's alone without shards."""
    shards = sharded(request)
    if shards is None:
        return [standby.runs(request)]
    return [_services(request, pool)[1] for pool in await shards.homes()]


async def pools_for(request: Request, job_id: uuid.UUID | None) -> list[Pool]:
    """The pools a read goes through: the job's home when it names a job, else every home; without
    shards the one database's (or its standby's while this request is served from it)."""
    shards = sharded(request)
    if shards is None:
        return [standby.pool(request)]
    if job_id is not None:
        return [await shards.for_job(job_id)]
    return await shards.homes()
