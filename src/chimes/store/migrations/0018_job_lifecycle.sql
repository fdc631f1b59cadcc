-- concurrency "replace": a new slot cancels the job's active runs and starts its own
-- (docs/semantics.md, "Concurrency"). Adding the CHECK reads every job once under the ACCESS
-- EXCLUSIVE lock the DROP takes: fires and edits of jobs wait that long, and nothing is lost.
ALTER TABLE jobs DROP CONSTRAINT jobs_concurrency;
ALTER TABLE jobs ADD CONSTRAINT jobs_concurrency CHECK (concurrency IN ('skip', 'queue', 'allow', 'replace'));

-- Pauses with who and why: the job's current pause on its row (shown with the job), every pause in
-- job_pauses (GET /jobs/{id}/pauses), in the job's home like the job. A job pauses itself after
-- pause_after_failures consecutive failed runs (chimes_pause_failing).
ALTER TABLE jobs ADD COLUMN pause_after_failures integer,
                 ADD COLUMN paused_by text,
                 ADD COLUMN pause_note text;
CREATE TABLE job_pauses (
    job_id     uuid NOT NULL,
    paused_at  timestamptz NOT NULL,
    paused_by  text NOT NULL,
    note       text,
    resumed_at timestamptz,
    resumed_by text,
    PRIMARY KEY (job_id, paused_at)
);

-- Called with the runs that just ended (chimes.store.working.runs_ended), in their transaction: a job
-- with pause_after_failures N whose N newest runs that ended as succeeded or failed (by scheduled
-- time; cancelled and skipped runs neither count nor break the streak) all failed is paused, as a
-- PATCH {"paused": true} would: a new version, its schedule trigger gone, the pause recorded with
-- the actor "chimes". Only jobs with a run that failed for good are looked at: a success costs nothing.
CREATE FUNCTION chimes_pause_failing(run_ids uuid[], scheduled_ats timestamptz[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    paused_jobs integer;
BEGIN
    WITH failed AS (
        SELECT DISTINCT r.job_id FROM unnest(run_ids, scheduled_ats) AS e(run_id, scheduled_at)
        JOIN runs r ON r.run_id = e.run_id AND r.scheduled_at = e.scheduled_at AND r.status = 'failed'
    ),
    failing AS (
        SELECT j.job_id FROM failed f JOIN jobs j ON j.job_id = f.job_id
        WHERE j.pause_after_failures IS NOT NULL AND NOT j.paused
          AND (SELECT count(*) FILTER (WHERE newest.status = 'failed') FROM (
                  SELECT r.status FROM runs r WHERE r.job_id = j.job_id AND r.status IN ('succeeded', 'failed')
                  ORDER BY r.scheduled_at DESC LIMIT j.pause_after_failures) newest) = j.pause_after_failures
    ),
    stopped AS (
        UPDATE jobs j SET paused = true, paused_at = now(), paused_by = 'chimes',
                          pause_note = format('%s consecutive runs failed (pauseAfterFailures)', j.pause_after_failures),
                          version = j.version + 1, updated_at = now()
        FROM failing f WHERE j.job_id = f.job_id AND NOT j.paused
        RETURNING j.job_id, j.paused_at, j.paused_by, j.pause_note
    ),
    untriggered AS (
        DELETE FROM triggers t USING stopped s WHERE t.job_id = s.job_id AND t.kind = 0
    )
    INSERT INTO job_pauses (job_id, paused_at, paused_by, note)
    SELECT job_id, paused_at, paused_by, pause_note FROM stopped
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS paused_jobs = ROW_COUNT;
    RETURN paused_jobs;
END
$$;

-- A one-off job that deletes itself once its run ended for good (chimes_delete_completed), so
-- finished one-offs stop counting against the owner's job quota. Its runs stay: nothing refers from
-- runs to jobs by a foreign key, and the run history is kept until retention removes it.
ALTER TABLE jobs ADD COLUMN delete_after_completion boolean DEFAULT false NOT NULL;

-- Called with the runs that just ended, after the other bookkeeping of runs_ended (which reads the
-- job): a one-off job with delete_after_completion whose scheduled run ended succeeded, failed for
-- good or cancelled is deleted with its triggers and pause history. A manual run or a re-run of it
-- does not end it.
CREATE FUNCTION chimes_delete_completed(run_ids uuid[], scheduled_ats timestamptz[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    deleted_jobs integer;
BEGIN
    WITH done AS (
        SELECT DISTINCT r.job_id FROM unnest(run_ids, scheduled_ats) AS e(run_id, scheduled_at)
        JOIN runs r ON r.run_id = e.run_id AND r.scheduled_at = e.scheduled_at
        WHERE r.status IN ('succeeded', 'failed', 'cancelled') AND r.trigger IN ('schedule', 'catchup')
    ),
    gone AS (
        DELETE FROM jobs j USING done d
        WHERE j.job_id = d.job_id AND j.delete_after_completion AND j.run_at IS NOT NULL
        RETURNING j.job_id
    ),
    untriggered AS (
        DELETE FROM triggers t USING gone g WHERE t.job_id = g.job_id
    ),
    forgotten AS (
        DELETE FROM job_pauses p USING gone g WHERE p.job_id = g.job_id
    )
    SELECT count(*) INTO deleted_jobs FROM gone;
    RETURN deleted_jobs;
END
$$;

-- notifyOn: which ends and starts of a job's runs are notified ('failed', 'succeeded', 'started');
-- 'failed' alone is what every job was told before. start_missed and schedule_stalled do not depend
-- on it. Started runs are queued by the claim (claim_runs), succeeded and failed ones here.
ALTER TABLE jobs ADD COLUMN notify_on text[] DEFAULT '{failed}' NOT NULL;

-- One notification per run that failed for good (never one per attempt), unless its job left
-- 'failed' out of notifyOn. The run of a deleted job is notified as before (the fleet's URL).
CREATE OR REPLACE FUNCTION chimes_notify_failed(run_ids uuid[], scheduled_ats timestamptz[]) RETURNS integer
LANGUAGE sql AS $$
    SELECT chimes_notify_runs('run_failed', array_agg(r.run_id), array_agg(r.scheduled_at),
                              array_agg(NULL::text))
    FROM unnest(run_ids, scheduled_ats) AS e(run_id, scheduled_at)
    JOIN runs r ON r.run_id = e.run_id AND r.scheduled_at = e.scheduled_at AND r.status = 'failed'
    LEFT JOIN jobs j ON j.job_id = r.job_id
    WHERE j.job_id IS NULL OR 'failed' = ANY (j.notify_on)
$$;

-- One notification per run that succeeded, for the jobs with 'succeeded' in notifyOn.
CREATE FUNCTION chimes_notify_succeeded(run_ids uuid[], scheduled_ats timestamptz[]) RETURNS integer
LANGUAGE sql AS $$
    SELECT chimes_notify_runs('run_succeeded', array_agg(r.run_id), array_agg(r.scheduled_at),
                              array_agg(NULL::text))
    FROM unnest(run_ids, scheduled_ats) AS e(run_id, scheduled_at)
    JOIN runs r ON r.run_id = e.run_id AND r.scheduled_at = e.scheduled_at AND r.status = 'succeeded'
    JOIN jobs j ON j.job_id = r.job_id AND 'succeeded' = ANY (j.notify_on)
$$;
