-- Run history as the API reads it, and the runs the API itself starts or stops.

-- name: list_runs
SELECT * FROM runs
WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2) AND ($3::text IS NULL OR status = $3)
  AND ($4::timestamptz IS NULL OR (scheduled_at, run_id) < ($4, $5::uuid))
ORDER BY scheduled_at DESC, run_id DESC
LIMIT $6;

-- name: get_run
SELECT * FROM runs WHERE run_id = $1 AND scheduled_at = $2 AND ($3::text IS NULL OR owner = $3);

-- name: run_attempts
SELECT attempt, worker_id, status, started_at, finished_at, error, output
FROM run_attempts WHERE run_id = $1 AND scheduled_at = $2 ORDER BY attempt;

-- name: job_owner
SELECT owner FROM jobs WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2);

-- name: start_run_now
-- A manual run or a re-run: created and enqueued at once, outside the schedule.
WITH job AS (
    SELECT job_id, owner, version, priority FROM jobs
    WHERE job_id = $1 AND ($2::text IS NULL OR owner = $2)
),
created AS (
    INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority, fired_at)
    SELECT $3, $4, job_id, owner, $5, version, $6, priority, $4 FROM job
    ON CONFLICT DO NOTHING
    RETURNING run_id, scheduled_at, job_id, priority
),
enqueued AS (
    INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
    SELECT priority, run_id, scheduled_at, job_id FROM created
    RETURNING run_id
)
SELECT (SELECT count(*) FROM job) AS job_found, (SELECT count(*) FROM enqueued) AS enqueued;

-- name: cancel_run
WITH cancelled AS (
    UPDATE runs SET status = 'cancelled', finished_at = now(), error = $4,
                    lease_token = NULL, lease_expires_at = NULL, deadline_at = NULL
    WHERE run_id = $1 AND scheduled_at = $2 AND ($3::text IS NULL OR owner = $3)
      AND status IN ('scheduled', 'running')
    RETURNING run_id, job_id, partition_id
),
dequeued AS (
    DELETE FROM run_queue WHERE run_id IN (SELECT run_id FROM cancelled)
),
untriggered AS (
    DELETE FROM triggers t USING cancelled c
    WHERE t.partition_id = c.partition_id AND t.trigger_id = c.run_id AND t.kind = 1
)
SELECT run_id FROM cancelled;
