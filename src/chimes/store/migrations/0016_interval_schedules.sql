-- Interval schedules and bounds on recurring schedules (chimes.schedules).
--
-- * `every_sec`/`phase_sec`: a job that fires every `every_sec` seconds at `phase_sec` past each
--   multiple of it since the Unix epoch. A job now has exactly one of a cron expression, an interval
--   or a one-off time (`jobs_one_schedule`).
-- * `start_at`/`end_at`: a recurring job fires no slot before `start_at` and none after `end_at`.
--
-- Adding nullable columns without defaults rewrites nothing; replacing the check constraint scans
-- `jobs` once under its ACCESS EXCLUSIVE lock (about a second at a million jobs). Mixed versions: a
-- scheduler node of an earlier version reads interval jobs as one-off jobs without a time and fires
-- their trigger once, without a next one; upgrade scheduler nodes before the API.
ALTER TABLE jobs
    ADD COLUMN every_sec integer,
    ADD COLUMN phase_sec integer,
    ADD COLUMN start_at timestamptz,
    ADD COLUMN end_at timestamptz;

ALTER TABLE jobs DROP CONSTRAINT jobs_one_schedule;
ALTER TABLE jobs ADD CONSTRAINT jobs_one_schedule CHECK (num_nonnulls(cron, run_at, every_sec) = 1);
ALTER TABLE jobs ADD CONSTRAINT jobs_interval CHECK (
    (every_sec IS NULL AND phase_sec IS NULL)
    OR (every_sec >= 1 AND phase_sec >= 0 AND phase_sec < every_sec));
ALTER TABLE jobs ADD CONSTRAINT jobs_bounds CHECK (end_at > start_at);
