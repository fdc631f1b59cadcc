-- Run history as the API reads it, and the runs the API itself starts or stops.

-- name: list_runs
SELECT * FROM runs
WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2) AND ($3::text IS NULL OR status = $3)
  AND ($4::timestamptz IS NULL OR (scheduled_at, run_id) < ($4, $5::uuid))
ORDER BY scheduled_at DESC, run_id DESC
LIMIT $6;

-- name: run_partition
-- By primary key: the run id carries its scheduled time. NULL: not here.
SELECT partition_id FROM runs WHERE run_id = $1 AND scheduled_at = $2;

-- name: get_run
SELECT * FROM runs WHERE run_id = $1 AND scheduled_at = $2 AND ($3::text IS NULL OR owner = $3);

-- name: run_attempts
-- The attempts that ended: their rows, and a success kept on the run (migration 0013).
SELECT attempt, worker_id, status, started_at, finished_at, error, output
FROM run_attempt_history WHERE run_id = $1 AND scheduled_at = $2 ORDER BY attempt;

-- name: job_owner
SELECT owner FROM jobs WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2);

-- name: history_owner
-- The owner of a job's run history, which outlives the job (a deleted job's runs stay until retention
-- drops their partitions): ownership is checked on the runs themselves.
SELECT owner FROM runs WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2) LIMIT 1;

-- name: start_run_now
-- A manual run or a re-run: created and enqueued at once, outside the schedule, with an id of its own
-- (ids.new_run_id), so each call is a run of its own.
WITH job AS (
    SELECT job_id, owner, version, priority FROM (SELECT chimes_refuse_moved($1::uuid)) AS fence, jobs  -- as lock_job
    WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2)
),
created AS (
    INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority, fired_at)
    SELECT $3, $4, job_id, owner, $5, version, $6, priority, $4 FROM job
    ON CONFLICT DO NOTHING
    RETURNING run_id, scheduled_at, job_id, priority
),
activated AS (
    INSERT INTO active_runs (job_id, run_id, scheduled_at) SELECT job_id, run_id, scheduled_at FROM created
),
enqueued AS (
    INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
    SELECT priority, run_id, scheduled_at, job_id FROM created
    RETURNING run_id
)
SELECT (SELECT count(*) FROM job) AS job_found, (SELECT owner FROM job) AS owner,
       (SELECT count(*) FROM enqueued) AS enqueued;

-- name: cancel_run
-- Ends a run that has not finished. An attempt in progress is recorded as cancelled, with who
-- cancelled it ($4), in the same statement: the worker that held it can no longer write its outcome
-- (the lease token is gone). The caller then tells that worker at once (NOTIFY on CANCEL_CHANNEL).
WITH target AS (
    SELECT run_id, scheduled_at, status AS was, worker_id, attempt, started_at FROM runs
    WHERE run_id = $1 AND scheduled_at = $2 AND ($3::text IS NULL OR owner = $3)
      AND status IN ('scheduled', 'running') AND chimes_refuse_moved(job_id)  -- as lock_job
    FOR UPDATE
),
cancelled AS (
    UPDATE runs r SET status = 'cancelled', finished_at = now(), error = $4, lease_token = NULL
    FROM target t
    WHERE r.run_id = t.run_id AND r.scheduled_at = t.scheduled_at
    RETURNING r.run_id, r.scheduled_at, r.job_id, r.partition_id, t.was, t.worker_id, t.attempt, t.started_at
),
interrupted AS (
    INSERT INTO run_attempts (run_id, scheduled_at, attempt, worker_id, status, started_at, finished_at, error)
    SELECT run_id, scheduled_at, attempt, worker_id, 'cancelled', started_at, now(), $4
    FROM cancelled WHERE was = 'running'
    ON CONFLICT DO NOTHING
),
-- Only a run that was waiting can be in the queue; the queue has no index on run_id (migration 0014).
dequeued AS (
    DELETE FROM run_queue q USING cancelled c WHERE q.run_id = c.run_id AND c.was = 'scheduled'
),
unleased AS (
    DELETE FROM run_leases WHERE run_id IN (SELECT run_id FROM cancelled)
),
untriggered AS (
    DELETE FROM triggers t USING cancelled c
    WHERE t.partition_id = c.partition_id AND t.trigger_id = c.run_id AND t.kind = 1
)
SELECT run_id, scheduled_at, job_id, was = 'running' AS was_running FROM cancelled;

-- name: job_for_backfill
SELECT job_id, owner, version, priority, cron, timezone, dst_gap, dst_fold, every_sec, phase_sec, start_at, end_at,
       exclude_calendars
FROM (SELECT chimes_refuse_moved($1::uuid)) AS fence, jobs  -- as lock_job
WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2);

-- name: backfill_runs
-- The runs a schedule would have made in a past range; a slot that already has a run keeps it. A
-- slot with a reason in $5 is recorded as skipped (a calendar excludes it), as the scheduler records it.
WITH slot AS (
    SELECT * FROM unnest($2::uuid[], $3::timestamptz[], $5::text[]) AS s(run_id, scheduled_at, skipped_because)
),
job AS (
    SELECT job_id, owner, version, priority FROM (SELECT chimes_refuse_moved($1::uuid)) AS fence, jobs  -- as lock_job
    WHERE job_id = $1
),
created AS (
    INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority, fired_at,
                      status, finished_at, reason)
    SELECT s.run_id, s.scheduled_at, j.job_id, j.owner, $4, j.version, 'catchup', j.priority, now(),
           CASE WHEN s.skipped_because IS NULL THEN 'scheduled' ELSE 'skipped' END,
           CASE WHEN s.skipped_because IS NOT NULL THEN now() END, coalesce(s.skipped_because, 'backfill')
    FROM slot s CROSS JOIN job j
    ON CONFLICT DO NOTHING
    RETURNING run_id, scheduled_at, job_id, priority, status
),
activated AS (
    INSERT INTO active_runs (job_id, run_id, scheduled_at)
    SELECT job_id, run_id, scheduled_at FROM created WHERE status = 'scheduled'
),
enqueued AS (
    INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
    SELECT priority, run_id, scheduled_at, job_id FROM created WHERE status = 'scheduled'
)
SELECT run_id, status = 'skipped' AS skipped FROM created;

-- name: queue_depth
SELECT tier, count(*) AS depth, min(enqueued_at) AS oldest_enqueued_at
FROM run_queue GROUP BY tier ORDER BY tier;

-- name: callback_heartbeat
-- A target's heartbeat extends the run's own lease (a callback task's run has one from its claim).
UPDATE run_leases l SET expires_at = now() + make_interval(secs => $5)
FROM runs r
WHERE l.run_id = $1 AND l.token = $4
  AND r.run_id = l.run_id AND r.scheduled_at = l.scheduled_at AND r.scheduled_at = $2
  AND ($3::text IS NULL OR r.owner = $3)
RETURNING l.expires_at;

-- name: callback_own_lease
-- The first heartbeat of a run that shares its claim's lease (any target may heartbeat with the token
-- it was sent): from now on the run has a lease of its own, which overrides the claim's. The run is
-- locked first, so that a reaper or a cancel ending it meanwhile is waited for and then seen.
WITH held AS (
    SELECT r.run_id, r.scheduled_at, r.partition_id, r.lease_token FROM runs r
    WHERE r.run_id = $1 AND r.scheduled_at = $2 AND ($3::text IS NULL OR r.owner = $3)
      AND r.status = 'running' AND r.lease_token = $4
    FOR NO KEY UPDATE
)
INSERT INTO run_leases (run_id, scheduled_at, partition_id, token, expires_at, deadline_at)
SELECT h.run_id, h.scheduled_at, h.partition_id, h.lease_token, now() + make_interval(secs => $5), u.deadline_at
FROM held h
JOIN claim_leases c ON c.token = h.lease_token
CROSS JOIN LATERAL unnest(c.run_ids, c.deadlines) AS u(run_id, deadline_at)
WHERE u.run_id = h.run_id
ON CONFLICT (run_id) DO NOTHING
RETURNING expires_at;

-- name: running_with_token
SELECT r.attempt, r.job_id, j.retry_policy FROM runs r LEFT JOIN jobs j ON j.job_id = r.job_id
WHERE r.run_id = $1 AND r.scheduled_at = $2 AND ($3::text IS NULL OR r.owner = $3)
  AND r.status = 'running' AND r.lease_token = $4;

-- name: notify_cancel
-- At commit, the worker running run $1 stops its attempt (chimes.store.working.CANCEL_CHANNEL).
SELECT pg_notify('chimes_run_cancel', $1);
