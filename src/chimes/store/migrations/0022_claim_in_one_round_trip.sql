-- A worker's claim in one round trip instead of three (BEGIN with the planner settings, the claim,
-- COMMIT: begin_by_key). In a burst the worker's event loop is busy with the runs of its last claim,
-- and each round trip waits for a turn of it: with every run of the last claim ended before the next
-- claim came back, the worker idled through two of the three (python -m bench up --runs 20000,
-- docs/benchmarks.md). The planner settings are the function's own (SET clauses), as begin_by_key's
-- were the transaction's; the query is working.sql's claim_runs, word for word
-- (tests/integration/test_claim_function.py). An expand step: workers of earlier releases go on
-- claiming with claim_runs itself.
CREATE FUNCTION chimes_claim_runs(integer, text, float8, float8, smallint, smallint, integer, text[])
RETURNS TABLE (run_id uuid, scheduled_at timestamptz, job_id uuid, attempt integer, lease_token uuid,
               started_at timestamptz, trigger text, task jsonb, retry_policy jsonb, timeout_sec integer,
               job_exists boolean, owner text, priority smallint)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET plan_cache_mode = force_generic_plan
AS $function$
#variable_conflict use_column
BEGIN
RETURN QUERY
-- Takes up to $1 ready runs of the tiers $5..$6, highest tier first, oldest first (one range scan
-- of the primary key); SKIP LOCKED lets many workers claim at once without waiting on each other.
-- Runs under a concurrency cap are left to claim_capped_runs (a tag cap counts the jobs of its owner,
-- or of every owner when its owner is ''). From here on the run's lease token says who has it.
-- $8: the owners holding their share of this worker already (chimes.worker.tiers.owner_room), whose
-- runs are left to other workers; almost always none, and then nothing is looked up per run.
WITH picked AS (
    DELETE FROM run_queue q
    WHERE (q.tier, q.queue_id) IN (
        SELECT c.tier, c.queue_id FROM run_queue c
        WHERE c.tier BETWEEN $5 AND $6
          AND (cardinality($8::text[]) = 0
               OR NOT EXISTS (SELECT 1 FROM jobs f WHERE f.job_id = c.job_id AND f.owner = ANY($8::text[])))
          AND NOT EXISTS (
              SELECT 1 FROM concurrency_caps cap JOIN jobs j ON j.job_id = c.job_id
              WHERE (cap.scope = 'owner' AND cap.name = j.owner)
                 OR (cap.scope = 'tag' AND cap.name = ANY(j.tags) AND cap.owner IN ('', j.owner))
          )
        ORDER BY c.tier, c.queue_id LIMIT $1 FOR UPDATE SKIP LOCKED
    )
    RETURNING q.run_id, q.scheduled_at, q.job_id
),
-- Each picked run becomes running under a new lease token, if it is still waiting (one cancelled
-- meanwhile is left alone), and its lease row is written; what the worker needs to run it comes back.
-- The run's update changes no indexed column, so it stays on its page (migration 0012).
-- All the runs of one claim share its lease token, and one lease row (claim_leases, migration 0015);
-- a callback task's run has a lease row of its own, which its target renews.
lease AS (
    SELECT gen_random_uuid() AS token
),
claimed AS (
    UPDATE runs r
    SET status = 'running', worker_id = $2, lease_token = (SELECT token FROM lease), started_at = now()
    FROM picked p LEFT JOIN jobs j ON j.job_id = p.job_id
    WHERE r.run_id = p.run_id AND r.scheduled_at = p.scheduled_at AND r.status = 'scheduled'
    RETURNING r.run_id, r.scheduled_at, r.job_id, r.attempt, r.lease_token, r.started_at, r.trigger, j.task,
              j.retry_policy, j.timeout_sec, j.job_id IS NOT NULL AS job_exists, r.owner, r.priority,
              r.partition_id, coalesce((j.task ->> 'callback')::boolean, false) AS own_lease, j.name AS job_name,
              CASE WHEN r.attempt = 1 AND 'started' = ANY (j.notify_on)
                   THEN coalesce(j.notify_url, (SELECT value #>> '{}' FROM settings WHERE key = 'notify_url'))
              END AS started_url,
              now() + make_interval(secs => coalesce(j.timeout_sec, $7::integer) + $4::float8) AS deadline_at
),
-- notifyOn "started": the run's first attempt started; queued in the outbox with the claim, as a
-- failure's notification is with its outcome (the same id for the same run: never queued twice).
started AS (
    INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload)
    SELECT md5(run_id::text || ':run_started')::uuid, job_id, owner, 'run_started', started_url,
           jsonb_build_object('kind', 'run_started', 'runId', run_id, 'jobId', job_id, 'jobName', job_name,
                              'owner', owner, 'scheduledAt', scheduled_at, 'status', 'running', 'attempt', attempt,
                              'error', NULL, 'startedAt', started_at, 'finishedAt', NULL)
    FROM claimed WHERE started_url IS NOT NULL
    ON CONFLICT DO NOTHING
),
-- A lease row already there is stale (a lease is a running run's, and this one was waiting): it is
-- replaced, so that one such row cannot fail every claim of its home.
own_leased AS (
    INSERT INTO run_leases (run_id, scheduled_at, partition_id, token, expires_at, deadline_at)
    SELECT run_id, scheduled_at, partition_id, lease_token, now() + make_interval(secs => $3::float8), deadline_at
    FROM claimed WHERE own_lease
    ON CONFLICT (run_id) DO UPDATE
    SET scheduled_at = EXCLUDED.scheduled_at, partition_id = EXCLUDED.partition_id, token = EXCLUDED.token,
        expires_at = EXCLUDED.expires_at, deadline_at = EXCLUDED.deadline_at
),
leased AS (
    INSERT INTO claim_leases (token, expires_at, deadline_at, run_ids, scheduled_ats, deadlines)
    SELECT (SELECT token FROM lease), now() + make_interval(secs => $3::float8), min(deadline_at),
           array_agg(run_id), array_agg(scheduled_at), array_agg(deadline_at)
    FROM claimed WHERE NOT own_lease
    HAVING count(*) > 0
)
SELECT run_id, scheduled_at, job_id, attempt, lease_token, started_at, trigger, task, retry_policy, timeout_sec,
       job_exists, owner, priority
FROM claimed;
END
$function$;
