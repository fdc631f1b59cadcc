-- The run queue loses its index on run_id (`run_queue_run`): 72 bytes of WAL, an index entry with
-- its uniqueness check, per run, and the pages of dead entries vacuum goes through after them
-- (docs/benchmarks.md, "What a run writes to the WAL"). It was read by a cancel, and by the
-- `ON CONFLICT (run_id)` of the statements that queue a run again, to queue it at most once. Each of
-- those statements queues a run only as it moves it to `scheduled` from a state out of the queue
-- (running: a reap, a release; held by its job's concurrency policy; waiting for its retry trigger,
-- which fires once), so a run is never queued twice; and were it ever, the claim starts only a run
-- still `scheduled`, so the second row would be dropped by the claim that reads it. A cancel looks
-- for the run's row in the queue only when the run was waiting (`scheduled`), by a scan of the queue.
--
-- A cut-over, as 0012: scheduler nodes, workers and API servers of earlier versions name the index
-- in `ON CONFLICT (run_id)`, and those statements (a fire with retries in its batch, a reap, a
-- release, a backfill) fail until they are replaced. Nothing is lost meanwhile: the triggers and the
-- leases they would have acted on are still there for the new version (docs/operations.md,
-- "Upgrades").
DROP INDEX run_queue_run;

CREATE OR REPLACE FUNCTION chimes_release_held(job_ids uuid[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    released integer;
BEGIN
    WITH next_up AS (
        SELECT DISTINCT ON (h.job_id) h.job_id, h.run_id, h.scheduled_at
        FROM active_runs h
        WHERE h.held AND (job_ids IS NULL OR h.job_id = ANY(job_ids))
          AND NOT EXISTS (SELECT 1 FROM active_runs o WHERE o.job_id = h.job_id AND NOT o.held)
        ORDER BY h.job_id, h.scheduled_at
    ),
    freed AS (
        UPDATE active_runs a SET held = false
        FROM next_up n WHERE a.job_id = n.job_id AND a.run_id = n.run_id
        RETURNING a.run_id, a.scheduled_at
    ),
    noted AS (
        UPDATE runs r SET reason = NULLIF(regexp_replace(coalesce(r.reason, ''),
                                   '(; )?waiting for the active run \(concurrency queue\)', ''), '')
        FROM freed f WHERE r.run_id = f.run_id AND r.scheduled_at = f.scheduled_at
        RETURNING r.run_id, r.scheduled_at, r.job_id, r.priority, r.status
    )
    -- A held run leaves active_runs' held state once (freed): it is queued once.
    INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
    SELECT priority, run_id, scheduled_at, job_id FROM noted WHERE status = 'scheduled';
    GET DIAGNOSTICS released = ROW_COUNT;
    IF released > 0 THEN
        PERFORM pg_notify('chimes_run_queue', '');
    END IF;
    RETURN released;
END
$$;
