"""The dashboard in a real headless Chromium (Debian's ``chromium`` package, driven by Playwright).

Signs in with a token, creates a job through the API, finds it in the list, watches its runs
succeed, runs it now, opens a run and the fleet page. Screenshots of each page are saved in
``tests/e2e/screenshots/`` (or ``$CHIMES_SCREENSHOTS``) to be looked at; ``scripts/test`` installs
the browser when it is missing. Playwright never downloads a browser here: it drives the system one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from tests.integration.fleet import Fleet
from tests.target import Target

pytestmark = pytest.mark.long  # a browser driven through the dashboard

SCREENSHOTS = Path(os.environ.get("CHIMES_SCREENSHOTS", Path(__file__).parent / "screenshots"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-dev-shm-usage"]


def chromium_path() -> str:
    found = os.environ.get("CHIMES_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "no Chromium: install Debian's package (apt-get install chromium) or set CHIMES_CHROMIUM"
    return found


@pytest.fixture
def screenshots() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS


@pytest.fixture
async def browser(screenshots: Path) -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


async def shot(page: Page, name: str) -> None:
    await page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


async def test_sign_in_find_a_job_watch_it_run_run_it_now_and_see_the_fleet(
    browser: Browser, fleet: Fleet, api_url: str, tokens: dict[str, str], client: httpx.AsyncClient,
    target: Target,
) -> None:
    target.delays["/report"] = lambda n: 0.15 + 0.1 * (n % 4)  # a little work, so durations show
    target.responders["/report"] = lambda n: 503 if n in (3, 4) else 200  # and a run that fails
    context = await browser.new_context(viewport={"width": 1360, "height": 900}, base_url=api_url)
    page = await context.new_page()
    page.set_default_timeout(30_000)
    expect.set_options(timeout=30_000)  # pages refresh themselves every few seconds; runs come every 2 s
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    outside: list[str] = []
    page.on("request", lambda request: None if request.url.startswith(api_url) else outside.append(request.url))

    await page.goto("/")
    await expect(page.get_by_role("heading", name="Sign in to Chimes")).to_be_visible()
    await shot(page, "login")
    await page.get_by_label("API token").fill("chm_wrong")
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.get_by_role("alert")).to_contain_text("not valid")
    await page.get_by_label("API token").fill(tokens["team-a"])
    await page.get_by_role("button", name="Sign in").click()
    await expect(page.get_by_role("heading", name="Jobs")).to_be_visible()
    await expect(page.get_by_text("No jobs yet.")).to_be_visible()

    created = await client.post("/jobs", json={
        "name": "hourly-report", "schedule": {"cron": "*/2 * * * * *", "timezone": "Europe/Berlin"},
        "task": {"type": "http", "method": "POST", "url": f"{target.url}/report",
                 "headers": {"Authorization": "Bearer secret-value"}},
        "retryPolicy": {"maxAttempts": 2, "initialBackoffSec": 1},
    })
    assert created.status_code == 201, created.text
    job_id = created.json()["jobId"]
    await client.post("/jobs", json={"name": "nightly-backup", "schedule": {"cron": "0 3 * * *"},
                                     "task": {"type": "http", "url": f"{target.url}/backup"}})

    job_link = page.get_by_role("link", name="hourly-report")
    await expect(job_link).to_be_visible()  # the list refreshes itself
    await page.get_by_label("Search jobs by name").fill("night")
    await expect(page.get_by_role("link", name="nightly-backup")).to_be_visible()
    await expect(job_link).to_have_count(0)
    await page.get_by_label("Search jobs by name").fill("")
    await expect(job_link).to_be_visible()
    await expect(page.locator("#jobs-table .status-succeeded").first).to_be_visible()
    await shot(page, "jobs")

    await job_link.click()
    await expect(page.get_by_role("heading", name="hourly-report")).to_be_visible()
    await expect(page.get_by_text("secret-value")).to_have_count(0)  # the Authorization header is masked
    runs = page.locator("#runs tbody tr")
    await expect(runs.filter(has=page.locator(".status-succeeded")).nth(2)).to_be_visible()  # three runs
    await expect(page.locator("#runs .chart-box canvas")).to_be_visible()  # the lag/duration chart drew
    await shot(page, "job")

    await page.get_by_role("button", name="Run now").click()
    await expect(page.get_by_role("status")).to_contain_text("Run started")
    manual = page.locator("#runs tr.highlight")
    await expect(manual).to_contain_text("manual")
    await expect(manual.locator(".status-succeeded")).to_be_visible()

    await manual.get_by_role("link").first.click()
    await expect(page.get_by_role("heading", name="Run")).to_contain_text("succeeded")
    await expect(page.get_by_text("Attempt 1", exact=True)).to_be_visible()
    await expect(page.locator(".timeline .span-attempt-succeeded")).to_have_count(1)
    await shot(page, "run")

    await page.get_by_role("link", name="Fleet").click()
    await expect(page.get_by_role("heading", name="Fleet")).to_be_visible()
    await expect(page.get_by_text("node 1", exact=True)).to_be_visible()  # a team: no ids, hosts or pids
    await expect(page.get_by_text("worker 1", exact=True)).to_be_visible()
    await expect(page.get_by_text("test-node")).to_have_count(0)
    await expect(page.get_by_text("1024/1024")).to_be_visible()
    await shot(page, "fleet")

    await page.goto(f"/ui/jobs/{job_id}")
    await page.get_by_role("button", name="Pause").click()
    await expect(page.get_by_role("status")).to_contain_text("Paused")
    await expect(page.get_by_role("button", name="Resume")).to_be_visible()

    await context.close()
    assert errors == [], f"JavaScript errors on the pages: {errors}"
    assert outside == [], f"the dashboard fetched something from outside Chimes: {outside}"
