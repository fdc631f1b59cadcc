-- Alerts that give up and clean up: dead-lettered notifications, and what retention and the API
-- read them by. See docs/semantics.md (Notifications) and docs/operations.md (Retention).

-- A notification still undelivered this long after it was queued (the notifier's give-up time, 24 h
-- by default) is dead-lettered: kept with its last error, never tried again.
ALTER TABLE notifications ADD COLUMN dead_at timestamptz;
DROP INDEX notifications_pending;
CREATE INDEX notifications_pending ON notifications (next_attempt_at) WHERE sent_at IS NULL AND dead_at IS NULL;
-- Listing (GET /notifications, newest first, per owner or for admins) and retention (oldest first).
CREATE INDEX notifications_created ON notifications (created_at, notification_id);
CREATE INDEX notifications_owner_created ON notifications (owner, created_at, notification_id);
CREATE INDEX notifications_dead ON notifications (created_at, notification_id) WHERE dead_at IS NOT NULL;

-- Start deadlines count from the scheduled time, for every run that has not started (not only the
-- head of the queue): the health check reads the oldest of them from this index.
CREATE INDEX runs_unstarted ON runs (scheduled_at) WHERE status = 'scheduled' AND started_at IS NULL;

-- The dead man's switch: recurring schedules whose last fire is older than their period plus a
-- grace, whatever the cause, one row per stalled job while the incident lasts (a handful, so the
-- dashboard's "stalled" filter and job page read it directly). cause: 'overdue' (its trigger is due
-- and not fired: the partition has no owner, or the fleet is behind), 'no_trigger' (its trigger row
-- is gone), 'held' (a run has been holding a skip/queue schedule).
CREATE TABLE schedule_stalls (
    job_id      uuid PRIMARY KEY,
    owner       text NOT NULL,
    cause       text NOT NULL CHECK (cause IN ('overdue', 'no_trigger', 'held')),
    since       timestamptz NOT NULL,  -- the last fire (held: the holding run's start)
    detail      text NOT NULL,
    fire_at     timestamptz,           -- overdue: the trigger that did not fire
    run_id      uuid,                  -- held: the run holding the schedule
    detected_at timestamptz NOT NULL DEFAULT now()
);

-- Queues one notification per job for an event that has no run (a schedule that stopped firing, a
-- slot that was never enqueued). The id is md5 of the given key, so each incident is queued once.
CREATE FUNCTION chimes_notify_jobs(kind text, job_ids uuid[], keys text[], details text[], slots timestamptz[],
                                   run_ids uuid[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    queued integer;
    fallback text := (SELECT value #>> '{}' FROM settings WHERE key = 'notify_url');
BEGIN
    INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload)
    SELECT md5(e.key)::uuid, j.job_id, j.owner, kind, coalesce(j.notify_url, fallback),
           jsonb_build_object('kind', kind, 'runId', e.run_id, 'jobId', j.job_id, 'jobName', j.name,
                              'owner', j.owner, 'scheduledAt', e.slot, 'status', NULL, 'attempt', NULL,
                              'error', e.detail, 'startedAt', NULL, 'finishedAt', NULL)
    FROM unnest(job_ids, keys, details, slots, run_ids) AS e(job_id, key, detail, slot, run_id)
    JOIN jobs j ON j.job_id = e.job_id
    WHERE coalesce(j.notify_url, fallback) IS NOT NULL
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS queued = ROW_COUNT;
    RETURN queued;
END
$$;
