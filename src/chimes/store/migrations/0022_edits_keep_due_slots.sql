-- An edit applies to the slots after it: a slot whose instant had passed but which had not fired
-- when a job was edited or paused fires, late and once, or is recorded (docs/semantics.md, "Edits").
--
-- plan_version: the job's version at its last change to what a fire reads (its schedule, catch-up
-- policy, start deadline, concurrency policy, pause). A trigger written at that version or after it is
-- still good: an edit of anything else (a tag, the task, the retry policy) leaves the trigger as it was,
-- so a job edited every second keeps firing. NULL: the job's version (rows written before this step).
-- Kept by a trigger on jobs, so that every writer (an older API during an upgrade, the database's own
-- pause of a failing job) keeps it right.
--
-- carried_until, carried_slots, carried_unrecorded: a trigger due at an edit or a pause is kept for the
-- slots of the definition before it that were due up to carried_until: carried_slots, oldest first
-- (NULL: the job's schedule walked up to carried_until, which a pause does not change), and
-- carried_unrecorded older ones counted in a note.
ALTER TABLE jobs ADD COLUMN plan_version integer,
                 ADD COLUMN carried_until timestamptz,
                 ADD COLUMN carried_slots timestamptz[],
                 ADD COLUMN carried_unrecorded integer;

CREATE FUNCTION chimes_plan_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.plan_version IS NULL THEN
        NEW.plan_version := coalesce(OLD.plan_version, OLD.version);
    END IF;
    IF (NEW.cron, NEW.run_at, NEW.timezone, NEW.jitter_sec, NEW.dst_gap, NEW.dst_fold, NEW.catch_up,
        NEW.start_deadline_sec, NEW.every_sec, NEW.phase_sec, NEW.start_at, NEW.end_at, NEW.max_runs,
        NEW.exclude_calendars, NEW.concurrency, NEW.paused)
       IS DISTINCT FROM
       (OLD.cron, OLD.run_at, OLD.timezone, OLD.jitter_sec, OLD.dst_gap, OLD.dst_fold, OLD.catch_up,
        OLD.start_deadline_sec, OLD.every_sec, OLD.phase_sec, OLD.start_at, OLD.end_at, OLD.max_runs,
        OLD.exclude_calendars, OLD.concurrency, OLD.paused) THEN
        NEW.plan_version := NEW.version;
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER jobs_plan_version BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION chimes_plan_version();

-- The streak of failed runs that pauses a job counts only runs fired since its last resume: a job
-- resumed after N failures pauses again after N more, not after one. A schedule trigger already due
-- is kept for the slots due before the pause (carried_until), as a pause through the API keeps it.
CREATE OR REPLACE FUNCTION chimes_pause_failing(run_ids uuid[], scheduled_ats timestamptz[]) RETURNS integer
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
                  SELECT r.status FROM runs r
                  WHERE r.job_id = j.job_id AND r.status IN ('succeeded', 'failed')
                    AND (j.resumed_at IS NULL OR r.fired_at >= j.resumed_at)
                  ORDER BY r.scheduled_at DESC LIMIT j.pause_after_failures) newest) = j.pause_after_failures
    ),
    stopped AS (
        UPDATE jobs j SET paused = true, paused_at = now(), paused_by = 'chimes',
                          pause_note = format('%s consecutive runs failed (pauseAfterFailures)', j.pause_after_failures),
                          carried_until = CASE WHEN j.carried_slots IS NULL THEN now() ELSE j.carried_until END,
                          version = j.version + 1, updated_at = now()
        FROM failing f WHERE j.job_id = f.job_id AND NOT j.paused
        RETURNING j.job_id, j.paused_at, j.paused_by, j.pause_note, j.version, j.carried_until
    ),
    kept AS (
        UPDATE triggers t SET job_version = s.version FROM stopped s
        WHERE t.job_id = s.job_id AND t.kind = 0 AND t.fire_at <= s.carried_until
    ),
    untriggered AS (
        DELETE FROM triggers t USING stopped s
        WHERE t.job_id = s.job_id AND t.kind = 0 AND t.fire_at > s.carried_until
    )
    INSERT INTO job_pauses (job_id, paused_at, paused_by, note)
    SELECT job_id, paused_at, paused_by, pause_note FROM stopped
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS paused_jobs = ROW_COUNT;
    RETURN paused_jobs;
END
$$;
