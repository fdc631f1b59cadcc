-- Scheduling semantics: concurrency policies, catch-up, DST policy, tags, notifications, poison runs.

ALTER TABLE jobs
    ADD COLUMN dst_gap text,
    ADD COLUMN dst_fold text,
    ADD COLUMN catch_up jsonb NOT NULL DEFAULT '{"policy": "one"}',
    ADD COLUMN queue_limit integer NOT NULL DEFAULT 10,
    ADD COLUMN tags text[] NOT NULL DEFAULT '{}',
    ADD COLUMN notify_url text,
    ADD COLUMN start_deadline_sec integer NOT NULL DEFAULT 300,
    ADD COLUMN paused_at timestamptz,
    ADD COLUMN resumed_at timestamptz,
    ADD CONSTRAINT jobs_dst_gap CHECK (dst_gap IN ('shift', 'skip')),
    ADD CONSTRAINT jobs_dst_fold CHECK (dst_fold IN ('first', 'last', 'both'));

-- Why a run was skipped, or how it came about (catch-up); shown as `reason` in the API.
ALTER TABLE runs
    ADD COLUMN reason text,
    ADD COLUMN lease_losses integer NOT NULL DEFAULT 0;

-- The runs of each job that have not ended (scheduled or running), for concurrency policies.
-- A held run (concurrency "queue") waits here, outside the run queue, until the active run ends.
CREATE TABLE active_runs (
    job_id       uuid NOT NULL,
    run_id       uuid NOT NULL,
    scheduled_at timestamptz NOT NULL,
    held         boolean NOT NULL DEFAULT false,
    PRIMARY KEY (job_id, run_id)
);
CREATE INDEX active_runs_held ON active_runs (job_id, scheduled_at) WHERE held;

INSERT INTO active_runs (job_id, run_id, scheduled_at)
SELECT job_id, run_id, scheduled_at FROM runs WHERE status IN ('scheduled', 'running');

-- Notifications to send (final failures, missed starts), written in the same transaction as the
-- event so that none is lost; sent and marked by the notifier, at least once, each with its id as
-- the Idempotency-Key.
CREATE TABLE notifications (
    notification_id uuid PRIMARY KEY,
    job_id          uuid NOT NULL,
    owner           text NOT NULL,
    kind            text NOT NULL,
    url             text NOT NULL,
    payload         jsonb NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    attempts        integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz,
    last_error      text
);
CREATE INDEX notifications_pending ON notifications (next_attempt_at) WHERE sent_at IS NULL;

-- Operator settings that every role reads from the database (the API and the workers are
-- separate processes): the default notification webhook, for example.
CREATE TABLE settings (
    key   text PRIMARY KEY,
    value jsonb NOT NULL
);

-- Called in the transaction that ended runs (succeeded, failed for good, cancelled, skipped): they
-- stop counting as active, and for each of their jobs left with no running run the oldest held run
-- (concurrency "queue") is released to the run queue. Returns how many were released.
CREATE FUNCTION chimes_runs_ended(ended_jobs uuid[], ended_runs uuid[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    released integer;
BEGIN
    DELETE FROM active_runs a
    USING unnest(ended_jobs, ended_runs) AS e(job_id, run_id)
    WHERE a.job_id = e.job_id AND a.run_id = e.run_id;
    SELECT chimes_release_held(ended_jobs) INTO released;
    RETURN released;
END
$$;

-- Releases the oldest held run of each job (all jobs when job_ids is NULL) that has no running one.
-- Also the reconciliation of last resort: the reaper calls it for every job now and then, so a held
-- run can never wait forever behind a race between a fire and an end.
CREATE FUNCTION chimes_release_held(job_ids uuid[]) RETURNS integer
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
    INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
    SELECT priority, run_id, scheduled_at, job_id FROM noted WHERE status = 'scheduled'
    ON CONFLICT (run_id) DO NOTHING;
    GET DIAGNOSTICS released = ROW_COUNT;
    IF released > 0 THEN
        PERFORM pg_notify('chimes_run_queue', '');
    END IF;
    RETURN released;
END
$$;

-- Forgets active entries whose run has ended (or is gone) without passing chimes_runs_ended.
CREATE FUNCTION chimes_forget_ended_runs() RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    forgotten integer;
BEGIN
    DELETE FROM active_runs a
    WHERE NOT EXISTS (
        SELECT 1 FROM runs r
        WHERE r.run_id = a.run_id AND r.scheduled_at = a.scheduled_at AND r.status IN ('scheduled', 'running')
    );
    GET DIAGNOSTICS forgotten = ROW_COUNT;
    RETURN forgotten;
END
$$;

-- Retention: drops the daily run-history partitions that end before `cutoff`, and deletes the
-- (rare) rows older than it from the default partitions. Returns the partitions dropped.
CREATE FUNCTION chimes_drop_run_partitions(cutoff date) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    part record;
    dropped integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('chimes_run_partitions'));
    FOR part IN
        SELECT c.relname
        FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        JOIN pg_class p ON p.oid = i.inhparent
        WHERE p.relname IN ('runs', 'run_attempts')
          AND c.relname ~ '_[0-9]{8}$'
          AND to_date(right(c.relname, 8), 'YYYYMMDD') < cutoff
    LOOP
        EXECUTE format('DROP TABLE %I', part.relname);
        dropped := dropped + 1;
    END LOOP;
    DELETE FROM runs_default WHERE scheduled_at < cutoff;
    DELETE FROM run_attempts_default WHERE scheduled_at < cutoff;
    RETURN dropped;
END
$$;

-- Queues one notification of `kind` for each given run, when its job or the operator named a
-- webhook. Called in the transaction of the event, so a crash loses none; the id is derived from the
-- run and the kind, so calling it twice queues one.
CREATE FUNCTION chimes_notify_runs(kind text, run_ids uuid[], scheduled_ats timestamptz[], details text[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    queued integer;
    fallback text := (SELECT value #>> '{}' FROM settings WHERE key = 'notify_url');
BEGIN
    INSERT INTO notifications (notification_id, job_id, owner, kind, url, payload)
    SELECT md5(r.run_id::text || ':' || kind)::uuid, r.job_id, r.owner, kind, coalesce(j.notify_url, fallback),
           jsonb_build_object('kind', kind, 'runId', r.run_id, 'jobId', r.job_id, 'jobName', j.name,
                              'owner', r.owner, 'scheduledAt', r.scheduled_at, 'status', r.status,
                              'attempt', r.attempt, 'error', coalesce(e.detail, r.error),
                              'startedAt', r.started_at, 'finishedAt', r.finished_at)
    FROM unnest(run_ids, scheduled_ats, details) AS e(run_id, scheduled_at, detail)
    JOIN runs r ON r.run_id = e.run_id AND r.scheduled_at = e.scheduled_at
    LEFT JOIN jobs j ON j.job_id = r.job_id
    WHERE coalesce(j.notify_url, fallback) IS NOT NULL
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS queued = ROW_COUNT;
    RETURN queued;
END
$$;

-- One notification per run that failed for good (never one per attempt).
CREATE FUNCTION chimes_notify_failed(run_ids uuid[], scheduled_ats timestamptz[]) RETURNS integer
LANGUAGE sql AS $$
    SELECT chimes_notify_runs('run_failed', array_agg(r.run_id), array_agg(r.scheduled_at),
                              array_agg(NULL::text))
    FROM unnest(run_ids, scheduled_ats) AS e(run_id, scheduled_at)
    JOIN runs r ON r.run_id = e.run_id AND r.scheduled_at = e.scheduled_at AND r.status = 'failed'
$$;

-- Caps on how many runs of an owner, or of jobs with a tag, run at once, fleet-wide. Runs over a cap
-- wait in the queue, in order. Usage is counted live from the running runs (a small set), so it can
-- never drift; claims of capped runs are serialized by an advisory lock.
CREATE TABLE concurrency_caps (
    scope       text NOT NULL CHECK (scope IN ('owner', 'tag')),
    name        text NOT NULL,
    max_running integer NOT NULL CHECK (max_running >= 0),
    PRIMARY KEY (scope, name)
);

-- Starts the runs a worker took from the queue: each becomes running under a new lease token, if it
-- is still waiting (a run cancelled meanwhile is left alone). Returns what the worker needs to run it.
CREATE FUNCTION chimes_start_runs(run_ids uuid[], scheduled_ats timestamptz[], job_ids uuid[], worker text,
                                  lease_sec float8, deadline_grace_sec float8)
RETURNS TABLE (run_id uuid, scheduled_at timestamptz, job_id uuid, attempt integer, lease_token uuid,
               started_at timestamptz, trigger text, task jsonb, retry_policy jsonb, timeout_sec integer,
               job_exists boolean, owner text, priority smallint)
LANGUAGE sql AS $$
    UPDATE runs r
    SET status = 'running', worker_id = worker, lease_token = gen_random_uuid(),
        lease_expires_at = now() + make_interval(secs => lease_sec), started_at = now(),
        deadline_at = now() + make_interval(secs => coalesce(j.timeout_sec, 3600) + deadline_grace_sec)
    FROM unnest(run_ids, scheduled_ats, job_ids) AS p(run_id, scheduled_at, job_id)
    LEFT JOIN jobs j ON j.job_id = p.job_id
    WHERE r.run_id = p.run_id AND r.scheduled_at = p.scheduled_at AND r.status = 'scheduled'
    RETURNING r.run_id, r.scheduled_at, r.job_id, r.attempt, r.lease_token, r.started_at, r.trigger,
              j.task, j.retry_policy, j.timeout_sec, j.job_id IS NOT NULL, r.owner, r.priority
$$;
