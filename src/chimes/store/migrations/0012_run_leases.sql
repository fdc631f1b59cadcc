-- A run's two updates, when a worker claims it and when its outcome comes back, become updates in
-- place (HOT): no new index entries, and only the changed bytes in the WAL. PostgreSQL updates a row
-- in place only when no indexed column changes and its page has room. Both updates changed `status`,
-- named in the predicates of runs_running, runs_unstarted and runs_failed, and `lease_expires_at`,
-- the key of runs_running; and the pages were full. So:
--
-- * A running run's lease (its expiry, its deadline) lives in `run_leases`, one row per run in
--   flight, inserted by the claim and deleted by whatever ends the attempt (the outcome, the reaper,
--   a cancel, a release). Workers' heartbeats update that small row, never the run. The reaper reads
--   the whole table (it holds only the runs in flight). The run keeps its lease token: it is the
--   fence the outcome is written under.
-- * The three partial indexes go. The runs waiting to start are the queue's rows (the late-start
--   check reads `run_queue`); failures are found through their last attempt (`run_attempts_failed`:
--   attempt rows are only ever inserted, so the partial index costs nothing to an attempt that
--   succeeded).
-- * The day partitions of `runs` leave room on each page for the new versions of its rows (below);
--   the old versions are pruned as the page is read again.
--
-- A cut-over: workers and scheduler nodes of earlier versions name `lease_expires_at`, which is gone,
-- so their claims, heartbeats, outcomes and reaps fail (and say so in their logs) until they are
-- replaced; a run one of them was running when this ran is reaped by the new version when its lease
-- expires, as any run whose worker stopped. Building `run_attempts_failed` reads the attempt history
-- once (docs/operations.md, "Upgrades").

CREATE TABLE run_leases (
    run_id uuid NOT NULL,
    scheduled_at timestamptz NOT NULL,
    partition_id smallint NOT NULL,
    token uuid NOT NULL,
    expires_at timestamptz NOT NULL,
    deadline_at timestamptz NOT NULL,
    CONSTRAINT run_leases_pkey PRIMARY KEY (run_id)
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0);

INSERT INTO run_leases (run_id, scheduled_at, partition_id, token, expires_at, deadline_at)
SELECT run_id, scheduled_at, partition_id, lease_token, lease_expires_at, coalesce(deadline_at, 'infinity')
FROM runs WHERE status = 'running' AND lease_token IS NOT NULL;

-- Migration 0002's claim function, kept until now for workers of an earlier version, writes the
-- columns dropped below.
DROP FUNCTION chimes_start_runs(uuid[], timestamptz[], uuid[], text, float8, float8);

DROP INDEX runs_running;
DROP INDEX runs_unstarted;
DROP INDEX runs_failed;
ALTER TABLE runs DROP COLUMN lease_expires_at, DROP COLUMN deadline_at;

CREATE INDEX run_attempts_failed ON run_attempts (finished_at) WHERE status = 'failed';

-- Room on the pages of the day partitions of runs (the setting `runs_fillfactor`, `chimes config set
-- runs-fillfactor N`, 40 by default): made with it, and set again on today's and the coming days'
-- partitions when it changes (for the pages they have yet to fill), each time partitions are ensured
-- (at start-up and hourly). A claim updates runs of a page together, in one transaction, and each
-- update needs room on the page for a new version of its row: with 40% of a page filled at insert,
-- every run's two updates stay in place (docs/benchmarks.md, "What a run writes to the WAL").
CREATE OR REPLACE FUNCTION chimes_ensure_run_partitions(start date, days integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    day date;
    created integer := 0;
    parent text;
    part text;
    fill integer := coalesce((SELECT (value #>> '{}')::integer FROM settings WHERE key = 'runs_fillfactor'), 40);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('chimes_run_partitions'));
    FOR i IN 0 .. days - 1 LOOP
        day := start + i;
        FOREACH parent IN ARRAY ARRAY['runs', 'run_attempts'] LOOP
            part := format('%s_%s', parent, to_char(day, 'YYYYMMDD'));
            IF to_regclass(part) IS NULL THEN
                EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)', part, parent,
                               day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
                created := created + 1;
            END IF;
        END LOOP;
        part := format('runs_%s', to_char(day, 'YYYYMMDD'));
        IF day >= (now() AT TIME ZONE 'UTC')::date AND NOT EXISTS (
            SELECT 1 FROM pg_class WHERE oid = part::regclass AND reloptions @> ARRAY[format('fillfactor=%s', fill)]
        ) THEN
            EXECUTE format('ALTER TABLE %I SET (fillfactor = %s)', part, fill);
        END IF;
    END LOOP;
    RETURN created;
END
$$;
