"""GET /jobs filtered by tag, name prefix, paused and kind, with cursor paging, through the real API
and `chimes jobs list` (the API filters; the CLI only passes the options on)."""

from __future__ import annotations

import asyncio
import json

import httpx
from click.testing import CliRunner

from chimes.cli import client as cli_client

AT = {"at": "2031-01-01T00:00:00Z"}
NIGHTLY = {"cron": "0 3 * * *"}
EVERY_HOUR = {"every": "1h"}
TASK = {"type": "http", "url": "http://127.0.0.1:9/x"}


async def make_jobs(client: httpx.AsyncClient) -> dict[str, str]:
    """Seven jobs of team-a in this order, and one of team-b with a matching tag and name."""
    specs = [("report-daily", NIGHTLY, ["db"], False), ("report-once", AT, ["db"], False),
             ("report-paused", NIGHTLY, ["db", "slow"], True), ("cleanup", NIGHTLY, ["db"], False),
             ("Report-caps", NIGHTLY, ["db"], False), ("report-weekly", NIGHTLY, [], False),
             ("sweep", EVERY_HOUR, [], False)]
    ids = {}
    for name, schedule, tags, paused in specs:
        created = await client.post("/jobs", json={"name": name, "schedule": schedule, "task": TASK, "tags": tags})
        ids[name] = created.json()["jobId"]
        if paused:
            await client.patch(f"/jobs/{ids[name]}", json={"paused": True})
    return ids


async def names(client: httpx.AsyncClient, **query: object) -> list[str]:
    """Every job the filters let through, one page of 1 at a time, following the cursor."""
    found, cursor = [], None
    while True:
        page = await client.get("/jobs", params={**query, "limit": 1, **({"cursor": cursor} if cursor else {})})
        assert page.status_code == 200, page.text
        body = page.json()
        found += [j["name"] for j in body["jobs"]]
        cursor = body["nextCursor"]
        if cursor is None:
            return found


async def test_filters_combine_and_page_with_the_cursor(
    client: httpx.AsyncClient, api_url: str, tokens: dict[str, str]
) -> None:
    await make_jobs(client)
    other = httpx.AsyncClient(base_url=api_url, headers={"Authorization": f"Bearer {tokens['team-b']}"})
    async with other:
        await other.post("/jobs", json={"name": "report-b", "schedule": NIGHTLY, "task": TASK, "tags": ["db"]})
    assert await names(client, tag="db") == ["report-daily", "report-once", "report-paused", "cleanup",
                                             "Report-caps"]
    assert await names(client, namePrefix="report-") == ["report-daily", "report-once", "report-paused",
                                                         "report-weekly"]
    assert await names(client, paused="true") == ["report-paused"]
    assert await names(client, kind="at") == ["report-once"]
    assert await names(client, kind="interval") == ["sweep"]
    assert await names(client, tag="db", namePrefix="report", paused="false", kind="cron") == ["report-daily"]
    assert await names(client, tag="slow", paused="false") == []
    everything = await names(client)
    assert len(everything) == 7 and "report-b" not in everything


async def test_a_bad_filter_is_refused_by_name(client: httpx.AsyncClient) -> None:
    for query, field in (({"kind": "interval-ish"}, "kind"), ({"paused": "maybe"}, "paused"),
                         ({"tag": ""}, "tag"), ({"namePrefix": "x" * 201}, "namePrefix"),
                         ({"namePrefix": "a\x00b"}, "namePrefix"), ({"tag": "x\x00"}, "tag")):
        answer = await client.get("/jobs", params=query)
        assert answer.status_code == 422, (query, answer.text)
        assert answer.json()["field"] == field, answer.json()


async def test_the_cli_lists_with_the_apis_filters(client: httpx.AsyncClient, api_url: str,
                                                   tokens: dict[str, str]) -> None:
    await make_jobs(client)
    env = {"CHIMES_TOKEN": tokens["team-a"], "CHIMES_API_URL": api_url, "COLUMNS": "200"}

    async def listed(*args: str) -> list[str]:
        result = await asyncio.to_thread(CliRunner().invoke, cli_client.jobs, ["list", "--json", "--all", *args],
                                         env=env)
        assert result.exit_code == 0, result.output
        return [j["name"] for j in json.loads(result.output)["jobs"]]

    assert await listed("--tag", "db", "--active", "--kind", "cron") == ["report-daily", "cleanup", "Report-caps"]
    assert await listed("--paused") == ["report-paused"]
    assert await listed("--kind", "interval") == ["sweep"]
    assert await listed("--name-prefix", "Report") == ["Report-caps"]
