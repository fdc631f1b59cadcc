"""The chaos workload: recurring jobs with retries and timeouts, and one-off jobs made during the run.

Most recurring jobs use concurrency ``allow``, so every slot must leave a run that runs; a few use
``skip`` with slow tasks, so some slots are legitimately recorded as skipped. Tasks call the chaos
target, whose URL says how each job behaves: ``fail`` (probability of a 500) and ``work`` (seconds).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from chimes import cron

log = logging.getLogger(__name__)

OWNER = "chaos"
PROBE_EVERY_SEC = 0.25


@dataclass(frozen=True, slots=True)
class Answer:
    """One write the harness sent the API and what came back (epoch seconds, the harness's clock)."""

    what: str  # "create" or "probe"
    sent: float
    answered: float
    status: int | None  # None: no answer (a transport error or the client's timeout)
    detail: str = ""


@dataclass
class Answers:
    """Every write's answer, for the invariant that the API answers only 2xx, 429 or 503."""

    log: list[Answer] = field(default_factory=list)

    def add(self, what: str, sent: float, status: int | None, detail: str = "") -> None:
        self.log.append(Answer(what, sent, time.time(), status, detail))


@dataclass(frozen=True, slots=True)
class ChaosJob:
    job_id: uuid.UUID
    name: str
    concurrency: str
    cron: str | None  # None: a one-off job
    first_slot: datetime  # nextRunAt when created (the `at` of a one-off)

    def slots(self, until: datetime) -> list[datetime]:
        """Every slot the schedule implies from the job's creation up to ``until``."""
        if self.first_slot > until:
            return []
        if self.cron is None:
            return [self.first_slot]
        following = cron.fire_times(cron.CronSchedule(self.cron, "UTC"), self.first_slot, until, limit=10_000_000)
        return [self.first_slot, *following]


def recurring_jobs(seed: int | str, count: int, target_url: str) -> list[dict[str, Any]]:
    rng = random.Random(f"{seed}-workload")
    jobs = []
    for i in range(count):
        skip = i % 6 == 5  # one in six: concurrency skip, with tasks slow enough to overlap the next slot
        every = 2 if skip else rng.choice([1, 2, 3, 4, 5])
        fail = 0.0 if skip else rng.choice([0.0, 0.0, 0.1, 0.3])
        work = round(rng.uniform(0.5, 3.0), 2) if skip else rng.choice([0.0, 0.0, 0.0, 0.2, 1.0])
        jobs.append({
            "name": f"chaos-{i:03d}",
            "schedule": {"cron": f"*/{every} * * * * *"},
            # callback: the lease token goes only to callback tasks, and invariant 4 reads it at the
            # target (one token per attempt); the target answers 200 or 500, never 202, so runs end at once.
            "task": {"type": "http", "method": "POST", "url": f"{target_url}/job/{i}?fail={fail}&work={work}",
                     "body": {"job": i}, "callback": True},
            "retryPolicy": {"maxAttempts": rng.choice([3, 5]), "initialBackoffSec": 0.5, "maxBackoffSec": 2,
                            "multiplier": 2},
            "timeoutSec": 5 if skip else 2,
            "concurrency": "skip" if skip else "allow",
        })
    return jobs


async def create_job(api: httpx.AsyncClient, body: dict[str, Any], key: str, give_up_at: float,
                     answers: Answers | None = None) -> ChaosJob:
    """Create a job, retrying with the same Idempotency-Key while the fleet is being broken."""
    loop = asyncio.get_running_loop()
    answers = answers if answers is not None else Answers()
    while True:
        wait = 0.5
        sent = time.time()
        try:
            response = await api.post("/jobs", json=body, headers={"Idempotency-Key": key})
            detail = response.text[:200] if response.status_code >= 500 else ""
            answers.add("create", sent, response.status_code, detail)
            if response.status_code == 429 and response.headers.get("Retry-After", "").isdigit():
                wait = min(float(response.headers["Retry-After"]), 5.0)  # the API says when
            if response.status_code in (200, 201):
                created = response.json()
                schedule = body["schedule"]
                first = datetime.fromisoformat(schedule.get("at") or created["nextRunAt"])
                return ChaosJob(uuid.UUID(created["jobId"]), body["name"], body.get("concurrency", "skip"),
                                schedule.get("cron"), first)
            if response.status_code < 500 and response.status_code != 429:
                raise RuntimeError(f"creating {body['name']} failed: {response.status_code} {response.text}")
        except httpx.TransportError as exc:
            answers.add("create", sent, None, repr(exc))
            log.info("creating %s: %s; retrying with the same Idempotency-Key", body["name"], exc)
        if loop.time() > give_up_at:
            raise RuntimeError(f"creating {body['name']} kept failing")
        await asyncio.sleep(wait)


async def make_one_offs(api: httpx.AsyncClient, target_url: str, seed: int | str, every_sec: float,
                        until: float, made: list[ChaosJob], answers: Answers) -> None:
    """Every ``every_sec`` seconds (loop time) until ``until``, a one-off job a few seconds ahead."""
    rng = random.Random(f"{seed}-one-offs")
    loop = asyncio.get_running_loop()
    number = 0
    while loop.time() + every_sec < until:
        await asyncio.sleep(every_sec)
        at = (datetime.now(UTC) + timedelta(seconds=rng.uniform(2, 8))).replace(microsecond=0)
        body = {"name": f"chaos-once-{number:04d}", "schedule": {"at": at.isoformat()},
                "task": {"type": "http", "method": "POST", "url": f"{target_url}/once/{number}?fail=0.1&work=0",
                         "callback": True},  # for the lease token, as above
                "retryPolicy": {"maxAttempts": 5, "initialBackoffSec": 0.5, "maxBackoffSec": 2},
                "timeoutSec": 2, "concurrency": "allow"}
        made.append(await create_job(api, body, f"chaos-once-{seed}-{number}", loop.time() + 60, answers))
        number += 1


@dataclass
class WriteProbe:
    """Renames one job (``chaos-write-probe N``, N rising) every quarter second through the fault
    phase: when writes stop and resume, and, read back at the end, whether the last edit the API
    acknowledged survived (the name holds that N, or a later one whose answer was lost)."""

    job_id: uuid.UUID
    answers: Answers
    acknowledged: int = -1  # the last N answered 200
    acknowledged_at: list[float] = field(default_factory=list)  # when each 200 came back

    async def run(self, api: httpx.AsyncClient, until: float) -> None:
        loop = asyncio.get_running_loop()
        number = 0
        while loop.time() < until:
            sent = time.time()
            try:
                response = await api.patch(f"/jobs/{self.job_id}", json={"name": probe_name(number)})
                self.answers.add("probe", sent, response.status_code,
                                 response.text[:200] if response.status_code >= 400 else "")
                if response.status_code == 200:
                    self.acknowledged = number
                    self.acknowledged_at.append(time.time())
            except httpx.TransportError as exc:
                self.answers.add("probe", sent, None, repr(exc))
            number += 1
            await asyncio.sleep(max(0.0, sent + PROBE_EVERY_SEC - time.time()))


PROBE_NAME = "chaos-write-probe"


def probe_name(number: int) -> str:
    return f"{PROBE_NAME} {number}"


def probe_number(name: str) -> int | None:
    """N from a probe job's name (None for any other name)."""
    prefix = PROBE_NAME + " "
    return int(name[len(prefix):]) if name.startswith(prefix) and name[len(prefix):].isdigit() else None


def probe_job(target_url: str) -> dict[str, Any]:
    """The probe's job fires once a year (never during a run): its edits are all it does."""
    return {"name": PROBE_NAME, "schedule": {"cron": "0 0 1 1 *"},
            "task": {"type": "http", "method": "POST", "url": f"{target_url}/probe"}}
