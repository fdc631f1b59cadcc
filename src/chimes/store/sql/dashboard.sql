-- Read-only queries behind the dashboard (chimes/dashboard, store/dashboard.py). Every list is a
-- keyset page read from an index (migration 0004): no page reads all jobs or all runs.
-- Jobs are listed by name: lower(name) in the "C" collation (code point order), after the cursor
-- ($2, $3) = (lower-cased name, job id) of the last row shown, up to $4: the end of a name prefix.

-- name: dashboard_name_key
SELECT lower($1::text);

-- name: dashboard_jobs_of_owner
SELECT j.*, lower(j.name) AS name_key, (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM jobs j
WHERE j.owner = $1
  AND (lower(j.name) COLLATE "C", j.job_id) > ($2::text COLLATE "C", $3::uuid)
  AND lower(j.name) COLLATE "C" < $4::text COLLATE "C"
ORDER BY lower(j.name) COLLATE "C", j.job_id
LIMIT $5;

-- name: dashboard_jobs_of_all
SELECT j.*, lower(j.name) AS name_key, (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM jobs j
WHERE ($1::text IS NULL)
  AND (lower(j.name) COLLATE "C", j.job_id) > ($2::text COLLATE "C", $3::uuid)
  AND lower(j.name) COLLATE "C" < $4::text COLLATE "C"
ORDER BY lower(j.name) COLLATE "C", j.job_id
LIMIT $5;

-- name: dashboard_paused_jobs
-- Paused jobs are few: the partial index holds only them, the owner is a filter on top.
SELECT j.*, lower(j.name) AS name_key, NULL::timestamptz AS next_run_at
FROM jobs j
WHERE j.paused AND ($1::text IS NULL OR j.owner = $1)
  AND (lower(j.name) COLLATE "C", j.job_id) > ($2::text COLLATE "C", $3::uuid)
  AND lower(j.name) COLLATE "C" < $4::text COLLATE "C"
ORDER BY lower(j.name) COLLATE "C", j.job_id
LIMIT $5;

-- name: dashboard_stalled_jobs
-- Schedules the dead man's switch holds stalled now (schedule_stalls: one row per incident, few).
SELECT j.*, lower(j.name) AS name_key, (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM schedule_stalls s
JOIN jobs j ON j.job_id = s.job_id
WHERE ($1::text IS NULL OR s.owner = $1)
  AND (lower(j.name) COLLATE "C", j.job_id) > ($2::text COLLATE "C", $3::uuid)
  AND lower(j.name) COLLATE "C" < $4::text COLLATE "C"
ORDER BY lower(j.name) COLLATE "C", j.job_id
LIMIT $5;

-- name: dashboard_job_stall
SELECT cause, since, detail, detected_at FROM schedule_stalls WHERE job_id = $1;

-- name: dashboard_job_dead_notifications
-- The job's dead-lettered notifications, newest first (notifications_dead: they are few).
SELECT notification_id, kind, url, created_at, dead_at, attempts, last_error
FROM notifications WHERE dead_at IS NOT NULL AND job_id = $1
ORDER BY created_at DESC LIMIT $2;

-- name: dashboard_failing_jobs
-- Jobs whose latest finished run failed, among the jobs with a failure in the last day, found
-- through its attempts (run_attempts_failed index): bounded by the day's failures, not by the number
-- of jobs.
WITH failed_lately AS (
    SELECT DISTINCT r.job_id FROM run_attempts a
    JOIN runs r ON r.run_id = a.run_id AND r.scheduled_at = a.scheduled_at
    WHERE a.status = 'failed' AND a.finished_at > now() - interval '1 day'
      AND r.status = 'failed' AND ($1::text IS NULL OR r.owner = $1)
)
SELECT j.*, lower(j.name) AS name_key, (SELECT min(t.fire_at) FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0) AS next_run_at
FROM failed_lately f
JOIN jobs j ON j.job_id = f.job_id
CROSS JOIN LATERAL (
    SELECT r.status FROM runs r
    WHERE r.job_id = j.job_id AND r.status IN ('succeeded', 'failed')
    ORDER BY r.scheduled_at DESC LIMIT 1
) latest
WHERE latest.status = 'failed'
  AND (lower(j.name) COLLATE "C", j.job_id) > ($2::text COLLATE "C", $3::uuid)
  AND lower(j.name) COLLATE "C" < $4::text COLLATE "C"
ORDER BY lower(j.name) COLLATE "C", j.job_id
LIMIT $5;

-- name: dashboard_job_runs
-- One page of a job's run history, newest first, before the cursor ($3, $4); with the start of
-- the first attempt, so start lag is not inflated by retries.
SELECT r.run_id, r.scheduled_at, r.fired_at, r.status, r.attempt, r.trigger, r.worker_id,
       r.started_at, r.finished_at, r.error,
       coalesce(first.started_at, CASE WHEN r.attempt = 1 THEN r.started_at END) AS first_started_at
FROM runs r
LEFT JOIN LATERAL (
    SELECT a.started_at FROM run_attempts a
    WHERE a.run_id = r.run_id AND a.scheduled_at = r.scheduled_at AND a.attempt = 1
) first ON true
WHERE r.job_id = $1 AND ($2::text IS NULL OR r.status = $2)
  AND r.scheduled_at <= $3 AND (r.scheduled_at, r.run_id) < ($3, $4::uuid)
ORDER BY r.scheduled_at DESC, r.run_id DESC
LIMIT $5;

-- name: dashboard_nodes
SELECT n.node_id, n.hostname, n.pid, n.release, n.started_at, n.heartbeat_at,
       extract(epoch FROM now() - n.heartbeat_at)::float8 AS heartbeat_age,
       coalesce(l.partitions, '{}') AS partitions
FROM scheduler_nodes n
LEFT JOIN (
    SELECT owner, array_agg(partition_id ORDER BY partition_id) AS partitions
    FROM partition_leases WHERE owner IS NOT NULL AND expires_at > now()
    GROUP BY owner
) l ON l.owner = n.node_id
ORDER BY n.node_id;

-- name: dashboard_unleased_partitions
SELECT count(*) FROM partition_leases WHERE owner IS NULL OR expires_at <= now();

-- name: dashboard_workers
SELECT worker_id, hostname, pid, release, concurrency, in_flight, started_at, heartbeat_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age
FROM workers ORDER BY worker_id;

-- name: dashboard_api_servers
-- API servers heartbeat on the catalog only; a shard's table stays empty.
SELECT server_id, hostname, pid, release, started_at, heartbeat_at,
       extract(epoch FROM now() - heartbeat_at)::float8 AS heartbeat_age
FROM api_servers ORDER BY server_id;

-- name: dashboard_running_runs
-- Runs in flight (their lease rows), oldest first, at most $2.
SELECT r.run_id, r.job_id, r.worker_id, r.attempt, r.started_at, j.name AS job_name
FROM leases_in_force l
JOIN runs r ON r.run_id = l.run_id AND r.scheduled_at = l.scheduled_at
LEFT JOIN jobs j ON j.job_id = r.job_id
WHERE r.status = 'running' AND r.lease_token = l.token AND ($1::text IS NULL OR r.owner = $1)
ORDER BY r.started_at
LIMIT $2;

-- name: dashboard_fire_lag
-- Fire lag of the newest scheduled runs in [$3, $4), at most $5 of them. A run id begins with its
-- scheduled time (ids.py), so [$1, $2) is the same range read from the primary key.
WITH recent AS (
    SELECT extract(epoch FROM r.fired_at - r.scheduled_at)::float8 AS lag
    FROM runs r
    WHERE r.run_id >= $1 AND r.run_id < $2 AND r.scheduled_at >= $3 AND r.scheduled_at < $4
      AND r.trigger = 'schedule' AND r.fired_at IS NOT NULL
    ORDER BY r.run_id DESC
    LIMIT $5
)
SELECT width_bucket(lag, $6::float8[]) AS bucket, count(*) AS runs,
       max(lag) AS max_lag, percentile_cont(0.5) WITHIN GROUP (ORDER BY lag) AS p50,
       percentile_cont(0.99) WITHIN GROUP (ORDER BY lag) AS p99
FROM recent GROUP BY ROLLUP (1) ORDER BY 1 NULLS LAST;

-- name: dashboard_failures_per_minute
-- Runs that failed for good, by the minute their last attempt ended (run_attempts_failed index).
SELECT date_trunc('minute', a.finished_at) AS minute, count(*) AS failed
FROM run_attempts a
JOIN runs r ON r.run_id = a.run_id AND r.scheduled_at = a.scheduled_at AND r.attempt = a.attempt
WHERE a.status = 'failed' AND a.finished_at > now() - make_interval(mins => $1)
  AND r.status = 'failed' AND ($2::text IS NULL OR r.owner = $2)
GROUP BY 1 ORDER BY 1;
