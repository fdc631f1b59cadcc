-- Scheduler nodes: membership, partition leases, the due scan, firing, and the reaper.

-- name: heartbeat_node
-- $4: the node's release (`chimes migrate --plan` lists the live ones; a contract step waits for them).
INSERT INTO scheduler_nodes (node_id, hostname, pid, release) VALUES ($1, $2, $3, $4)
ON CONFLICT (node_id) DO UPDATE SET heartbeat_at = now(), release = excluded.release;

-- name: database_time
-- The database's clock as seconds since the epoch: a node measures its own clock's offset from it.
SELECT extract(epoch FROM clock_timestamp())::float8;

-- name: live_nodes
SELECT node_id FROM scheduler_nodes
WHERE heartbeat_at > now() - make_interval(secs => $1)
ORDER BY node_id;

-- name: forget_node
DELETE FROM scheduler_nodes WHERE node_id = $1;

-- name: notify_partitions_released
-- At commit: the nodes listening take the partitions this node ($1) released over now, rather than
-- at their next lease round (chimes.store.scheduling.PartitionSignals).
SELECT pg_notify('chimes_partitions_released', $1);

-- name: listen_partitions
-- A round trip on the LISTEN connection (a no-op on a channel already listened to).
LISTEN chimes_partitions_released;

-- name: forget_dead_nodes
DELETE FROM scheduler_nodes WHERE heartbeat_at < now() - interval '1 hour';

-- name: renew_leases
UPDATE partition_leases l SET expires_at = now() + make_interval(secs => $4)
FROM unnest($2::smallint[], $3::bigint[]) AS held(partition_id, token)
WHERE l.partition_id = held.partition_id AND l.token = held.token AND l.owner = $1
RETURNING l.partition_id, l.token;

-- name: release_leases
UPDATE partition_leases SET owner = NULL, expires_at = '-infinity'
WHERE owner = $1 AND partition_id = ANY($2::smallint[])
RETURNING partition_id;

-- name: acquire_leases
-- Free or expired partitions, at most $2; the token bump fences out any previous owner still running.
-- Picked once, in a materialised step, and updated by their keys as one array, so that the limit
-- holds whatever the plan (working.sql, claim_runs, says how it is lost otherwise).
WITH free AS MATERIALIZED (
    SELECT partition_id FROM partition_leases
    WHERE owner IS NULL OR expires_at < now()
    ORDER BY partition_id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE partition_leases l SET owner = $1, token = l.token + 1, expires_at = now() + make_interval(secs => $3)
WHERE l.partition_id = ANY (ARRAY(SELECT partition_id FROM free))
RETURNING l.partition_id, l.token;

-- name: scan_due_triggers
-- $4: only triggers due from then on (NULL: all); the node reads the rest of its look-ahead by key.
-- Each trigger's job is looked up by its key (LATERAL ... LIMIT 1 cannot become a hash join): with a
-- plain join, a large burst of due triggers can make the planner hash the whole jobs table, a read
-- of every schedule whose cost grows with the index, not with the burst.
SELECT t.partition_id, t.fire_at, t.trigger_id, t.job_id, t.job_version, t.kind, j.cron, j.timezone,
       j.dst_gap, j.dst_fold, coalesce(j.jitter_sec, 0) AS jitter_sec, j.catch_up, j.paused_at, j.resumed_at,
       j.start_deadline_sec, j.every_sec, j.phase_sec, j.start_at, j.end_at, j.max_runs,
       coalesce(j.slots_fired, 0) AS slots_fired, j.owner, j.exclude_calendars, j.concurrency,
       coalesce(j.paused, false) AS paused, j.carried_until, j.carried_slots,
       coalesce(j.carried_unrecorded, 0) AS carried_unrecorded
FROM triggers t
LEFT JOIN LATERAL (
    SELECT j.cron, j.timezone, j.dst_gap, j.dst_fold, j.jitter_sec, j.catch_up, j.paused_at, j.resumed_at,
           j.start_deadline_sec, j.every_sec, j.phase_sec, j.start_at, j.end_at, j.max_runs,
           CASE WHEN j.max_runs IS NOT NULL  -- counted only for the jobs with a run cap
               THEN (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) END AS slots_fired,
           j.owner, j.exclude_calendars, j.concurrency, j.paused, j.carried_until, j.carried_slots,
           j.carried_unrecorded
    FROM jobs j WHERE j.job_id = t.job_id AND t.job_version >= coalesce(j.plan_version, j.version) AND t.kind = 0
    LIMIT 1
) j ON true
WHERE t.partition_id = ANY($1::smallint[]) AND t.fire_at < $2 AND t.fire_at >= coalesce($4::timestamptz, '-infinity')
LIMIT $3;

-- name: scan_due_keys
-- Just the keys of the triggers due before $2 (an index-only scan, a few bytes a row): the node
-- compares them with the triggers it holds, to find those written into the part of its look-ahead
-- it has already read (a job created or edited to fire within seconds, a retry, a failed batch), in
-- the partitions whose sums (due_trigger_sums) differ from its own.
SELECT partition_id, fire_at, trigger_id FROM triggers
WHERE partition_id = ANY($1::smallint[]) AND fire_at < $2
LIMIT $3;

-- name: due_trigger_sums
-- Per partition, how many triggers are due before $2 and the sum of their fire times in seconds
-- since the epoch (numeric: exact to the microsecond, and no sum overflows it), an index-only scan
-- that sends a row per partition: the node compares them with what it holds
-- (chimes.scheduler.timer_wheel) and reads the keys only of partitions that differ.
SELECT partition_id, count(*), sum(extract(epoch FROM fire_at))
FROM triggers
WHERE partition_id = ANY($1::smallint[]) AND fire_at < $2
GROUP BY partition_id;

-- name: due_triggers_by_key
SELECT t.partition_id, t.fire_at, t.trigger_id, t.job_id, t.job_version, t.kind, j.cron, j.timezone,
       j.dst_gap, j.dst_fold, coalesce(j.jitter_sec, 0) AS jitter_sec, j.catch_up, j.paused_at, j.resumed_at,
       j.start_deadline_sec, j.every_sec, j.phase_sec, j.start_at, j.end_at, j.max_runs,
       coalesce(j.slots_fired, 0) AS slots_fired, j.owner, j.exclude_calendars, j.concurrency,
       coalesce(j.paused, false) AS paused, j.carried_until, j.carried_slots,
       coalesce(j.carried_unrecorded, 0) AS carried_unrecorded
FROM unnest($1::smallint[], $2::timestamptz[], $3::uuid[]) AS k(partition_id, fire_at, trigger_id)
JOIN triggers t ON t.partition_id = k.partition_id AND t.fire_at = k.fire_at AND t.trigger_id = k.trigger_id
LEFT JOIN LATERAL (  -- by key, as in scan_due_triggers
    SELECT j.cron, j.timezone, j.dst_gap, j.dst_fold, j.jitter_sec, j.catch_up, j.paused_at, j.resumed_at,
           j.start_deadline_sec, j.every_sec, j.phase_sec, j.start_at, j.end_at, j.max_runs,
           CASE WHEN j.max_runs IS NOT NULL  -- counted only for the jobs with a run cap
               THEN (SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id) END AS slots_fired,
           j.owner, j.exclude_calendars, j.concurrency, j.paused, j.carried_until, j.carried_slots,
           j.carried_unrecorded
    FROM jobs j WHERE j.job_id = t.job_id AND t.job_version >= coalesce(j.plan_version, j.version) AND t.kind = 0
    LIMIT 1
) j ON true;

-- name: fire_triggers
-- One batch of due triggers, in one statement. Only partitions whose lease this node still holds
-- (same token, unexpired) fire; FOR KEY SHARE makes a takeover (acquire_leases locks FOR UPDATE)
-- wait until this transaction ends, but not a renewal of the lease, a plain UPDATE: with FOR SHARE
-- the renewal queued behind every batch, batches queued behind it, and under a burst the two
-- deadlocked or the renewal timed out and the node dropped all it held.
-- A trigger fires only if it is still there with the same job version, and that version is not older
-- than the job's plan (jobs.plan_version, the version of its last change to what a fire reads: its
-- schedule, catch-up, concurrency, pause): such an edit, or a delete, since the scan leaves nothing to
-- match, while an edit of anything else leaves the trigger to fire as planned. A paused job's trigger
-- fires only if its pause kept it for slots due before (carried_until). A schedule trigger makes one run per slot (normally one;
-- several after missed fires), each with a deterministic id, so a slot fired twice collides, and
-- advances. The job's concurrency policy decides which new runs start, wait (queue) or are
-- recorded as skipped. A retry trigger re-enqueues its waiting run.
WITH lease AS (
    -- partition_id = ANY: the batch's few partitions are looked up by key, not all 1,024 scanned
    SELECT l.partition_id
    FROM partition_leases l
    JOIN unnest($held_partition_id::smallint[], $held_token::bigint[]) AS held(partition_id, token)
      ON l.partition_id = held.partition_id AND l.token = held.token
    WHERE l.partition_id = ANY($held_partition_id::smallint[]) AND l.owner = $node_id AND l.expires_at > now()
    FOR KEY SHARE OF l
),
-- The database's clock says whether a trigger's time has come: a node whose clock runs ahead
-- fires nothing early; what it sent too soon stays for its next scan, and is counted. $ahead_sec: how
-- far ahead of its time a batch fired ahead may be (0 otherwise); its transaction commits only once
-- confirm_fire_ahead finds the time come, so nothing it writes is seen before then.
moment AS MATERIALIZED (SELECT clock_timestamp() + make_interval(secs => $ahead_sec::float8) AS now),
batch AS (
    SELECT d.*
    FROM unnest($trigger_idx::integer[], $trigger_partition_id::smallint[], $trigger_fire_at::timestamptz[],
                $trigger_trigger_id::uuid[], $trigger_job_id::uuid[], $trigger_job_version::integer[],
                $trigger_kind::smallint[], $trigger_run_id::uuid[], $trigger_scheduled_at::timestamptz[],
                $trigger_next_fire_at::timestamptz[])
         AS d(idx, partition_id, fire_at, trigger_id, job_id, job_version, kind, run_id, scheduled_at,
              next_fire_at)
    WHERE d.partition_id IN (SELECT partition_id FROM lease)
),
due AS (
    SELECT b.* FROM batch b WHERE b.fire_at <= (SELECT now FROM moment)
),
fired AS (
    DELETE FROM triggers t USING due d
    WHERE t.partition_id = d.partition_id AND t.fire_at = d.fire_at AND t.trigger_id = d.trigger_id
      AND t.job_version = d.job_version
    RETURNING d.*
),
live AS (
    SELECT f.*, j.owner, j.priority, j.concurrency, j.queue_limit, j.version AS fired_version,
           j.delete_after_completion AND j.run_at IS NOT NULL AS deletes_when_done
    FROM fired f JOIN jobs j ON j.job_id = f.job_id AND f.job_version >= coalesce(j.plan_version, j.version)
                              AND (NOT j.paused OR f.fire_at <= j.carried_until)
    WHERE f.kind = 0
),
advanced AS (
    INSERT INTO triggers (partition_id, fire_at, trigger_id, job_id, job_version, kind)
    SELECT partition_id, next_fire_at, trigger_id, job_id, job_version, 0
    FROM live WHERE next_fire_at IS NOT NULL
    ON CONFLICT DO NOTHING
),
-- The slots recorded for jobs with a schedule.maxRuns, counted ($counted_job_id/$counted_slots: those
-- jobs and their slots in this batch); jobs without one are not written.
counted AS (
    INSERT INTO job_slot_counts (job_id, slots_fired)
    SELECT c.job_id, c.slots
    FROM unnest($counted_job_id::uuid[], $counted_slots::integer[]) AS c(job_id, slots)
    JOIN live l ON l.job_id = c.job_id
    ON CONFLICT (job_id) DO UPDATE SET slots_fired = job_slot_counts.slots_fired + excluded.slots_fired
),
slot AS (
    -- job_version: the job's version the run is fired at (a trigger outlives edits of what it does not read)
    SELECT s.*, l.job_id, l.owner, l.priority, l.partition_id, l.fired_version AS job_version, l.concurrency,
           l.queue_limit, l.deletes_when_done,
           -- Several slots of one job in a batch (a catch-up, slots an edit kept beside the next one)
           -- are decided as if fired one by one: replace runs the newest, skip and queue the oldest.
           row_number() OVER (PARTITION BY l.job_id, s.outcome ORDER BY s.scheduled_at DESC) AS newest_first,
           row_number() OVER (PARTITION BY l.job_id, s.outcome ORDER BY s.scheduled_at) AS oldest_first,
           max(s.scheduled_at) OVER (PARTITION BY l.job_id, s.outcome) AS newest
    FROM unnest($slot_idx::integer[], $slot_run_id::uuid[], $slot_scheduled_at::timestamptz[], $slot_trigger::text[],
                $slot_outcome::text[], $slot_reason::text[])
         AS s(idx, run_id, scheduled_at, trigger, outcome, reason)
    JOIN live l ON l.idx = s.idx
),
decided AS (
    SELECT slot.*,
           CASE
               WHEN slot.outcome = 'skip' THEN 'skip'
               WHEN slot.concurrency = 'allow' THEN 'run'
               -- replace: the newest slot runs whatever is active; the runs it replaces are
               -- cancelled after this statement (replace_active_runs), older slots of this fire skipped.
               WHEN slot.concurrency = 'replace' THEN CASE WHEN slot.newest_first = 1 THEN 'run' ELSE 'skip' END
               WHEN slot.oldest_first = 1 AND active.running = 0 AND active.held = 0 THEN 'run'
               WHEN slot.concurrency = 'queue' AND waiting.ahead < slot.queue_limit THEN 'hold'
               ELSE 'skip'
           END AS decision,
           active.running, active.held AS held_before, waiting.ahead AS waiting_ahead
    FROM slot
    CROSS JOIN LATERAL (
        -- Only skip and queue look at the runs still active; allow does not even count them.
        SELECT count(*) FILTER (WHERE NOT a.held) AS running, count(*) FILTER (WHERE a.held) AS held
        FROM active_runs a WHERE a.job_id = slot.job_id AND slot.concurrency <> 'allow'
    ) active
    -- queue: the runs that wait ahead of this slot: those held already and the batch's older slots,
    -- but for the oldest when it starts at once.
    CROSS JOIN LATERAL (
        SELECT active.held + slot.oldest_first - 1
               - CASE WHEN active.running = 0 AND active.held = 0 THEN 1 ELSE 0 END AS ahead
    ) waiting
),
created AS (
    INSERT INTO runs (run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority, fired_at,
                      status, finished_at, reason)
    SELECT run_id, scheduled_at, job_id, owner, partition_id, job_version, trigger, priority,
           $fired_at::timestamptz,
           CASE WHEN decision = 'skip' THEN 'skipped' ELSE 'scheduled' END,
           CASE WHEN decision = 'skip' THEN $fired_at::timestamptz END,
           CASE
               WHEN outcome = 'skip' THEN reason
               WHEN decision = 'skip' AND concurrency = 'queue'
                   THEN format('skipped: %s runs already waiting (queueLimit)', waiting_ahead)
               WHEN decision = 'skip' AND concurrency = 'replace'
                   THEN format('skipped: replaced by the run of %s (concurrency replace)',
                               to_char(newest AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'))
               WHEN decision = 'skip' THEN 'skipped: the previous run is still active (concurrency skip)'
               WHEN decision = 'hold' THEN coalesce(reason || '; ', '') || 'waiting for the active run (concurrency queue)'
               ELSE reason
           END
    FROM decided d
    -- A slot fired before (the same deterministic run id) makes no second run. Not ON CONFLICT: its
    -- speculative insertion writes a confirmation record per row, 48 bytes of WAL a run. Two fires of
    -- one slot at the same instant, which the partition lease rules out, would fail the batch with a
    -- unique violation, and its trigger would be fired again alone: the run is then found here.
    WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = d.run_id AND r.scheduled_at = d.scheduled_at)
    RETURNING run_id, scheduled_at, job_id, priority
),
-- A one-off job that deletes itself once its run ended (deleteAfterCompletion) and whose one slot was
-- recorded as skipped is deleted now, as the end of its run would have deleted it: no run of it ends.
completed_unrun AS (
    DELETE FROM jobs j USING created c JOIN decided d USING (run_id)
    WHERE d.deletes_when_done AND d.decision = 'skip' AND j.job_id = c.job_id
    RETURNING j.job_id
),
forgotten_pauses AS (
    DELETE FROM job_pauses p USING completed_unrun g WHERE p.job_id = g.job_id
),
admitted AS (
    SELECT c.*, d.decision, d.concurrency, d.running + d.held_before > 0 AS replacing
    FROM created c JOIN decided d USING (run_id)
    WHERE d.decision IN ('run', 'hold')
),
-- The runs of skip and queue jobs are tracked until they end; those of allow jobs are not (no policy
-- reads them: a row written and deleted again per run, for nothing). A job changed from allow to
-- skip or queue has its unfinished runs tracked by that change (track_unfinished_runs).
activated AS (
    INSERT INTO active_runs (job_id, run_id, scheduled_at, held)
    SELECT job_id, run_id, scheduled_at, decision = 'hold' FROM admitted WHERE concurrency <> 'allow'
    ON CONFLICT DO NOTHING
),
-- Per job, what skip and queue decided by; read only by a batch fired ahead ($ahead_sec > 0). One row
-- a job: its slots share the counts.
decided_by_active AS MATERIALIZED (
    SELECT DISTINCT job_id, running, held_before FROM decided
    WHERE concurrency <> 'allow' AND $ahead_sec::float8 > 0
),
retried AS (
    SELECT r.run_id, r.scheduled_at, r.job_id, r.priority
    FROM fired f JOIN runs r ON r.run_id = f.run_id AND r.scheduled_at = f.scheduled_at
    WHERE f.kind = 1 AND r.status = 'scheduled'
),
-- Plain inserts (no confirmation record): a run made by this statement cannot be queued yet, and a
-- retried run waited for this trigger out of the queue; the trigger's delete above lets one fire
-- queue it (migration 0014).
enqueued AS (
    INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
    SELECT priority, run_id, scheduled_at, job_id FROM admitted WHERE decision = 'run'
    RETURNING 1
),
requeued AS (
    INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
    SELECT priority, run_id, scheduled_at, job_id FROM retried
    RETURNING 1
)
SELECT (SELECT count(*) FROM lease) AS leases_held,
       (SELECT count(*) FROM fired) AS fired,
       (SELECT count(*) FROM enqueued) + (SELECT count(*) FROM requeued) AS enqueued,
       (SELECT count(*) FROM batch WHERE fire_at > (SELECT now FROM moment)) AS too_early,
       -- The new runs of replace jobs that found runs still active, for replace_active_runs: NULL
       -- (no second statement) unless a replace job had an active run.
       (SELECT array_agg(run_id) FROM admitted WHERE concurrency = 'replace' AND replacing) AS replacing,
       -- The runs still active that skip and queue decided by, per job, for a batch fired ahead to
       -- check again at its time (confirm_fire_ahead).
       (SELECT array_agg(job_id ORDER BY job_id) FROM decided_by_active) AS decided_jobs,
       (SELECT array_agg(running ORDER BY job_id) FROM decided_by_active) AS decided_running,
       (SELECT array_agg(held_before ORDER BY job_id) FROM decided_by_active) AS decided_held;

-- name: confirm_fire_ahead
-- A batch fired ahead of its time ($due_at, the latest fire time in it), just before its transaction
-- commits: whether that time has come by the database's clock, whether this node ($node_id) still
-- holds every partition of the batch ($held_partition_id, with the lease tokens $held_token), and
-- whether every job of the batch ($fired_job_id, at the versions $fired_version) is still there,
-- unpaused and its plan unchanged, and whether the runs still active
-- that skip and queue decided by are the same. Anything else and the batch is
-- rolled back and fired again the ordinary way, as it would have been at its time. clock_timestamp(),
-- not now(): now() is when the transaction began, ahead of the batch's time.
SELECT clock_timestamp() >= $due_at::timestamptz AS due,
       (SELECT count(*) FROM partition_leases l
        JOIN unnest($held_partition_id::smallint[], $held_token::bigint[]) AS held(partition_id, token)
          ON l.partition_id = held.partition_id AND l.token = held.token
        WHERE l.partition_id = ANY($held_partition_id::smallint[]) AND l.owner = $node_id
          AND l.expires_at > clock_timestamp())
           = cardinality($held_partition_id::smallint[]) AS leases_held,
       NOT EXISTS (
           SELECT 1 FROM unnest($fired_job_id::uuid[], $fired_version::integer[]) AS f(job_id, version)
           LEFT JOIN jobs j ON j.job_id = f.job_id
           WHERE j.job_id IS NULL OR coalesce(j.plan_version, j.version) > f.version OR j.paused
       ) AS jobs_unchanged,
       -- $decided_job_id, $decided_running, $decided_held: the jobs whose policy (skip, queue) decided
       -- by their runs still active, and how many were running and held then. The same counts now,
       -- leaving out the rows this transaction wrote (xmin), or the batch decided by a past that is
       -- gone: a run ended, or one began, meanwhile.
       NOT EXISTS (
           SELECT 1 FROM unnest($decided_job_id::uuid[], $decided_running::bigint[], $decided_held::bigint[])
               AS d(job_id, running, held)
           CROSS JOIN LATERAL (
               SELECT count(*) FILTER (WHERE NOT a.held) AS running, count(*) FILTER (WHERE a.held) AS held
               FROM active_runs a WHERE a.job_id = d.job_id AND a.xmin <> xid(pg_current_xact_id())
           ) active
           WHERE active.running <> d.running OR active.held <> d.held
       ) AS policies_unchanged;

-- name: replace_active_runs
-- concurrency replace: the new runs $1 (of jobs $2) end their jobs' other unfinished runs, each
-- cancelled with the reason $3 exactly as cancel_run cancels one (runs.sql), in the fire's
-- transaction. A run waiting in the queue or for a retry is cancelled as well: the newest slot wins.
-- The caller tells the workers holding the running ones (notify_cancels) and ends their bookkeeping.
WITH newer AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[]) AS n(run_id, job_id, reason)
),
target AS (
    SELECT r.run_id, r.scheduled_at, r.status AS was, r.worker_id, r.attempt, r.started_at, n.reason
    FROM newer n
    JOIN active_runs a ON a.job_id = n.job_id AND a.run_id <> n.run_id
    JOIN runs r ON r.run_id = a.run_id AND r.scheduled_at = a.scheduled_at
    WHERE r.status IN ('scheduled', 'running')
    FOR UPDATE OF r
),
cancelled AS (
    UPDATE runs r SET status = 'cancelled', finished_at = now(), error = t.reason, lease_token = NULL
    FROM target t
    WHERE r.run_id = t.run_id AND r.scheduled_at = t.scheduled_at
    RETURNING r.run_id, r.scheduled_at, r.job_id, r.partition_id, t.was, t.worker_id, t.attempt, t.started_at,
              t.reason
),
interrupted AS (
    INSERT INTO run_attempts (run_id, scheduled_at, attempt, worker_id, status, started_at, finished_at, error)
    SELECT run_id, scheduled_at, attempt, worker_id, 'cancelled', started_at, now(), reason
    FROM cancelled WHERE was = 'running'
    ON CONFLICT DO NOTHING
),
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

-- name: notify_cancels
-- At commit, the workers running the runs $1 stop their attempts (chimes.store.working.CANCEL_CHANNEL).
SELECT pg_notify('chimes_run_cancel', run_id) FROM unnest($1::text[]) AS r(run_id);

-- name: notify_queue
-- Runs were queued: the workers listening claim. $1: the owners of those runs (a JSON array,
-- chimes.store.working.queued_payload), so that a worker whose share those owners hold already need
-- not look; '' when they are not known, and for any worker that does not read it: every owner.
SELECT pg_notify('chimes_run_queue', $1::text);

-- name: expired_runs
-- Running runs of these partitions whose worker stopped heartbeating, or that ran past their deadline:
-- a read of the lease rows, which hold only the runs in flight. A claim's row is opened only when its
-- lease expired or its earliest deadline passed; a run with a lease of its own is judged by that one.
WITH due AS (
    SELECT l.run_id, l.scheduled_at, l.token, l.expires_at, l.deadline_at FROM run_leases l
    WHERE l.partition_id = ANY($1::smallint[]) AND (l.expires_at < now() OR l.deadline_at < now())
    UNION ALL
    SELECT u.run_id, u.scheduled_at, c.token, c.expires_at, u.deadline_at
    FROM claim_leases c
    CROSS JOIN LATERAL unnest(c.run_ids, c.scheduled_ats, c.deadlines) AS u(run_id, scheduled_at, deadline_at)
    WHERE (c.expires_at < now() OR c.deadline_at < now()) AND (c.expires_at < now() OR u.deadline_at < now())
      AND NOT EXISTS (SELECT 1 FROM run_leases own WHERE own.run_id = u.run_id AND own.token = c.token)
)
SELECT r.run_id, r.scheduled_at, r.job_id, r.attempt, r.lease_token, r.partition_id, r.priority,
       r.worker_id, r.started_at, r.job_version, l.deadline_at, r.lease_losses,
       l.expires_at < now() AS lease_expired, j.retry_policy
FROM due l
JOIN runs r ON r.run_id = l.run_id AND r.scheduled_at = l.scheduled_at
LEFT JOIN jobs j ON j.job_id = r.job_id
WHERE r.partition_id = ANY($1::smallint[]) AND r.status = 'running' AND r.lease_token = l.token
LIMIT $2;

-- name: reap_runs
-- Ends the lost attempts found by expired_runs, still only if nothing changed since (same lease
-- token, still expired), and only in partitions this node holds. $lost_retry_at: NULL means the run
-- fails for good; a time not after $planned_at (the node's now, on which it planned) means re-enqueue
-- now; a later time, a retry trigger that much after the database's now(): the node's clock chooses the
-- delay, the database's clock, which judges every trigger, when it ends.
WITH lease AS (
    SELECT l.partition_id FROM partition_leases l
    JOIN unnest($held_partition_id::smallint[], $held_token::bigint[]) AS held(partition_id, token)
      ON l.partition_id = held.partition_id AND l.token = held.token
    WHERE l.owner = $node_id AND l.expires_at > now()
    FOR KEY SHARE OF l
),
lost AS (
    SELECT * FROM unnest($lost_run_id::uuid[], $lost_scheduled_at::timestamptz[], $lost_lease_token::uuid[],
                         $lost_error::text[], $lost_retry_at::timestamptz[], $lost_lease_lost::boolean[])
        AS d(run_id, scheduled_at, lease_token, error, retry_at, lease_lost)
),
-- The lease rows go first: deleting a run's own row, or locking its claim's, waits for a heartbeat
-- writing it, and then finds it expired no longer; a run whose own row is gone already was ended by
-- someone else. A claim's row stays until none of its runs still runs under its token.
unleased AS (
    DELETE FROM run_leases l USING lost d
    WHERE l.run_id = d.run_id AND l.token = d.lease_token AND (l.expires_at < now() OR l.deadline_at < now())
      AND l.partition_id IN (SELECT partition_id FROM lease)
    RETURNING l.run_id, l.scheduled_at, l.token
),
claims AS (
    SELECT c.token, c.expires_at, c.run_ids, c.deadlines FROM claim_leases c
    WHERE c.token IN (SELECT lease_token FROM lost)
    FOR UPDATE
),
unclaimed AS (
    SELECT u.run_id FROM claims c
    CROSS JOIN LATERAL unnest(c.run_ids, c.deadlines) AS u(run_id, deadline_at)
    JOIN lost d ON d.run_id = u.run_id AND d.lease_token = c.token
    WHERE (c.expires_at < now() OR u.deadline_at < now())
      AND NOT EXISTS (SELECT 1 FROM run_leases own WHERE own.run_id = u.run_id AND own.token = c.token)
),
ended AS (
    UPDATE runs r
    SET status = CASE WHEN d.retry_at IS NULL THEN 'failed' ELSE 'scheduled' END,
        attempt = r.attempt + (d.retry_at IS NOT NULL)::integer,
        finished_at = CASE WHEN d.retry_at IS NULL THEN now() END,
        error = d.error, lease_token = NULL, worker_id = NULL,
        lease_losses = r.lease_losses + d.lease_lost::integer
    FROM lost d
    WHERE r.run_id = d.run_id AND r.scheduled_at = d.scheduled_at AND r.status = 'running'
      AND r.lease_token = d.lease_token AND r.partition_id IN (SELECT partition_id FROM lease)
      AND (d.run_id IN (SELECT run_id FROM unleased) OR d.run_id IN (SELECT run_id FROM unclaimed))
    RETURNING r.run_id, r.scheduled_at, r.job_id, r.partition_id, r.job_version, r.priority,
              r.attempt - (d.retry_at IS NOT NULL)::integer AS ended_attempt, d.retry_at, d.error
),
attempts AS (
    INSERT INTO run_attempts (run_id, scheduled_at, attempt, worker_id, status, started_at, finished_at, error)
    SELECT e.run_id, e.scheduled_at, e.ended_attempt, r.worker_id, 'failed', r.started_at, now(), e.error
    FROM ended e
    JOIN unnest($lost_run_id::uuid[], $lost_worker_id::text[], $lost_started_at::timestamptz[])
        AS r(run_id, worker_id, started_at)
      ON r.run_id = e.run_id
    ON CONFLICT DO NOTHING
),
requeued AS (
    INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
    SELECT priority, run_id, scheduled_at, job_id FROM ended WHERE retry_at <= $planned_at::timestamptz
),
retry_triggers AS (
    INSERT INTO triggers (partition_id, fire_at, trigger_id, job_id, job_version, kind)
    SELECT partition_id, now() + (retry_at - $planned_at::timestamptz), run_id, job_id, job_version, 1
    FROM ended WHERE retry_at > $planned_at::timestamptz
    ON CONFLICT DO NOTHING
)
SELECT run_id, scheduled_at, job_id, retry_at, retry_at IS NULL AS final FROM ended;

-- name: reconcile_active_runs
SELECT chimes_forget_ended_runs() AS forgotten, chimes_release_held(NULL) AS released;

-- name: forget_dead_claims
-- The lease rows of claims whose worker is gone: expired, and none of their runs still running under
-- their token (reaped, or ended before the worker could say so). A run never comes back to a token,
-- so a snapshot that is out of date can only keep a row longer.
DELETE FROM claim_leases c
WHERE c.expires_at < now()
  AND NOT EXISTS (
      SELECT 1 FROM unnest(c.run_ids, c.scheduled_ats) AS u(run_id, scheduled_at)
      JOIN runs r ON r.run_id = u.run_id AND r.scheduled_at = u.scheduled_at
      WHERE r.status = 'running' AND r.lease_token = c.token
  );

-- name: late_unstarted_runs
-- Runs not started by their job's start deadline, counted from the scheduled time (plus the job's
-- jitter): the queue's rows, oldest first, skipping those notified already, at most $1. A run waiting
-- to start is in the queue: the statement that makes it due queues it (a fire, a backfill, a release
-- of runs held by their job's concurrency policy, which wait out of the queue by design: the dead
-- man's switch watches those).
SELECT r.run_id, r.scheduled_at, r.fired_at, q.enqueued_at, j.start_deadline_sec
FROM run_queue q
JOIN runs r ON r.run_id = q.run_id AND r.scheduled_at = q.scheduled_at
JOIN jobs j ON j.job_id = r.job_id
WHERE r.status = 'scheduled' AND r.started_at IS NULL
  AND r.scheduled_at < now() - interval '1 second'
  AND r.scheduled_at < now() - make_interval(secs => j.start_deadline_sec + j.jitter_sec)
  AND NOT EXISTS (SELECT 1 FROM notifications n WHERE n.notification_id = md5(r.run_id::text || ':start_missed')::uuid)
ORDER BY r.scheduled_at
LIMIT $1;

-- name: notify_late_fires
-- Runs a fire created later than their job's start deadline after their scheduled time (plus the
-- job's jitter): their start is missed however soon a worker takes them. In the fire's transaction,
-- only for the slots the node found past the deadline the scan read with the trigger's job.
-- Each run and its job by key (LATERAL ... LIMIT 1): as a plain join, a large batch of late slots
-- can be hashed against every run of the day, a read that grows with the history while a fleet is
-- already behind.
SELECT chimes_notify_runs('start_missed', array_agg(r.run_id), array_agg(r.scheduled_at),
       array_agg(format('fired %ss after its scheduled time, past its start deadline of %ss: '
                        'are scheduler nodes running and keeping up?',
                        round(extract(epoch FROM r.fired_at - r.scheduled_at)), j.start_deadline_sec)))
FROM unnest($1::uuid[], $2::timestamptz[]) AS s(run_id, scheduled_at)
CROSS JOIN LATERAL (
    SELECT r.run_id, r.scheduled_at, r.fired_at, r.job_id FROM runs r
    WHERE r.run_id = s.run_id AND r.scheduled_at = s.scheduled_at AND r.status <> 'skipped'
    LIMIT 1
) r
CROSS JOIN LATERAL (
    SELECT j.start_deadline_sec FROM jobs j
    WHERE j.job_id = r.job_id AND r.fired_at > r.scheduled_at + make_interval(secs => j.start_deadline_sec + j.jitter_sec)
    LIMIT 1
) j;

-- name: overdue_triggers
-- Schedule triggers still not fired $1 seconds after they were due (a partition with no live owner,
-- a fleet behind), at most $2 per partition: one short range of the primary key per partition, so
-- the cost does not grow with the number of schedules. Whether the partition has a live owner says
-- which of the two it is.
SELECT p.partition_id, t.fire_at, t.trigger_id, j.job_id, j.owner, j.cron, j.timezone, j.dst_gap, j.dst_fold,
       j.jitter_sec, j.start_deadline_sec, j.every_sec, (l.owner IS NOT NULL AND l.expires_at > now()) AS leased
FROM generate_series(0, 1023) AS p(partition_id)
CROSS JOIN LATERAL (
    SELECT t.fire_at, t.trigger_id, t.job_id, t.job_version FROM triggers t
    WHERE t.partition_id = p.partition_id AND t.fire_at < now() - make_interval(secs => $1) AND t.kind = 0
    ORDER BY t.fire_at
    LIMIT $2
) t
JOIN jobs j ON j.job_id = t.job_id AND t.job_version >= coalesce(j.plan_version, j.version)
            AND (NOT j.paused OR t.fire_at <= j.carried_until)
JOIN partition_leases l ON l.partition_id = p.partition_id;

-- name: job_sweep_end
-- The sweep for schedules without a trigger reads the jobs in id order, $2 at a time after $1.
SELECT job_id FROM (SELECT job_id FROM jobs WHERE job_id > $1 ORDER BY job_id LIMIT $2) batch
ORDER BY job_id DESC LIMIT 1;

-- name: schedules_without_trigger
-- Recurring, active jobs in ($1, $2] whose schedule trigger row is gone, with their last fire.
-- First the ids without a schedule trigger, from the two indexes alone (jobs_pkey, triggers_job_kind),
-- in id order: only those jobs' rows are read. Checking the rows first lets the planner read all of
-- `triggers` and every swept job's row each sweep, a cost that grows with the schedules and evicts
-- the pages the fires are using from the server's cache.
WITH missing AS MATERIALIZED (
    SELECT j.job_id FROM jobs j
    WHERE j.job_id > $1 AND j.job_id <= $2
      AND NOT EXISTS (SELECT 1 FROM triggers t WHERE t.job_id = j.job_id AND t.kind = 0)
)
SELECT j.job_id, j.owner, j.cron, j.timezone, j.dst_gap, j.dst_fold, j.every_sec, j.phase_sec, j.start_at, j.end_at,
       greatest(j.created_at, j.resumed_at, (SELECT max(r.scheduled_at) FROM runs r WHERE r.job_id = j.job_id))
           AS last_fire
FROM missing m JOIN jobs j ON j.job_id = m.job_id
WHERE j.run_at IS NULL AND NOT j.paused
  AND (j.max_runs IS NULL
       OR j.max_runs > coalesce((SELECT c.slots_fired FROM job_slot_counts c WHERE c.job_id = j.job_id), 0));

-- name: record_stalls
-- A stalled schedule is recorded once per incident: a job already recorded keeps its row (and its
-- detected_at) until resolve_stalls removes it.
INSERT INTO schedule_stalls (job_id, owner, cause, since, detail, fire_at, run_id)
SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::timestamptz[], $5::text[], $6::timestamptz[],
                     $7::uuid[])
ON CONFLICT (job_id) DO NOTHING;

-- name: resolve_stalls
-- Incidents that are over: the job fired again (its trigger moved on, or is back), the holding run
-- ended, or the job was paused or deleted.
DELETE FROM schedule_stalls s
WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.job_id = s.job_id AND NOT j.paused)
   OR CASE s.cause
          WHEN 'overdue' THEN NOT EXISTS (SELECT 1 FROM triggers t
                                          WHERE t.job_id = s.job_id AND t.kind = 0 AND t.fire_at = s.fire_at)
          WHEN 'no_trigger' THEN EXISTS (SELECT 1 FROM triggers t WHERE t.job_id = s.job_id AND t.kind = 0)
          ELSE NOT EXISTS (SELECT 1 FROM active_runs a WHERE a.job_id = s.job_id AND a.run_id = s.run_id AND NOT a.held)
      END
RETURNING s.job_id;

-- name: notify_jobs
SELECT chimes_notify_jobs($1, $2::uuid[], $3::text[], $4::text[], $5::timestamptz[], $6::uuid[]);

-- name: blocking_runs
-- Unfinished runs that hold back a recurring job with concurrency skip or queue, for the dead man's
-- switch (the caller compares their age with the job's interval; a run is notified once).
SELECT r.run_id, r.scheduled_at, r.job_id, r.owner, coalesce(r.started_at, r.scheduled_at) AS since, j.cron,
       j.timezone, j.dst_gap, j.dst_fold, j.every_sec, j.phase_sec, j.start_at, j.end_at
FROM active_runs a
JOIN runs r ON r.run_id = a.run_id AND r.scheduled_at = a.scheduled_at
JOIN jobs j ON j.job_id = a.job_id
WHERE NOT a.held AND j.run_at IS NULL AND j.concurrency IN ('skip', 'queue') AND NOT j.paused
  AND coalesce(r.started_at, r.scheduled_at) < now() - make_interval(secs => $1)
LIMIT 1000;

-- name: notify_runs
SELECT chimes_notify_runs($1, $2::uuid[], $3::timestamptz[], $4::text[]);
