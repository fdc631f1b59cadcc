"""A calendar that cannot be read is its owner's problem: the scheduler keeps loading every other
owner's calendars, and the jobs that name it, or a calendar it cannot find or has not read yet, fire
no run: their slots are recorded as skipped, naming the calendar (exclusions fail closed)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import httpx
import orjson

from chimes.calendars import CalendarSpec
from chimes.scheduler.calendar_book import CalendarBook
from chimes.store.calendars import put_calendar
from tests.helpers import Homes, auth_as, wait_for
from tests.integration.fleet import running_fleet
from tests.integration.test_semantics import job
from tests.target import Target

POISON_WINDOWS = [{"start": "0001-01-01T00:00:00+23:59", "end": "0001-01-02T00:00:00Z"}]


async def write_around_the_api(pool: asyncpg.Pool, owner: str, name: str, *, windows: object = None,
                               dates: str = "{}") -> None:
    """A calendar row as no API answer would write it (a bad row, or one a future bug writes)."""
    await pool.execute(
        "INSERT INTO calendars (owner, name, timezone, dates, windows, version) "
        "VALUES ($1, $2, 'UTC', $3::text::date[], $4::text::jsonb, 1) "
        "ON CONFLICT (owner, name) DO UPDATE SET dates = excluded.dates, windows = excluded.windows",
        owner, name, dates, orjson.dumps(windows if windows is not None else []).decode())


def freeze_now() -> dict[str, object]:
    start = datetime.now(UTC) - timedelta(minutes=1)
    return {"windows": [{"start": start.isoformat(), "end": (start + timedelta(hours=1)).isoformat()}]}


async def test_an_unreadable_calendar_leaves_every_other_calendar_loading_also_after_a_restart(
    pool: asyncpg.Pool
) -> None:
    await put_calendar(pool, "team-a", "freeze", CalendarSpec.model_validate(freeze_now()))
    await write_around_the_api(pool, "team-b", "poison", windows=POISON_WINDOWS)
    await write_around_the_api(pool, "team-c", "far", dates="{10000-01-01}")  # no Python date holds it
    book = CalendarBook(pool)
    assert await book.refresh()
    assert book.calendars[("team-a", "freeze")].problem is None
    assert book.calendars[("team-b", "poison")].problem.startswith("cannot be read (windows.0.start")
    assert book.calendars[("team-c", "far")].problem.startswith("cannot be read (dates.0")
    # Edits of the others' calendars still load; the bad one, written again through the API, is fixed.
    await put_calendar(pool, "team-a", "freeze", CalendarSpec(dates=[datetime.now(UTC).date()]))
    await put_calendar(pool, "team-b", "poison", CalendarSpec())
    assert await book.refresh()
    assert book.calendars[("team-a", "freeze")].dates == {datetime.now(UTC).date()}
    assert book.calendars[("team-b", "poison")].problem is None
    await write_around_the_api(pool, "team-b", "poison", windows=POISON_WINDOWS)
    restarted = CalendarBook(pool)
    assert await restarted.refresh()
    assert set(restarted.calendars) == {("team-a", "freeze"), ("team-b", "poison"), ("team-c", "far")}
    assert restarted.calendars[("team-a", "freeze")].problem is None


async def test_a_calendar_made_after_the_last_read_is_waited_for_and_one_still_missing_then_is_missing(
    pool: asyncpg.Pool
) -> None:
    book = CalendarBook(pool)
    assert not book.knows("team-a", ["freeze"])  # nothing read yet
    await book.refresh()
    assert book.knows("team-a", [])
    # Asked for a name the last read did not hold: it may have been made since. A read begun after
    # the question answers it, whether it finds the calendar or not.
    assert not book.knows("team-a", ["freeze", "later"])
    await put_calendar(pool, "team-a", "freeze", CalendarSpec())
    await book.refresh()
    assert book.knows("team-a", ["freeze", "later"])
    assert ("team-a", "freeze") in book.calendars and ("team-a", "later") not in book.calendars


async def test_the_scheduler_skips_the_slots_of_a_job_naming_an_unreadable_calendar_and_fires_by_the_others(
    pool: asyncpg.Pool, database_url: str, homes: Homes, client: httpx.AsyncClient, tokens: dict[str, str],
    target: Target
) -> None:
    team_b = auth_as(tokens["team-b"])
    assert (await client.put("/calendars/freeze", json=freeze_now())).status_code == 201
    assert (await client.put("/calendars/poison", json={}, headers=team_b)).status_code == 201
    frozen = await client.post("/jobs", json=job(target, "/frozen", {"everySec": 1, "excludeCalendars": ["freeze"]},
                                                 concurrency="allow"))
    poisoned = await client.post("/jobs", json=job(target, "/poisoned", {"everySec": 1,
                                                                         "excludeCalendars": ["poison"]},
                                                   concurrency="allow"), headers=team_b)
    plain = await client.post("/jobs", json=job(target, "/plain", {"everySec": 1}, concurrency="allow"),
                              headers=team_b)
    assert frozen.status_code == poisoned.status_code == plain.status_code == 201
    await write_around_the_api(pool, "team-b", "poison", windows=POISON_WINDOWS)
    async with running_fleet(pool, database_url, homes):
        await wait_for(lambda: _count(homes, plain.json()["jobId"], "succeeded", 3), timeout=20,
                       what="the plain job's runs")
        await wait_for(lambda: _count(homes, frozen.json()["jobId"], "skipped", 2), timeout=10,
                       what="the freeze's skipped slots")
        await wait_for(lambda: _count(homes, poisoned.json()["jobId"], "skipped", 2), timeout=10,
                       what="the poisoned job's skipped slots")
    assert not target.calls_to("/frozen") and not target.calls_to("/poisoned")
    for job_id, reason in [(frozen.json()["jobId"], "excluded by calendar freeze"),
                           (poisoned.json()["jobId"], "not run: calendar poison cannot be read (windows.0.start")]:
        pool_of = await homes.for_job(job_id)
        records = await pool_of.fetch("SELECT status, reason FROM runs WHERE job_id = $1", uuid.UUID(job_id))
        assert records and all(r["status"] == "skipped" and r["reason"].startswith(reason) for r in records)


async def test_a_node_fires_no_slot_of_a_job_naming_calendars_before_it_has_read_them(
    pool: asyncpg.Pool, database_url: str, homes: Homes, client: httpx.AsyncClient, target: Target
) -> None:
    """A node that cannot read the calendars yet (here: the table locked as the node starts) fires
    the other jobs, and holds the slots of the jobs naming calendars until it has read them."""
    assert (await client.put("/calendars/freeze", json=freeze_now())).status_code == 201
    frozen = await client.post("/jobs", json=job(target, "/frozen", {"everySec": 1, "excludeCalendars": ["freeze"]},
                                                 concurrency="allow"))
    plain = await client.post("/jobs", json=job(target, "/plain", {"everySec": 1}, concurrency="allow"))
    assert frozen.status_code == plain.status_code == 201
    frozen_id = frozen.json()["jobId"]
    async with pool.acquire() as locker:
        locked = locker.transaction()
        await locked.start()
        await locker.execute("LOCK TABLE calendars IN ACCESS EXCLUSIVE MODE")
        try:
            async with running_fleet(pool, database_url, homes) as fleet:
                await wait_for(lambda: _count(homes, plain.json()["jobId"], "succeeded", 3), timeout=20,
                               what="the plain job's runs while the calendars cannot be read")
                assert await _count(homes, frozen_id, None, 0, at_most=0), "a slot fired before the calendars were read"
                assert not fleet.node.calendars.loaded
                await locked.rollback()
                locked = None
                await wait_for(lambda: _count(homes, frozen_id, "skipped", 2), timeout=15,
                               what="the held slots, fired once the calendars were read")
        finally:
            if locked is not None:  # not released above: the test failed first
                await locked.rollback()
    assert not target.calls_to("/frozen")
    statuses = await (await homes.for_job(frozen_id)).fetch("SELECT DISTINCT status FROM runs WHERE job_id = $1",
                                                            uuid.UUID(frozen_id))
    assert [r["status"] for r in statuses] == ["skipped"]


async def _count(homes: Homes, job_id: str, status: str | None, at_least: int, at_most: int | None = None) -> bool:
    pool = await homes.for_job(job_id)
    found: int = await pool.fetchval(
        "SELECT count(*) FROM runs WHERE job_id = $1 AND ($2::text IS NULL OR status = $2)", uuid.UUID(job_id), status)
    return found >= at_least and (at_most is None or found <= at_most)
