-- Chimes schema, version 1. See docs/architecture.md for why each table looks the way it does.

CREATE TABLE jobs (
    job_id          uuid PRIMARY KEY,
    owner           text NOT NULL,
    name            text NOT NULL,
    cron            text,
    run_at          timestamptz,
    timezone        text NOT NULL DEFAULT 'UTC',
    jitter_sec      integer NOT NULL DEFAULT 0,
    task            jsonb NOT NULL,
    retry_policy    jsonb NOT NULL,
    timeout_sec     integer NOT NULL,
    concurrency     text NOT NULL,
    priority        smallint NOT NULL,
    paused          boolean NOT NULL DEFAULT false,
    version         integer NOT NULL DEFAULT 1,
    idempotency_key text,
    request_hash    bytea,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT jobs_one_schedule CHECK ((cron IS NULL) <> (run_at IS NULL)),
    CONSTRAINT jobs_concurrency CHECK (concurrency IN ('skip', 'queue', 'allow')),
    CONSTRAINT jobs_priority CHECK (priority BETWEEN 0 AND 2)
);
CREATE INDEX jobs_owner ON jobs (owner, job_id);
CREATE UNIQUE INDEX jobs_owner_idempotency_key ON jobs (owner, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- The trigger index: the next fire of every active job (kind 0) and pending retries (kind 1).
-- trigger_id is the job id for schedule triggers and the run id for retry triggers.
CREATE TABLE triggers (
    partition_id smallint NOT NULL,
    fire_at      timestamptz NOT NULL,
    trigger_id   uuid NOT NULL,
    job_id       uuid NOT NULL,
    job_version  integer NOT NULL,
    kind         smallint NOT NULL,
    PRIMARY KEY (partition_id, fire_at, trigger_id)
) WITH (fillfactor = 85);
CREATE INDEX triggers_job ON triggers (job_id);

CREATE TABLE partition_leases (
    partition_id smallint PRIMARY KEY,
    owner        text,
    token        bigint NOT NULL DEFAULT 0,
    expires_at   timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO partition_leases (partition_id) SELECT generate_series(0, 1023);

CREATE TABLE scheduler_nodes (
    node_id      text PRIMARY KEY,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE workers (
    worker_id    text PRIMARY KEY,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    concurrency  integer NOT NULL,
    in_flight    integer NOT NULL DEFAULT 0,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

-- Run history, partitioned by day of scheduled_at so retention drops whole partitions.
-- run_id is derived from (job_id, scheduled_at) and encodes scheduled_at (ids.py).
CREATE TABLE runs (
    run_id           uuid NOT NULL,
    scheduled_at     timestamptz NOT NULL,
    job_id           uuid NOT NULL,
    owner            text NOT NULL,
    partition_id     smallint NOT NULL,
    job_version      integer NOT NULL,
    trigger          text NOT NULL,
    priority         smallint NOT NULL,
    status           text NOT NULL DEFAULT 'scheduled',
    attempt          integer NOT NULL DEFAULT 1,
    fired_at         timestamptz,
    worker_id        text,
    lease_token      uuid,
    lease_expires_at timestamptz,
    deadline_at      timestamptz,
    started_at       timestamptz,
    finished_at      timestamptz,
    error            text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, scheduled_at),
    CONSTRAINT runs_status CHECK (status IN ('scheduled', 'running', 'succeeded', 'failed', 'skipped', 'cancelled')),
    CONSTRAINT runs_trigger CHECK (trigger IN ('schedule', 'manual', 'rerun', 'catchup'))
) PARTITION BY RANGE (scheduled_at);
CREATE INDEX runs_job_history ON runs (job_id, scheduled_at DESC);
CREATE INDEX runs_running ON runs (lease_expires_at) WHERE status = 'running';
CREATE TABLE runs_default PARTITION OF runs DEFAULT;

CREATE TABLE run_attempts (
    run_id       uuid NOT NULL,
    scheduled_at timestamptz NOT NULL,
    attempt      integer NOT NULL,
    worker_id    text,
    status       text NOT NULL,
    started_at   timestamptz,
    finished_at  timestamptz NOT NULL,
    error        text,
    output       text,
    PRIMARY KEY (run_id, scheduled_at, attempt)
) PARTITION BY RANGE (scheduled_at);
CREATE TABLE run_attempts_default PARTITION OF run_attempts DEFAULT;

-- The run queue: only runs ready to start now. Claimed (and deleted) by workers with SKIP LOCKED;
-- from then on the run's lease on `runs` says who has it.
CREATE TABLE run_queue (
    queue_id     bigint GENERATED ALWAYS AS IDENTITY,
    tier         smallint NOT NULL,
    run_id       uuid NOT NULL,
    scheduled_at timestamptz NOT NULL,
    job_id       uuid NOT NULL,
    enqueued_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tier, queue_id)
) WITH (fillfactor = 70, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0);
CREATE UNIQUE INDEX run_queue_run ON run_queue (run_id);

CREATE TABLE api_tokens (
    token_id   uuid PRIMARY KEY,
    token_hash bytea NOT NULL UNIQUE,
    owner      text NOT NULL,
    admin      boolean NOT NULL DEFAULT false,
    name       text,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

-- Creates the daily partitions of runs and run_attempts for [start, start + days).
CREATE FUNCTION chimes_ensure_run_partitions(start date, days integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    day date;
    created integer := 0;
    parent text;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('chimes_run_partitions'));
    FOR i IN 0 .. days - 1 LOOP
        day := start + i;
        FOREACH parent IN ARRAY ARRAY['runs', 'run_attempts'] LOOP
            IF to_regclass(format('%s_%s', parent, to_char(day, 'YYYYMMDD'))) IS NULL THEN
                EXECUTE format('CREATE TABLE %I PARTITION OF %I FOR VALUES FROM (%L) TO (%L)',
                               format('%s_%s', parent, to_char(day, 'YYYYMMDD')), parent,
                               day::timestamp AT TIME ZONE 'UTC', (day + 1)::timestamp AT TIME ZONE 'UTC');
                created := created + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN created;
END
$$;
