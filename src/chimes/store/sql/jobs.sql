-- name: insert_job
-- {spec_columns}, {spec_values}: the columns of a job's definition (chimes.store.jobs.JobColumns), each
-- bound by its name.
INSERT INTO jobs (job_id, owner, {spec_columns}, paused, idempotency_key, request_hash)
VALUES ($job_id, $owner, {spec_values}, false, $idempotency_key, $request_hash)
ON CONFLICT (owner, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING job_id;

-- name: job_by_idempotency_key
SELECT job_id, request_hash FROM jobs WHERE owner = $1 AND idempotency_key = $2;

-- name: insert_schedule_trigger
-- Written under the job's row lock, so $4 is its current version. A fire that ran concurrently with
-- this edit may have left its next trigger at this very key, at the old version (the edit's delete
-- could not see that uncommitted row): it becomes this version's trigger, or the job would keep only
-- a stale one, which fires nothing, and never fire again.
INSERT INTO triggers (partition_id, fire_at, trigger_id, job_id, job_version, kind)
VALUES ($1, $2, $3, $3, $4, 0)
ON CONFLICT (partition_id, fire_at, trigger_id) DO UPDATE SET job_version = excluded.job_version
WHERE triggers.job_version < excluded.job_version;

-- name: delete_schedule_triggers
DELETE FROM triggers WHERE job_id = $1 AND kind = 0;

-- name: lock_schedule_triggers
-- The job's schedule triggers, locked until the edit commits: a fire of one of them that is under
-- way (its row locked) ends first, and a fire that comes after finds the edit's triggers.
SELECT fire_at FROM triggers WHERE job_id = $1 AND kind = 0 FOR UPDATE;

-- name: schedule_triggers_now
-- Read again once lock_schedule_triggers has waited for the fires under way: a statement of its own
-- sees the next trigger such a fire wrote, which the first did not. With the database's clock, which
-- says which of them are due, as it does for the scheduler.
SELECT clock_timestamp() AS now, coalesce(array_agg(t.fire_at ORDER BY t.fire_at), '{}') AS fire_ats
FROM (SELECT fire_at FROM triggers WHERE job_id = $1 AND kind = 0 FOR UPDATE) t;

-- name: set_carried
-- The slots of the definition before an edit or a pause that were due and had not fired, for the
-- trigger kept for them (migration 0022); all NULL when none.
UPDATE jobs SET carried_until = $2, carried_slots = $3, carried_unrecorded = $4 WHERE job_id = $1;

-- name: count_nodes_firing_by_version
-- Scheduler nodes of a release before 0.3.4 live on this database: they fire a trigger only at its
-- job's very version and know nothing of triggers kept for due slots, so that an edit rewrites the
-- trigger as those releases did (chimes.services.jobs).
SELECT count(*) FROM scheduler_nodes
WHERE heartbeat_at > now() - interval '30 seconds'
  AND (release IS NULL OR (regexp_match(release, '^(\d+)\.(\d+)\.(\d+)'))::int[] < ARRAY[0, 3, 4]);

-- name: get_job
SELECT j.*,
       (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) AS slots_fired,
       (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM jobs j
WHERE j.job_id = $1 AND ($2::text IS NULL OR j.owner = $2);

-- name: lock_job
-- Every change of a job begins here. chimes_refuse_moved: the job's partition is being moved away
-- from this database (or has been), and the writer's map is older than the move: SQLSTATE CH001,
-- and the API reads the map again and retries where the job lives now (migration 0021). Checked
-- once, in a subquery of its own, whether or not the row is here: the source may have deleted it.
SELECT j.*, (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) AS slots_fired
FROM (SELECT chimes_refuse_moved($1::uuid)) AS fence, jobs j
WHERE j.job_id = $1 AND ($2::text IS NULL OR j.owner = $2)
FOR UPDATE OF j;

-- name: list_jobs
-- One owner's jobs in creation order: a range read of jobs_owner (a separate statement from the
-- admin's, so that neither plan has to serve both). The filters ($4 a tag, $5 a name prefix, $6
-- paused or not, $7 the schedule kind; NULL: any) are checked on the rows of that range read, so a
-- page of a rare filter reads further into the owner's jobs to fill itself.
SELECT j.*,
       (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) AS slots_fired,
       (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM jobs j
WHERE j.owner = $1 AND j.job_id > $2
  AND ($4::text IS NULL OR $4 = ANY (j.tags))
  AND ($5::text IS NULL OR starts_with(j.name, $5))
  AND ($6::boolean IS NULL OR j.paused = $6)
  AND ($7::text IS NULL OR $7 = CASE WHEN j.cron IS NOT NULL THEN 'cron' WHEN j.every_sec IS NOT NULL THEN 'interval'
                                   ELSE 'at' END)
ORDER BY j.job_id
LIMIT $3;

-- name: list_all_jobs
SELECT j.*,
       (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) AS slots_fired,
       (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM jobs j
WHERE j.job_id > $1
  AND ($3::text IS NULL OR $3 = ANY (j.tags))
  AND ($4::text IS NULL OR starts_with(j.name, $4))
  AND ($5::boolean IS NULL OR j.paused = $5)
  AND ($6::text IS NULL OR $6 = CASE WHEN j.cron IS NOT NULL THEN 'cron' WHEN j.every_sec IS NOT NULL THEN 'interval'
                                   ELSE 'at' END)
ORDER BY j.job_id
LIMIT $2;

-- name: last_runs
SELECT DISTINCT ON (r.job_id) r.job_id, r.run_id, r.status, r.scheduled_at, r.finished_at, r.error
FROM unnest($1::uuid[]) AS wanted(job_id)
CROSS JOIN LATERAL (
    SELECT * FROM runs WHERE runs.job_id = wanted.job_id ORDER BY scheduled_at DESC LIMIT 1
) r;

-- name: update_job
-- {spec_assignments}: each column of a job's definition (chimes.store.jobs.JobColumns) set to its own
-- parameter.
UPDATE jobs SET {spec_assignments}, paused = $paused,
                -- $moment: the instant the edit decided by (the database's clock), or now()
                paused_at = CASE WHEN $paused AND NOT paused THEN coalesce($moment, now()) ELSE paused_at END,
                resumed_at = CASE WHEN paused AND NOT $paused THEN coalesce($moment, now()) ELSE resumed_at END,
                -- who paused it ($actor) and why ($pause_note), kept while it stays paused
                paused_by = CASE WHEN NOT $paused THEN NULL WHEN NOT paused THEN $actor ELSE paused_by END,
                pause_note = CASE WHEN NOT $paused THEN NULL WHEN NOT paused THEN $pause_note ELSE pause_note END,
                version = version + 1, updated_at = now()
WHERE job_id = $job_id
RETURNING version, plan_version, paused_at, resumed_at;

-- name: record_pause
-- A pause begins ($2 its start, $3 who, $4 why) or, with $2 NULL, the job's open pause ends ($5 the
-- resume, $3 who): the job's history of pauses (GET /jobs/{id}/pauses).
WITH begun AS (
    INSERT INTO job_pauses (job_id, paused_at, paused_by, note)
    SELECT $1, $2, $3, $4 WHERE $2::timestamptz IS NOT NULL
    ON CONFLICT DO NOTHING
)
UPDATE job_pauses SET resumed_at = $5, resumed_by = $3
WHERE $2::timestamptz IS NULL AND job_id = $1 AND resumed_at IS NULL;

-- name: job_pauses
-- The job's pauses, newest first.
SELECT paused_at, paused_by, note, resumed_at, resumed_by FROM job_pauses
WHERE job_id = $1 ORDER BY paused_at DESC LIMIT $2;

-- name: track_unfinished_runs
-- A job changed from concurrency allow to skip or queue: its unfinished runs, which allow did not
-- track, now count as active (fire_triggers). Run after the job's schedule trigger was rewritten, so a
-- fire of the old version either committed before (its runs are seen here) or finds nothing to fire.
INSERT INTO active_runs (job_id, run_id, scheduled_at)
SELECT job_id, run_id, scheduled_at FROM runs WHERE job_id = $1 AND status IN ('scheduled', 'running')
ON CONFLICT DO NOTHING;

-- name: delete_job
WITH deleted AS (
    DELETE FROM jobs WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2) RETURNING job_id
),
forgotten AS (
    DELETE FROM job_pauses p USING deleted d WHERE p.job_id = d.job_id
)
SELECT job_id FROM deleted;

-- name: delete_slot_count
DELETE FROM job_slot_counts WHERE job_id = $1;


-- name: count_nodes_before_releases
-- Scheduler nodes of release 0.1.0 (they record no release) live on this database, as
-- upgrades.sql's live_processes counts them: a rolling upgrade is under way.
SELECT count(*) FROM scheduler_nodes WHERE release IS NULL AND heartbeat_at > now() - interval '30 seconds';
