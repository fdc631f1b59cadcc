-- Interval schedules and bounds on recurring schedules (chimes.schedules).
--
-- * `every_sec`/`phase_sec`: a job that fires every `every_sec` seconds at `phase_sec` past each
--   multiple of it since the Unix epoch. A job now has exactly one of a cron expression, an interval
--   or a one-off time (`jobs_one_schedule`).
-- * `start_at`/`end_at`: a recurring job fires no slot before `start_at` and none after `end_at`.
-- * `max_runs`: a recurring job stops after that many slots. `job_slot_counts` counts the slots the
--   scheduler recorded for each job that has one (ran, held or skipped), written by the fire that
--   records them. A table of its own rather than a column of `jobs`: a fire deletes the job's trigger
--   and then counts, while an edit locks the job's row and then deletes its trigger; both writing
--   the job's row would lock the two rows in opposite orders and deadlock.
--
-- Adding nullable columns without defaults rewrites nothing; replacing the check constraint scans
-- `jobs` once under its ACCESS EXCLUSIVE lock (about a second at a million jobs). Mixed versions: a
-- scheduler node of an earlier version reads interval jobs as one-off jobs without a time and fires
-- their trigger once, without a next one; upgrade scheduler nodes before the API.
ALTER TABLE jobs
    ADD COLUMN every_sec integer,
    ADD COLUMN phase_sec integer,
    ADD COLUMN start_at timestamptz,
    ADD COLUMN end_at timestamptz,
    ADD COLUMN max_runs integer;

ALTER TABLE jobs DROP CONSTRAINT jobs_one_schedule;
ALTER TABLE jobs ADD CONSTRAINT jobs_one_schedule CHECK (num_nonnulls(cron, run_at, every_sec) = 1);
ALTER TABLE jobs ADD CONSTRAINT jobs_interval CHECK (
    (every_sec IS NULL AND phase_sec IS NULL)
    OR (every_sec >= 1 AND phase_sec >= 0 AND phase_sec < every_sec));
ALTER TABLE jobs ADD CONSTRAINT jobs_bounds CHECK (end_at > start_at);
ALTER TABLE jobs ADD CONSTRAINT jobs_max_runs CHECK (max_runs >= 1);

CREATE TABLE job_slot_counts (
    job_id uuid NOT NULL,
    slots_fired integer NOT NULL,
    CONSTRAINT job_slot_counts_pkey PRIMARY KEY (job_id)
);

-- Exclusion calendars (chimes.calendars): an owner's named days and windows, in the catalog, that
-- jobs refer to by name in `exclude_calendars`. Each write takes a new `version` from the sequence.
CREATE SEQUENCE calendar_versions;
CREATE TABLE calendars (
    owner text NOT NULL,
    name text NOT NULL,
    timezone text NOT NULL,
    dates date[] NOT NULL,
    windows jsonb NOT NULL,
    version bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT calendars_pkey PRIMARY KEY (owner, name)
);
ALTER TABLE jobs ADD COLUMN exclude_calendars text[];
