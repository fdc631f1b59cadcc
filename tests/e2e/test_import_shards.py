"""`chimes jobs import` with a shard map: the catalog holds partitions 512-1023, a shard on a second
server 0-511. Each job goes to its home, in a transaction per home; a bad line changes nothing
anywhere; a home that fails leaves the others to commit, and its lines come back in a file of their
own to import again (docs/scaling.md, "Caps and quotas across shards")."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import orjson
import pytest

from chimes.ids import partition_of
from chimes.store.shards import without_password
from tests.conftest import scratch_database
from tests.e2e.processes import Processes
from tests.e2e.test_crash_safety import soon
from tests.e2e.test_import import job_line, run_import
from tests.helpers import add_shards, wait_for

pytestmark = [pytest.mark.own_shard_map,  # databases and a shard map of its own, whatever --shards says
              pytest.mark.sharded_pass]  # in the second pass, scripts/test --sharded

SHARD_RANGE = (0, 511)  # on the second server; 512-1023 stay in the catalog
LINES = 6_000  # two COPY chunks


@pytest.fixture
async def shard_url(second_server_dsn: str) -> AsyncIterator[str]:
    async with scratch_database(second_server_dsn, "chimes_import_shard") as dsn:
        yield dsn


@pytest.fixture
async def database_url(database_url: str, shard_url: str) -> str:
    """The catalog, with its map giving SHARD_RANGE to the shard."""
    await add_shards(database_url, (shard_url, *SHARD_RANGE))
    return database_url


async def fetch(url: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()


async def names_in(url: str) -> list[str]:
    """The jobs' names in id order: creation order, so the file's order for one import."""
    return [r["name"] for r in await fetch(url, "SELECT name FROM jobs ORDER BY job_id")]


def names_of(file: Path) -> list[str]:
    return [orjson.loads(line)["name"] for line in file.read_bytes().splitlines() if line.strip()]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections, as a stopped server's does: bound, not listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock.getsockname()[1]
    sock.close()


async def test_every_job_lands_on_its_home_fires_and_is_found_through_the_api(
        processes: Processes, client: httpx.AsyncClient, tmp_path: Path, database_url: str, shard_url: str) -> None:
    file = tmp_path / "jobs.jsonl"
    lines = [job_line(i) for i in range(LINES)]
    for i in range(0, 40 * 50, 50):  # 40 one-off jobs due in seconds, scattered over both homes
        lines[i] = job_line(i, name=f"soon-{i}", schedule={"at": soon(4.0)})
    file.write_bytes(b"".join(lines))
    code, output = await run_import(processes, file, "team-a", "--processes", "2")
    assert code == 0, output
    assert f"imported {LINES} jobs" in output, output

    every = names_of(file)
    homes = {"catalog": (database_url, (512, 1023)), "shard": (shard_url, SHARD_RANGE)}
    seen: list[str] = []
    for side, (url, (first, last)) in homes.items():
        jobs = await fetch(url, "SELECT job_id, name FROM jobs")
        assert jobs, f"no job on the {side}"
        assert all(first <= partition_of(r["job_id"]) <= last for r in jobs), side
        triggers = await fetch(url, "SELECT partition_id, job_id FROM triggers")
        assert sorted(r["job_id"] for r in triggers) == sorted(r["job_id"] for r in jobs)
        assert all(r["partition_id"] == partition_of(r["job_id"]) for r in triggers)
        names = await names_in(url)
        assert names == [name for name in every if name in set(names)], f"{side}: not in the file's order"
        seen += names
    assert sorted(seen) == sorted(every)  # each line once, on one home or the other
    counts = [len(await names_in(url)) for url in (database_url, shard_url)]
    shard_id = (await fetch(database_url, "SELECT shard_id FROM shards"))[0]["shard_id"]
    assert f"the catalog: {counts[0]} jobs; shard {shard_id}: {counts[1]} jobs" in output, output

    processes.scheduler("node-1")  # every soon job fires on its home, and the API finds its run
    soon_jobs = {r["name"]: r["job_id"] for url in (database_url, shard_url)
                 for r in await fetch(url, "SELECT job_id, name FROM jobs WHERE name LIKE 'soon-%'")}
    assert len(soon_jobs) == 40
    assert {partition_of(job_id) <= SHARD_RANGE[1] for job_id in soon_jobs.values()} == {True, False}

    async def fired() -> bool:
        for job_id in soon_jobs.values():
            runs = (await client.get(f"/jobs/{job_id}/runs")).json()["runs"]
            if not runs:
                return False
        return True

    await wait_for(fired, timeout=60, what="every imported one-off job to fire")
    for name, job_id in soon_jobs.items():
        job = (await client.get(f"/jobs/{job_id}")).json()
        assert job["name"] == name and job["owner"] == "team-a", job

    # The API's job quota counts the imported jobs on both homes: neither alone holds the quota.
    await fetch(database_url, "INSERT INTO owners (owner, job_quota) VALUES ('team-a', $1) "
                              "ON CONFLICT (owner) DO UPDATE SET job_quota = $1", LINES)
    refused = await client.post("/jobs", json={"name": "one-more", "schedule": {"cron": "@hourly"},
                                               "task": {"type": "http", "url": "http://127.0.0.1:9/x"}})
    assert refused.status_code == 429 and refused.json()["error"] == "job_quota_exceeded", refused.text


async def test_a_bad_line_changes_no_database(processes: Processes, tmp_path: Path, database_url: str,
                                              shard_url: str) -> None:
    file = tmp_path / "jobs.jsonl"
    lines = [job_line(i) for i in range(LINES)]
    lines[5_500] = job_line(5_500, task={"type": "http", "url": "ftp://example.com/"})  # in the last chunk
    file.write_bytes(b"".join(lines))
    code, output = await run_import(processes, file, "team-a", "--processes", "1")
    assert code == 1, output
    assert "line 5501: task.url" in output and "nothing was imported" in output, output
    for url in (database_url, shard_url):
        assert await fetch(url, "SELECT job_id FROM jobs") == []
        assert await fetch(url, "SELECT trigger_id FROM triggers") == []
    assert os.listdir(tmp_path) == ["jobs.jsonl"]  # no file of lines left over


@pytest.mark.parametrize("failure", ["stopped server", "no such database", "refused midway"])
async def test_a_failing_shard_leaves_the_others_committed_and_its_lines_to_import_again(
        processes: Processes, tmp_path: Path, database_url: str, shard_url: str, closed_port: int,
        failure: str) -> None:
    file = tmp_path / "jobs.jsonl"
    # The last lines are named late-N: in the second COPY chunk, after each home has taken a first one.
    file.write_bytes(b"".join(job_line(i, **({"name": f"late-{i}"} if i >= 5_900 else {})) for i in range(LINES)))
    shard_id = (await fetch(database_url, "SELECT shard_id FROM shards"))[0]["shard_id"]
    broken = {"stopped server": f"postgresql://chimes:pw@127.0.0.1:{closed_port}/chimes",
              "no such database": shard_url.rsplit("/", 1)[0] + f"/chimes_nowhere_{uuid.uuid4().hex}"}
    if failure in broken:
        await fetch(database_url, "UPDATE shards SET url = $1", broken[failure])
    else:
        await fetch(shard_url, "ALTER TABLE jobs ADD CONSTRAINT no_late CHECK (name NOT LIKE 'late-%')")

    code, output = await run_import(processes, file, "team-a", "--processes", "1", "--database-wait", "0")
    assert code == 3, output
    assert f"failed:    shard {shard_id} (partitions 0-511" in output, output
    assert "committed: the catalog (partitions 512-1023)" in output, output
    if failure in broken:
        assert without_password(broken[failure]) in output, output  # the URL is named, without a password
    assert await fetch(shard_url, "SELECT job_id FROM jobs") == []
    catalog = await names_in(database_url)
    assert len(catalog) > 0
    assert f"committed: the catalog (partitions 512-1023): {len(catalog)} jobs" in output, output
    left = tmp_path / "jobs.jsonl.not-imported.jsonl"
    assert f"The {LINES - len(catalog)} lines not imported are in {left}" in output, output
    assert f"chimes jobs import {left} --owner team-a" in output, output
    assert sorted(catalog + names_of(left)) == sorted(names_of(file))  # each line in one place

    # Once the shard answers, importing the lines left over completes the file, each job once.
    if failure in broken:
        await fetch(database_url, "UPDATE shards SET url = $1", shard_url)
    else:
        await fetch(shard_url, "ALTER TABLE jobs DROP CONSTRAINT no_late")
    code, output = await run_import(processes, left, "team-a", "--processes", "1")
    assert code == 0, output
    everywhere = await names_in(database_url) + await names_in(shard_url)
    assert sorted(everywhere) == sorted(names_of(file))
