-- name: put_calendar
-- Every write takes a new version from the sequence: scheduler nodes compare the newest version and
-- the count with what they hold (calendar_fingerprint) and reload when either changed.
INSERT INTO calendars (owner, name, timezone, dates, windows, version)
VALUES ($1, $2, $3, $4, $5, nextval('calendar_versions'))
ON CONFLICT (owner, name) DO UPDATE
SET timezone = excluded.timezone, dates = excluded.dates, windows = excluded.windows,
    version = excluded.version, updated_at = now()
RETURNING version, (xmax = 0) AS created;

-- name: get_calendar
SELECT owner, name, timezone, dates, windows, version, updated_at FROM calendars WHERE owner = $1 AND name = $2;

-- name: list_calendars
SELECT owner, name, timezone, dates, windows, version, updated_at FROM calendars
WHERE ($1::text IS NULL OR owner = $1)
ORDER BY owner, name;

-- name: delete_calendar
DELETE FROM calendars WHERE owner = $1 AND name = $2 RETURNING name;

-- name: lock_calendar
-- Held while a delete checks that no job refers to the calendar.
SELECT name FROM calendars WHERE owner = $1 AND name = $2 FOR UPDATE;

-- name: missing_calendars
-- Of the names $2, those the owner $1 has no calendar by.
SELECT wanted.name FROM unnest($2::text[]) AS wanted(name)
WHERE NOT EXISTS (SELECT 1 FROM calendars c WHERE c.owner = $1 AND c.name = wanted.name);

-- name: share_calendars
-- The calendars a job being written refers to, locked until it is: a delete of one of them waits,
-- then finds the job.
SELECT name FROM calendars WHERE owner = $1 AND name = ANY($2::text[]) FOR SHARE;

-- name: jobs_using_calendar
SELECT job_id FROM jobs WHERE owner = $1 AND $2 = ANY(exclude_calendars) ORDER BY job_id LIMIT $3;

-- name: calendar_fingerprint
SELECT coalesce(max(version), 0) AS version, count(*) AS calendars FROM calendars;

-- name: all_calendars
SELECT owner, name, timezone, dates, windows FROM calendars;
