-- name: insert_job
INSERT INTO jobs (job_id, owner, name, cron, run_at, timezone, jitter_sec, task, retry_policy,
                  timeout_sec, concurrency, priority, dst_gap, dst_fold, catch_up, queue_limit, tags, notify_url,
                  start_deadline_sec, every_sec, phase_sec, start_at, end_at, max_runs, exclude_calendars, paused,
                  idempotency_key, request_hash)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23,
        $24, $25, false, $26, $27)
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

-- name: get_job
SELECT j.*,
       (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) AS slots_fired,
       (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM jobs j
WHERE j.job_id = $1 AND ($2::text IS NULL OR j.owner = $2);

-- name: lock_job
SELECT j.*, (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) AS slots_fired
FROM jobs j WHERE j.job_id = $1 AND ($2::text IS NULL OR j.owner = $2) FOR UPDATE OF j;

-- name: list_jobs
-- One owner's jobs in creation order: a range read of jobs_owner (a separate statement from the
-- admin's, so that neither plan has to serve both).
SELECT j.*,
       (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) AS slots_fired,
       (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM jobs j
WHERE j.owner = $1 AND j.job_id > $2
ORDER BY j.job_id
LIMIT $3;

-- name: list_all_jobs
SELECT j.*,
       (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) AS slots_fired,
       (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM jobs j
WHERE j.job_id > $1
ORDER BY j.job_id
LIMIT $2;

-- name: last_runs
SELECT DISTINCT ON (r.job_id) r.job_id, r.run_id, r.status, r.scheduled_at, r.finished_at, r.error
FROM unnest($1::uuid[]) AS wanted(job_id)
CROSS JOIN LATERAL (
    SELECT * FROM runs WHERE runs.job_id = wanted.job_id ORDER BY scheduled_at DESC LIMIT 1
) r;

-- name: update_job
UPDATE jobs SET name = $2, cron = $3, run_at = $4, timezone = $5, jitter_sec = $6, task = $7,
                retry_policy = $8, timeout_sec = $9, concurrency = $10, priority = $11, dst_gap = $12,
                dst_fold = $13, catch_up = $14, queue_limit = $15, tags = $16, notify_url = $17,
                start_deadline_sec = $18, every_sec = $19, phase_sec = $20, start_at = $21, end_at = $22,
                max_runs = $23, exclude_calendars = $24, paused = $25,
                paused_at = CASE WHEN $25 AND NOT paused THEN now() ELSE paused_at END,
                resumed_at = CASE WHEN paused AND NOT $25 THEN now() ELSE resumed_at END,
                version = version + 1, updated_at = now()
WHERE job_id = $1
RETURNING version;

-- name: track_unfinished_runs
-- A job changed from concurrency allow to skip or queue: its unfinished runs, which allow did not
-- track, now count as active (fire_triggers). Run after the job's schedule trigger was rewritten, so a
-- fire of the old version either committed before (its runs are seen here) or finds nothing to fire.
INSERT INTO active_runs (job_id, run_id, scheduled_at)
SELECT job_id, run_id, scheduled_at FROM runs WHERE job_id = $1 AND status IN ('scheduled', 'running')
ON CONFLICT DO NOTHING;

-- name: delete_job
DELETE FROM jobs WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2) RETURNING job_id;

-- name: delete_slot_count
DELETE FROM job_slot_counts WHERE job_id = $1;

