-- Workers: claiming runs, heartbeating their leases, recording outcomes.

-- name: register_worker
-- $6: the worker's release, as a scheduler node's (heartbeat_node).
INSERT INTO workers (worker_id, hostname, pid, concurrency, release) VALUES ($1, $2, $3, $4, $6)
ON CONFLICT (worker_id) DO UPDATE SET heartbeat_at = now(), in_flight = $5, release = excluded.release;

-- name: forget_worker
DELETE FROM workers WHERE worker_id = $1;

-- name: begin_by_key
-- Begins the transaction of a worker's batch statements (claim, complete) with the settings below,
-- in one round trip. They touch at most a few hundred rows, each found by its key, so index lookups
-- in nested loops are always the right plan. A burst fills the run queue and a fresh day's runs
-- partition faster than autovacuum analyzes them; with statistics that still say "empty" PostgreSQL
-- would hash-join against a scan of the whole partition and sort the whole queue, many times slower
-- than the index plan. With those plans ruled out the plan is the same whatever the length of the
-- batch's arrays, so the statement is planned once per connection (a generic plan) instead of at
-- every batch (SESSION_SETTINGS plans every statement afresh): planning would otherwise cost a
-- large share of what executing the statement costs.
BEGIN;
SET LOCAL enable_seqscan = off;
SET LOCAL enable_bitmapscan = off;
SET LOCAL enable_hashjoin = off;
SET LOCAL enable_mergejoin = off;
SET LOCAL plan_cache_mode = force_generic_plan;

-- name: claim_runs
-- Takes up to $1 ready runs of the tiers $5..$6, highest tier first, oldest first (one range scan
-- of the primary key); SKIP LOCKED lets many workers claim at once without waiting on each other.
-- The runs are picked once, in a materialised step (chosen), and deleted by the addresses it found
-- (a TID scan). Written as `DELETE ... WHERE key IN (SELECT ... LIMIT $1 FOR UPDATE SKIP LOCKED)`,
-- the planner may run the limited subquery again for every row of the queue (a nested-loop semi
-- join, chosen with the statistics of a queue analysed while drained), each run passing over the
-- rows taken already and locking new ones, so that one claim takes the whole queue. Deleted by key
-- through a join, the whole queue is read under those statistics (tests/integration/test_claim_limits.py).
-- A queue row is only ever inserted and deleted, never updated, so the address it was locked at is
-- still its own when it is deleted.
-- Runs under a concurrency cap are left to claim_capped_runs (a tag cap counts the jobs of its owner,
-- or of every owner when its owner is ''). From here on the run's lease token says who has it.
-- $8: the owners holding their share of this worker already (chimes.worker.tiers.owner_room), whose
-- runs are left to other workers; almost always none, and then nothing is looked up per run.
-- The caps are read once, first: with none (almost always) no run's job is looked up for them either,
-- which saves the claim a look-up of a job per run.
WITH caps AS MATERIALIZED (
    SELECT cap.scope, cap.name, cap.owner FROM concurrency_caps cap
),
chosen AS MATERIALIZED (
    SELECT c.ctid FROM run_queue c
    WHERE c.tier BETWEEN $5 AND $6
      AND (cardinality($8::text[]) = 0
           OR NOT EXISTS (SELECT 1 FROM jobs f WHERE f.job_id = c.job_id AND f.owner = ANY($8::text[])))
      AND (NOT EXISTS (SELECT 1 FROM caps)
           OR NOT EXISTS (
               SELECT 1 FROM caps cap JOIN jobs j ON j.job_id = c.job_id
               WHERE (cap.scope = 'owner' AND cap.name = j.owner)
                  OR (cap.scope = 'tag' AND cap.name = ANY(j.tags) AND cap.owner IN ('', j.owner))))
    ORDER BY c.tier, c.queue_id LIMIT $1 FOR UPDATE SKIP LOCKED
),
picked AS (
    DELETE FROM run_queue q WHERE q.ctid = ANY (ARRAY(SELECT ctid FROM chosen))
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

-- name: extend_claim_leases
-- A worker's heartbeat, first: the lease rows of its claims, one per claim, in place. A reaper ending
-- a run of a claim locks the claim's row first, so this waits for it, and the runs_still_running
-- after it (a statement of its own, with a snapshot taken after the wait) finds that run gone.
UPDATE claim_leases SET expires_at = now() + make_interval(secs => $2) WHERE token = ANY($1::uuid[]);

-- name: extend_leases
-- Then the runs with a lease of their own (callback tasks, until their target has them). Only the
-- lease row changes, in place.
UPDATE run_leases l SET expires_at = now() + make_interval(secs => $4)
FROM unnest($1::uuid[], $2::timestamptz[], $3::uuid[]) AS held(run_id, scheduled_at, lease_token)
WHERE l.run_id = held.run_id AND l.token = held.lease_token;

-- name: forget_claims
-- The lease rows of claims whose runs have all left their worker's hands.
DELETE FROM claim_leases WHERE token = ANY($1::uuid[]);

-- name: give_up_runs
-- Runs this worker stops without an outcome (their cap slots lapsed, their outcome cannot be stored):
-- each gets a lease of its own, expired, so that the reaper ends the attempt now, as a lost one,
-- rather than once the rest of its claim is done.
INSERT INTO run_leases (run_id, scheduled_at, partition_id, token, expires_at, deadline_at)
SELECT r.run_id, r.scheduled_at, r.partition_id, r.lease_token, now(), 'infinity'
FROM runs r JOIN unnest($1::uuid[], $2::timestamptz[], $3::uuid[]) AS held(run_id, scheduled_at, lease_token)
  ON r.run_id = held.run_id AND r.scheduled_at = held.scheduled_at
WHERE r.status = 'running' AND r.lease_token = held.lease_token
ON CONFLICT (run_id) DO UPDATE SET expires_at = now() WHERE run_leases.token = EXCLUDED.token;

-- name: complete_runs
-- Records a batch of outcomes, each only if the worker still holds the run's lease (a worker that
-- lost it cannot overwrite what replaced it). retry_at set: the run waits for a retry trigger, due
-- as long after the database's now() as retry_at is after finished_at (the worker's clock chooses the
-- backoff; the database's clock, which judges every trigger, when it ends). The finish time the
-- worker reports is kept between the attempt's start and now(), both by the database's clock: a
-- worker whose clock runs ahead or behind cannot make an attempt end after the next one started, or
-- before it began. A success with a short output (an empty body, "ok", {"ok":true}) is kept on the run
-- itself, with no attempt row of its own (migration 0013, the view run_attempt_history); a longer
-- output, or an attempt another than its worker reported (a callback), keeps its row. 16 bytes: the
-- room a page of runs keeps (runs-fillfactor) holds each run's new version in place with that much
-- more (tests/integration/test_runs_in_place.py); a run moved to another page is a copy and new
-- index entries, more than the attempt row it saves.
WITH outcome AS (
    SELECT o.*, o.status = 'succeeded' AND o.retry_at IS NULL AND coalesce(octet_length(o.output), 0) <= 16
                AS on_run
    FROM unnest($outcome_run_id::uuid[], $outcome_scheduled_at::timestamptz[], $outcome_lease_token::uuid[],
                $outcome_status::text[], $outcome_error::text[], $outcome_output::text[],
                $outcome_finished_at::timestamptz[], $outcome_retry_at::timestamptz[])
        AS o(run_id, scheduled_at, lease_token, status, error, output, finished_at, retry_at)
),
released AS (
    DELETE FROM run_leases l USING outcome o WHERE l.run_id = o.run_id AND l.token = o.lease_token
),
-- $forget_claims: the claims whose runs have all left the worker's hands by its earlier outcomes.
forgotten AS (
    DELETE FROM claim_leases WHERE token = ANY($forget_claims::uuid[])
),
ended AS (
    UPDATE runs r
    SET status = CASE WHEN o.retry_at IS NULL THEN o.status ELSE 'scheduled' END,
        attempt = r.attempt + (o.retry_at IS NOT NULL)::integer,
        finished_at = CASE WHEN o.retry_at IS NULL THEN GREATEST(r.started_at, LEAST(o.finished_at, now())) END,
        error = o.error, lease_token = NULL,
        worker_id = CASE WHEN o.retry_at IS NULL THEN r.worker_id END,
        output = CASE WHEN o.on_run AND r.worker_id = $worker_id THEN o.output END
    FROM outcome o
    WHERE r.run_id = o.run_id AND r.scheduled_at = o.scheduled_at
      AND r.status = 'running' AND r.lease_token = o.lease_token
    RETURNING r.run_id, r.scheduled_at, r.job_id, r.partition_id, r.job_version, r.started_at, r.trigger,
              r.attempt - (o.retry_at IS NOT NULL)::integer AS ended_attempt,
              o.status, o.error, o.output, GREATEST(r.started_at, LEAST(o.finished_at, now())) AS finished_at,
              o.finished_at AS reported_finish, o.retry_at, o.on_run AND r.worker_id = $worker_id AS on_run
),
-- One row per attempt not kept on its run, written only by the holder of the attempt's lease (above):
-- a plain insert, without the confirmation record an ON CONFLICT clause writes for every row.
attempts AS (
    INSERT INTO run_attempts (run_id, scheduled_at, attempt, worker_id, status, started_at, finished_at, error, output)
    SELECT run_id, scheduled_at, ended_attempt, $worker_id, status, started_at, finished_at, error, output
    FROM ended WHERE NOT on_run
),
retry_triggers AS (
    INSERT INTO triggers (partition_id, fire_at, trigger_id, job_id, job_version, kind)
    SELECT partition_id, now() + (retry_at - reported_finish), run_id, job_id, job_version, 1
    FROM ended WHERE retry_at IS NOT NULL
    ON CONFLICT DO NOTHING
)
-- bookkeeping: whether runs_ended has anything to do for the run, once final: a failure to notify,
-- a job whose runs are tracked in active_runs (skip and queue jobs, and a job changed from one of
-- them whose held runs still wait), a success to notify (notifyOn "succeeded") or a one-off job to
-- delete (deleteAfterCompletion): the job's row is read by key for those two. Most outcomes (allow jobs that succeeded) need no second statement.
SELECT e.run_id, e.scheduled_at, e.job_id, e.retry_at IS NULL AS final,
       e.status = 'failed' OR EXISTS (SELECT 1 FROM active_runs a WHERE a.job_id = e.job_id)
       OR EXISTS (SELECT 1 FROM jobs j WHERE j.job_id = e.job_id
                  AND (j.delete_after_completion AND e.trigger <> 'manual' AND e.trigger <> 'rerun'
                       OR e.status = 'succeeded' AND 'succeeded' = ANY (j.notify_on))) AS bookkeeping
FROM ended e;

-- name: runs_ended
-- The job is deleted (deleteAfterCompletion) only after the rest has read it: the subquery is
-- evaluated first (OFFSET 0 keeps it from being merged into the outer query).
SELECT chimes_delete_completed($2::uuid[], $3::timestamptz[])
FROM (SELECT chimes_runs_ended($1::uuid[], $2::uuid[]), chimes_notify_failed($2::uuid[], $3::timestamptz[]),
             chimes_notify_succeeded($2::uuid[], $3::timestamptz[]), chimes_pause_failing($2::uuid[], $3::timestamptz[])
      OFFSET 0) AS bookkeeping;

-- name: release_runs
-- Hands runs back to the queue untouched (a worker shutting down): same attempt, no attempt row,
-- since the attempt was interrupted by the fleet and not by the task.
WITH held AS (
    SELECT * FROM unnest($1::uuid[], $2::timestamptz[], $3::uuid[]) AS held(run_id, scheduled_at, lease_token)
),
unleased AS (
    DELETE FROM run_leases l USING held WHERE l.run_id = held.run_id AND l.token = held.lease_token
),
released AS (
    UPDATE runs r
    SET status = 'scheduled', lease_token = NULL, worker_id = NULL, started_at = NULL
    FROM held
    WHERE r.run_id = held.run_id AND r.scheduled_at = held.scheduled_at
      AND r.status = 'running' AND r.lease_token = held.lease_token
    RETURNING r.run_id, r.scheduled_at, r.job_id, r.priority
),
requeued AS (
    INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
    SELECT priority, run_id, scheduled_at, job_id FROM released
)
SELECT run_id FROM released;

-- name: caps_exist
SELECT EXISTS (SELECT 1 FROM concurrency_caps);

-- name: lock_capped_claims
SELECT pg_advisory_xact_lock(hashtext('chimes_capped_claims'));

-- name: cap_usage
SELECT cap.scope, cap.name, cap.owner, cap.max_running,
       (SELECT count(*) FROM leases_in_force l
        JOIN runs r ON r.run_id = l.run_id AND r.scheduled_at = l.scheduled_at
        LEFT JOIN jobs j ON j.job_id = r.job_id
        WHERE r.status = 'running' AND r.lease_token = l.token
          AND ((cap.scope = 'owner' AND r.owner = cap.name)
               OR (cap.scope = 'tag' AND cap.name = ANY(j.tags) AND cap.owner IN ('', r.owner))))
       AS running
FROM concurrency_caps cap;

-- name: capped_candidates
-- Queued runs under some cap, in queue order, skipping those behind a cap that is already full:
-- owners $4, fleet-wide tags $5, and the owner tag caps ($6[i]'s jobs tagged $7[i]).
SELECT q.queue_id, q.run_id, q.tier, j.owner, j.tags
FROM run_queue q JOIN jobs j ON j.job_id = q.job_id
WHERE q.tier BETWEEN $2 AND $3
  AND EXISTS (SELECT 1 FROM concurrency_caps cap
              WHERE (cap.scope = 'owner' AND cap.name = j.owner)
                 OR (cap.scope = 'tag' AND cap.name = ANY(j.tags) AND cap.owner IN ('', j.owner)))
  AND NOT (j.owner = ANY($4::text[]) OR j.tags && $5::text[])
  AND NOT EXISTS (SELECT 1 FROM unnest($6::text[], $7::text[]) AS full_cap(owner, tag)
                  WHERE full_cap.owner = j.owner AND full_cap.tag = ANY(j.tags))
ORDER BY q.tier, q.queue_id
LIMIT $1
FOR UPDATE OF q SKIP LOCKED;

-- name: claim_queued_runs
-- Claims the given queue entries (capped runs admitted under the cap lock), as claim_runs does.
WITH picked AS (
    DELETE FROM run_queue q WHERE q.queue_id = ANY($4::bigint[])
    RETURNING q.run_id, q.scheduled_at, q.job_id
),
lease AS (
    SELECT gen_random_uuid() AS token
),
claimed AS (
    UPDATE runs r
    SET status = 'running', worker_id = $1, lease_token = (SELECT token FROM lease), started_at = now()
    FROM picked p LEFT JOIN jobs j ON j.job_id = p.job_id
    WHERE r.run_id = p.run_id AND r.scheduled_at = p.scheduled_at AND r.status = 'scheduled'
    RETURNING r.run_id, r.scheduled_at, r.job_id, r.attempt, r.lease_token, r.started_at, r.trigger, j.task,
              j.retry_policy, j.timeout_sec, j.job_id IS NOT NULL AS job_exists, r.owner, r.priority,
              r.partition_id, coalesce((j.task ->> 'callback')::boolean, false) AS own_lease, j.name AS job_name,
              CASE WHEN r.attempt = 1 AND 'started' = ANY (j.notify_on)
                   THEN coalesce(j.notify_url, (SELECT value #>> '{}' FROM settings WHERE key = 'notify_url'))
              END AS started_url,
              now() + make_interval(secs => coalesce(j.timeout_sec, $5::integer) + $3::float8) AS deadline_at
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
    SELECT run_id, scheduled_at, partition_id, lease_token, now() + make_interval(secs => $2::float8), deadline_at
    FROM claimed WHERE own_lease
    ON CONFLICT (run_id) DO UPDATE
    SET scheduled_at = EXCLUDED.scheduled_at, partition_id = EXCLUDED.partition_id, token = EXCLUDED.token,
        expires_at = EXCLUDED.expires_at, deadline_at = EXCLUDED.deadline_at
),
leased AS (
    INSERT INTO claim_leases (token, expires_at, deadline_at, run_ids, scheduled_ats, deadlines)
    SELECT (SELECT token FROM lease), now() + make_interval(secs => $2::float8), min(deadline_at),
           array_agg(run_id), array_agg(scheduled_at), array_agg(deadline_at)
    FROM claimed WHERE NOT own_lease
    HAVING count(*) > 0
)
SELECT run_id, scheduled_at, job_id, attempt, lease_token, started_at, trigger, task, retry_policy, timeout_sec,
       job_exists, owner, priority
FROM claimed;

-- name: listen_queue
-- A worker's check of its LISTEN connection: a round trip that is a no-op on a channel already
-- listened to (chimes.store.working.QUEUE_CHANNEL).
LISTEN "chimes_run_queue";

-- name: runs_still_running
-- Of the runs this worker handed to a target that reports their outcome itself (callback tasks), the
-- ones still running under the lease they were handed with: their cap slots are kept.
SELECT r.run_id FROM runs r
JOIN unnest($1::uuid[], $2::timestamptz[], $3::uuid[]) AS held(run_id, scheduled_at, lease_token)
  ON r.run_id = held.run_id AND r.scheduled_at = held.scheduled_at
WHERE r.status = 'running' AND r.lease_token = held.lease_token;
