"""Writes N jobs as JSON Lines for ``chimes jobs import``: a realistic mix of cron schedules and zones.

    python -m bench.make_jobs 1000000 > jobs.jsonl     (the `load` scenario uses it)
"""

from __future__ import annotations

import random
import sys
from typing import BinaryIO

import orjson

CRONS = ["0 * * * *", "*/5 * * * *", "*/15 * * * *", "0 2 * * *", "30 6 * * 1-5", "0 0 1 * *", "17 */3 * * *"]
ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Asia/Tokyo", "Australia/Sydney", "Asia/Kolkata"]


def main(count: int, seed: int = 1) -> None:
    write(sys.stdout.buffer, count, seed)


def write(out: BinaryIO, count: int, seed: int = 1) -> None:
    rand = random.Random(seed)
    for i in range(count):
        job = {
            "name": f"job-{i}",
            "schedule": {"cron": rand.choice(CRONS), "timezone": rand.choice(ZONES)},
            "task": {"type": "http", "method": "POST", "url": f"http://127.0.0.1:9000/hooks/{i % 1000}",
                     "headers": {"X-Team": f"team-{i % 50}"}, "body": {"job": i}},
            "retryPolicy": {"maxAttempts": 3},
            "timeoutSec": 60,
        }
        out.write(orjson.dumps(job) + b"\n")


if __name__ == "__main__":
    main(int(sys.argv[1]))
