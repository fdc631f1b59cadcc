-- Calendars are read with their dates and windows as text and parsed one by one in Python
-- (chimes.calendars.Calendar.stored): a row the driver cannot decode (a date past year 9999, a
-- number too large for a JSON parser), written around the API, makes that calendar unusable, never
-- the whole read.

-- name: put_calendar
-- A write adds one to the calendar's own version (a new calendar starts at 1); the row's `change`
-- is set by its trigger (migration 0023), which scheduler nodes watch.
INSERT INTO calendars AS c (owner, name, timezone, dates, windows, version)
VALUES ($1, $2, $3, $4, $5, 1)
ON CONFLICT (owner, name) DO UPDATE
SET timezone = excluded.timezone, dates = excluded.dates, windows = excluded.windows,
    version = c.version + 1, updated_at = now()
RETURNING version, (xmax = 0) AS created;

-- name: get_calendar
SELECT owner, name, timezone, array(SELECT to_char(d, 'YYYY-MM-DD') FROM unnest(dates) WITH ORDINALITY AS u(d, i)
                                    ORDER BY i) AS dates,
       windows::text AS windows, version, updated_at
FROM calendars WHERE owner = $1 AND name = $2;

-- name: list_calendars
SELECT owner, name, timezone, array(SELECT to_char(d, 'YYYY-MM-DD') FROM unnest(dates) WITH ORDINALITY AS u(d, i)
                                    ORDER BY i) AS dates,
       windows::text AS windows, version, updated_at
FROM calendars
WHERE ($1::text IS NULL OR owner = $1)
ORDER BY owner, name;

-- name: calendars_of_owners
-- Every calendar of the owners $1: what the jobs of a page of the API name.
SELECT owner, name, timezone, array(SELECT to_char(d, 'YYYY-MM-DD') FROM unnest(dates) WITH ORDINALITY AS u(d, i)
                                    ORDER BY i) AS dates,
       windows::text AS windows
FROM calendars
WHERE owner = ANY($1::text[]);

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
-- A write replaces a row's `change` by a number no row had (its sum changes), a delete lowers the
-- count: a node that holds the same two holds every calendar as it is. The sum, not the newest
-- change: a write that took its number before another but commits after it would not raise the
-- newest. An index-only read of calendars_change.
SELECT coalesce(sum(change), 0) AS changes, count(*) AS calendars FROM calendars;

-- name: calendar_changes
-- Each calendar's last change: a node reads again only the calendars whose change it does not hold.
SELECT owner, name, change FROM calendars;

-- name: calendars_by_key
SELECT c.owner, c.name, c.change, c.timezone,
       array(SELECT to_char(d, 'YYYY-MM-DD') FROM unnest(c.dates) WITH ORDINALITY AS u(d, i) ORDER BY i) AS dates,
       c.windows::text AS windows
FROM calendars c JOIN unnest($1::text[], $2::text[]) AS k(owner, name) ON c.owner = k.owner AND c.name = k.name;
