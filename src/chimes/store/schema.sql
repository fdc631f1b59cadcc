-- The schema the migrations in src/chimes/store/migrations produce, read back from the catalog of
-- a freshly migrated database (chimes.store.schema). Generated: do not edit. After adding a
-- migration: python -m chimes.store.schema --write
-- Left out: owners and grants, and the day partitions of runs and run_attempts, which
-- chimes_ensure_run_partitions makes as days come.

CREATE SEQUENCE public.calendar_versions AS bigint START 1 INCREMENT 1 MINVALUE 1 MAXVALUE 9223372036854775807 CACHE 1;

CREATE TABLE public.active_runs (
    job_id uuid NOT NULL,
    run_id uuid NOT NULL,
    scheduled_at timestamp with time zone NOT NULL,
    held boolean DEFAULT false NOT NULL,
    CONSTRAINT active_runs_pkey PRIMARY KEY (job_id, run_id)
);
CREATE INDEX active_runs_held ON public.active_runs USING btree (job_id, scheduled_at) WHERE held;

CREATE TABLE public.api_servers (
    server_id text NOT NULL,
    hostname text NOT NULL,
    pid integer NOT NULL,
    release text NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT api_servers_pkey PRIMARY KEY (server_id)
);

CREATE TABLE public.api_tokens (
    token_id uuid NOT NULL,
    token_hash bytea NOT NULL,
    owner text NOT NULL,
    admin boolean DEFAULT false NOT NULL,
    name text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    revoked_at timestamp with time zone,
    scope text DEFAULT 'write'::text NOT NULL,
    CONSTRAINT api_tokens_admin_is_scope CHECK ((admin = (scope = 'admin'::text))),
    CONSTRAINT api_tokens_pkey PRIMARY KEY (token_id),
    CONSTRAINT api_tokens_scope CHECK ((scope = ANY (ARRAY['read'::text, 'write'::text, 'admin'::text]))),
    CONSTRAINT api_tokens_token_hash_key UNIQUE (token_hash)
);

CREATE TABLE public.audit_log (
    entry_id uuid NOT NULL,
    at timestamp with time zone NOT NULL,
    actor_token uuid,
    actor_name text,
    actor_owner text NOT NULL,
    request_id text,
    action text NOT NULL,
    subject text NOT NULL,
    job_id uuid,
    subject_owner text,
    changes jsonb NOT NULL,
    CONSTRAINT audit_log_pkey PRIMARY KEY (entry_id)
);
CREATE INDEX audit_log_at ON public.audit_log USING btree (at DESC, entry_id DESC);
CREATE INDEX audit_log_job ON public.audit_log USING btree (job_id, at DESC) WHERE (job_id IS NOT NULL);

CREATE TABLE public.calendars (
    owner text NOT NULL,
    name text NOT NULL,
    timezone text NOT NULL,
    dates date[] NOT NULL,
    windows jsonb NOT NULL,
    version bigint NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    change bigint NOT NULL,
    CONSTRAINT calendars_pkey PRIMARY KEY (owner, name)
);
CREATE INDEX calendars_change ON public.calendars USING btree (change);

CREATE TABLE public.cap_slots (
    scope text NOT NULL,
    name text NOT NULL,
    owner text NOT NULL,
    run_id uuid NOT NULL,
    shard_id integer,
    holder text NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    CONSTRAINT cap_slots_pkey PRIMARY KEY (scope, name, owner, run_id)
);
CREATE INDEX cap_slots_run ON public.cap_slots USING btree (run_id);

CREATE TABLE public.claim_leases (
    token uuid NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    deadline_at timestamp with time zone NOT NULL,
    run_ids uuid[] NOT NULL,
    scheduled_ats timestamp with time zone[] NOT NULL,
    deadlines timestamp with time zone[] NOT NULL,
    CONSTRAINT claim_leases_pkey PRIMARY KEY (token),
    CONSTRAINT claim_leases_runs CHECK (((cardinality(run_ids) = cardinality(scheduled_ats)) AND (cardinality(run_ids) = cardinality(deadlines))))
) WITH (fillfactor=50, autovacuum_vacuum_scale_factor=0.01, autovacuum_vacuum_cost_delay=0);

CREATE TABLE public.concurrency_caps (
    scope text NOT NULL,
    name text NOT NULL,
    max_running integer NOT NULL,
    owner text DEFAULT ''::text NOT NULL,
    CONSTRAINT concurrency_caps_max_running_check CHECK ((max_running >= 0)),
    CONSTRAINT concurrency_caps_owner_of_tag CHECK (((scope = 'tag'::text) OR (owner = ''::text))),
    CONSTRAINT concurrency_caps_pkey PRIMARY KEY (scope, name, owner),
    CONSTRAINT concurrency_caps_scope_check CHECK ((scope = ANY (ARRAY['owner'::text, 'tag'::text])))
);

CREATE TABLE public.job_pauses (
    job_id uuid NOT NULL,
    paused_at timestamp with time zone NOT NULL,
    paused_by text NOT NULL,
    note text,
    resumed_at timestamp with time zone,
    resumed_by text,
    CONSTRAINT job_pauses_pkey PRIMARY KEY (job_id, paused_at)
);

CREATE TABLE public.job_slot_counts (
    job_id uuid NOT NULL,
    slots_fired integer NOT NULL,
    CONSTRAINT job_slot_counts_pkey PRIMARY KEY (job_id)
);

CREATE TABLE public.jobs (
    job_id uuid NOT NULL,
    owner text NOT NULL,
    name text NOT NULL,
    cron text,
    run_at timestamp with time zone,
    timezone text DEFAULT 'UTC'::text NOT NULL,
    jitter_sec integer DEFAULT 0 NOT NULL,
    task jsonb NOT NULL,
    retry_policy jsonb NOT NULL,
    timeout_sec integer NOT NULL,
    concurrency text NOT NULL,
    priority smallint NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    version integer DEFAULT 1 NOT NULL,
    idempotency_key text,
    request_hash bytea,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    dst_gap text,
    dst_fold text,
    catch_up jsonb DEFAULT '{"policy": "one"}'::jsonb NOT NULL,
    queue_limit integer DEFAULT 10 NOT NULL,
    tags text[] DEFAULT '{}'::text[] NOT NULL,
    notify_url text,
    start_deadline_sec integer DEFAULT 300 NOT NULL,
    paused_at timestamp with time zone,
    resumed_at timestamp with time zone,
    every_sec integer,
    phase_sec integer,
    start_at timestamp with time zone,
    end_at timestamp with time zone,
    max_runs integer,
    exclude_calendars text[],
    pause_after_failures integer,
    paused_by text,
    pause_note text,
    delete_after_completion boolean DEFAULT false NOT NULL,
    notify_on text[] DEFAULT '{failed}'::text[] NOT NULL,
    plan_version integer,
    carried_until timestamp with time zone,
    carried_slots timestamp with time zone[],
    carried_unrecorded integer,
    CONSTRAINT jobs_bounds CHECK ((end_at > start_at)),
    CONSTRAINT jobs_concurrency CHECK ((concurrency = ANY (ARRAY['skip'::text, 'queue'::text, 'allow'::text, 'replace'::text]))),
    CONSTRAINT jobs_dst_fold CHECK ((dst_fold = ANY (ARRAY['first'::text, 'last'::text, 'both'::text]))),
    CONSTRAINT jobs_dst_gap CHECK ((dst_gap = ANY (ARRAY['shift'::text, 'skip'::text]))),
    CONSTRAINT jobs_interval CHECK ((((every_sec IS NULL) AND (phase_sec IS NULL)) OR ((every_sec >= 1) AND (phase_sec >= 0) AND (phase_sec < every_sec)))),
    CONSTRAINT jobs_max_runs CHECK ((max_runs >= 1)),
    CONSTRAINT jobs_one_schedule CHECK ((num_nonnulls(cron, run_at, every_sec) = 1)),
    CONSTRAINT jobs_pkey PRIMARY KEY (job_id),
    CONSTRAINT jobs_priority CHECK (((priority >= 0) AND (priority <= 2)))
);
CREATE INDEX jobs_name ON public.jobs USING btree (lower(name) COLLATE "C", job_id);
CREATE INDEX jobs_owner ON public.jobs USING btree (owner, job_id);
CREATE UNIQUE INDEX jobs_owner_idempotency_key ON public.jobs USING btree (owner, idempotency_key) WHERE (idempotency_key IS NOT NULL);
CREATE INDEX jobs_owner_name ON public.jobs USING btree (owner, lower(name) COLLATE "C", job_id);
CREATE INDEX jobs_paused_name ON public.jobs USING btree (lower(name) COLLATE "C", job_id) WHERE paused;

CREATE TABLE public.notifications (
    notification_id uuid NOT NULL,
    job_id uuid NOT NULL,
    owner text NOT NULL,
    kind text NOT NULL,
    url text NOT NULL,
    payload jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    attempts integer DEFAULT 0 NOT NULL,
    next_attempt_at timestamp with time zone DEFAULT now() NOT NULL,
    sent_at timestamp with time zone,
    last_error text,
    dead_at timestamp with time zone,
    CONSTRAINT notifications_pkey PRIMARY KEY (notification_id)
);
CREATE INDEX notifications_created ON public.notifications USING btree (created_at, notification_id);
CREATE INDEX notifications_dead ON public.notifications USING btree (created_at, notification_id) WHERE (dead_at IS NOT NULL);
CREATE INDEX notifications_owner_created ON public.notifications USING btree (owner, created_at, notification_id);
CREATE INDEX notifications_pending ON public.notifications USING btree (next_attempt_at) WHERE ((sent_at IS NULL) AND (dead_at IS NULL));

CREATE TABLE public.owners (
    owner text NOT NULL,
    allow_commands boolean DEFAULT false NOT NULL,
    job_quota integer,
    signing_secret text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT owners_job_quota_check CHECK ((job_quota >= 0)),
    CONSTRAINT owners_pkey PRIMARY KEY (owner)
);

CREATE TABLE public.partition_leases (
    partition_id smallint NOT NULL,
    owner text,
    token bigint DEFAULT 0 NOT NULL,
    expires_at timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL,
    closed_by_move bigint,
    CONSTRAINT partition_leases_pkey PRIMARY KEY (partition_id)
) WITH (fillfactor=40, autovacuum_analyze_scale_factor=100);

CREATE TABLE public.run_attempts (
    run_id uuid NOT NULL,
    scheduled_at timestamp with time zone NOT NULL,
    attempt integer NOT NULL,
    worker_id text,
    status text NOT NULL,
    started_at timestamp with time zone,
    finished_at timestamp with time zone NOT NULL,
    error text,
    output text,
    CONSTRAINT run_attempts_pkey PRIMARY KEY (run_id, scheduled_at, attempt)
) PARTITION BY RANGE (scheduled_at);
CREATE INDEX run_attempts_failed ON ONLY public.run_attempts USING btree (finished_at) WHERE (status = 'failed'::text);

CREATE TABLE public.run_attempts_default PARTITION OF public.run_attempts DEFAULT;

CREATE TABLE public.run_leases (
    run_id uuid NOT NULL,
    scheduled_at timestamp with time zone NOT NULL,
    partition_id smallint NOT NULL,
    token uuid NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    deadline_at timestamp with time zone NOT NULL,
    CONSTRAINT run_leases_pkey PRIMARY KEY (run_id)
) WITH (fillfactor=50, autovacuum_vacuum_scale_factor=0.01, autovacuum_vacuum_cost_delay=0);

CREATE TABLE public.run_queue (
    queue_id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    tier smallint NOT NULL,
    run_id uuid NOT NULL,
    scheduled_at timestamp with time zone NOT NULL,
    job_id uuid NOT NULL,
    enqueued_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT run_queue_pkey PRIMARY KEY (tier, queue_id)
) WITH (fillfactor=70, autovacuum_vacuum_scale_factor=0.01, autovacuum_vacuum_cost_delay=0);

CREATE TABLE public.runs (
    run_id uuid NOT NULL,
    scheduled_at timestamp with time zone NOT NULL,
    job_id uuid NOT NULL,
    owner text NOT NULL,
    partition_id smallint NOT NULL,
    job_version integer NOT NULL,
    trigger text NOT NULL,
    priority smallint NOT NULL,
    status text DEFAULT 'scheduled'::text NOT NULL,
    attempt integer DEFAULT 1 NOT NULL,
    fired_at timestamp with time zone,
    worker_id text,
    lease_token uuid,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    error text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    reason text,
    lease_losses integer DEFAULT 0 NOT NULL,
    output text,
    CONSTRAINT runs_pkey PRIMARY KEY (run_id, scheduled_at),
    CONSTRAINT runs_status CHECK ((status = ANY (ARRAY['scheduled'::text, 'running'::text, 'succeeded'::text, 'failed'::text, 'skipped'::text, 'cancelled'::text]))),
    CONSTRAINT runs_trigger CHECK ((trigger = ANY (ARRAY['schedule'::text, 'manual'::text, 'rerun'::text, 'catchup'::text])))
) PARTITION BY RANGE (scheduled_at);
CREATE INDEX runs_job_history ON ONLY public.runs USING btree (job_id, scheduled_at DESC);

CREATE TABLE public.runs_default PARTITION OF public.runs DEFAULT;

CREATE TABLE public.schedule_stalls (
    job_id uuid NOT NULL,
    owner text NOT NULL,
    cause text NOT NULL,
    since timestamp with time zone NOT NULL,
    detail text NOT NULL,
    fire_at timestamp with time zone,
    run_id uuid,
    detected_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT schedule_stalls_cause_check CHECK ((cause = ANY (ARRAY['overdue'::text, 'no_trigger'::text, 'held'::text]))),
    CONSTRAINT schedule_stalls_pkey PRIMARY KEY (job_id)
);

CREATE TABLE public.scheduler_nodes (
    node_id text NOT NULL,
    hostname text NOT NULL,
    pid integer NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    release text,
    CONSTRAINT scheduler_nodes_pkey PRIMARY KEY (node_id)
);

CREATE TABLE public.schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT schema_migrations_pkey PRIMARY KEY (version)
);

CREATE TABLE public.secret_key (
    singleton boolean DEFAULT true NOT NULL,
    key_id text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT secret_key_pkey PRIMARY KEY (singleton),
    CONSTRAINT secret_key_singleton_check CHECK (singleton)
);

CREATE TABLE public.settings (
    key text NOT NULL,
    value jsonb NOT NULL,
    CONSTRAINT settings_pkey PRIMARY KEY (key)
);

CREATE TABLE public.shard_map (
    singleton boolean DEFAULT true NOT NULL,
    version bigint DEFAULT 0 NOT NULL,
    CONSTRAINT shard_map_one_row CHECK (singleton),
    CONSTRAINT shard_map_pkey PRIMARY KEY (singleton),
    CONSTRAINT shard_map_version CHECK ((version >= 0))
);

CREATE TABLE public.shard_move_copies (
    move_id bigint NOT NULL,
    table_name text NOT NULL,
    partition_id smallint NOT NULL,
    fingerprint text NOT NULL,
    row_count bigint NOT NULL,
    CONSTRAINT shard_move_copies_pkey PRIMARY KEY (move_id, table_name, partition_id)
);

CREATE TABLE public.shard_moves (
    move_id bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    first_partition smallint NOT NULL,
    last_partition smallint NOT NULL,
    source_shard integer,
    target_shard integer,
    phase text DEFAULT 'copying'::text NOT NULL,
    passes integer DEFAULT 0 NOT NULL,
    rows_copied bigint DEFAULT 0 NOT NULL,
    rows_per_sec double precision,
    rows_left bigint,
    note text,
    mover text,
    heartbeat_at timestamp with time zone,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    fenced_at timestamp with time zone,
    cut_over_at timestamp with time zone,
    cut_over_version bigint,
    finished_at timestamp with time zone,
    CONSTRAINT shard_moves_phase CHECK ((phase = ANY (ARRAY['copying'::text, 'fenced'::text, 'cut_over'::text, 'done'::text, 'cancelled'::text]))),
    CONSTRAINT shard_moves_pkey PRIMARY KEY (move_id),
    CONSTRAINT shard_moves_range CHECK (((0 <= first_partition) AND (first_partition <= last_partition) AND (last_partition <= 1023))),
    CONSTRAINT shard_moves_two_homes CHECK ((source_shard IS DISTINCT FROM target_shard))
);
CREATE UNIQUE INDEX shard_moves_one_at_a_time ON public.shard_moves USING btree ((true)) WHERE (phase = ANY (ARRAY['copying'::text, 'fenced'::text, 'cut_over'::text]));

CREATE TABLE public.shard_ranges (
    first_partition smallint NOT NULL,
    last_partition smallint NOT NULL,
    shard_id integer NOT NULL,
    since_version bigint NOT NULL,
    CONSTRAINT shard_ranges_disjoint EXCLUDE USING gist (int4range((first_partition)::integer, (last_partition)::integer, '[]'::text) WITH &&),
    CONSTRAINT shard_ranges_first CHECK (((first_partition >= 0) AND (first_partition <= 1023))),
    CONSTRAINT shard_ranges_last CHECK (((last_partition >= first_partition) AND (last_partition <= 1023))),
    CONSTRAINT shard_ranges_pkey PRIMARY KEY (first_partition)
);

CREATE TABLE public.shards (
    shard_id integer GENERATED ALWAYS AS IDENTITY NOT NULL,
    url text NOT NULL,
    added_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT shards_pkey PRIMARY KEY (shard_id),
    CONSTRAINT shards_url CHECK ((url <> ''::text)),
    CONSTRAINT shards_url_key UNIQUE (url)
);

CREATE TABLE public.triggers (
    partition_id smallint NOT NULL,
    fire_at timestamp with time zone NOT NULL,
    trigger_id uuid NOT NULL,
    job_id uuid NOT NULL,
    job_version integer NOT NULL,
    kind smallint NOT NULL,
    CONSTRAINT triggers_pkey PRIMARY KEY (partition_id, fire_at, trigger_id)
) WITH (fillfactor=85, autovacuum_vacuum_scale_factor=0, autovacuum_vacuum_threshold=10000, autovacuum_vacuum_insert_scale_factor=0, autovacuum_vacuum_insert_threshold=10000);
CREATE INDEX triggers_job_kind ON public.triggers USING btree (job_id, kind);

CREATE TABLE public.workers (
    worker_id text NOT NULL,
    hostname text NOT NULL,
    pid integer NOT NULL,
    concurrency integer NOT NULL,
    in_flight integer DEFAULT 0 NOT NULL,
    started_at timestamp with time zone DEFAULT now() NOT NULL,
    heartbeat_at timestamp with time zone DEFAULT now() NOT NULL,
    release text,
    CONSTRAINT workers_pkey PRIMARY KEY (worker_id)
);

CREATE VIEW public.leases_in_force AS
 SELECT l.run_id,
    l.scheduled_at,
    l.token,
    l.expires_at,
    l.deadline_at
   FROM run_leases l
UNION ALL
 SELECT u.run_id,
    u.scheduled_at,
    c.token,
    c.expires_at,
    u.deadline_at
   FROM (claim_leases c
     CROSS JOIN LATERAL UNNEST(c.run_ids, c.scheduled_ats, c.deadlines) u(run_id, scheduled_at, deadline_at))
  WHERE (NOT (EXISTS ( SELECT 1
           FROM run_leases own
          WHERE ((own.run_id = u.run_id) AND (own.token = c.token)))));

CREATE VIEW public.run_attempt_history AS
 SELECT a.run_id,
    a.scheduled_at,
    a.attempt,
    a.worker_id,
    a.status,
    a.started_at,
    a.finished_at,
    a.error,
    a.output
   FROM run_attempts a
UNION ALL
 SELECT r.run_id,
    r.scheduled_at,
    r.attempt,
    r.worker_id,
    r.status,
    r.started_at,
    r.finished_at,
    r.error,
    r.output
   FROM runs r
  WHERE ((r.status = 'succeeded'::text) AND (NOT (EXISTS ( SELECT 1
           FROM run_attempts a
          WHERE ((a.run_id = r.run_id) AND (a.scheduled_at = r.scheduled_at) AND (a.attempt = r.attempt))))));

CREATE OR REPLACE FUNCTION public.chimes_calendar_changed()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    NEW.change := nextval('calendar_versions');
    RETURN NEW;
END;
$function$;

CREATE OR REPLACE FUNCTION public.chimes_delete_completed(run_ids uuid[], scheduled_ats timestamp with time zone[])
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION public.chimes_drop_run_partitions(cutoff date)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION public.chimes_ensure_run_partitions(start date, days integer)
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION public.chimes_forget_ended_runs()
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION public.chimes_notify_failed(run_ids uuid[], scheduled_ats timestamp with time zone[])
 RETURNS integer
 LANGUAGE sql
AS $function$
    SELECT chimes_notify_runs('run_failed', array_agg(r.run_id), array_agg(r.scheduled_at),
                              array_agg(NULL::text))
    FROM unnest(run_ids, scheduled_ats) AS e(run_id, scheduled_at)
    JOIN runs r ON r.run_id = e.run_id AND r.scheduled_at = e.scheduled_at AND r.status = 'failed'
    LEFT JOIN jobs j ON j.job_id = r.job_id
    WHERE j.job_id IS NULL OR 'failed' = ANY (j.notify_on)
$function$;

CREATE OR REPLACE FUNCTION public.chimes_notify_jobs(kind text, job_ids uuid[], keys text[], details text[], slots timestamp with time zone[], run_ids uuid[])
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION public.chimes_notify_runs(kind text, run_ids uuid[], scheduled_ats timestamp with time zone[], details text[])
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION public.chimes_notify_succeeded(run_ids uuid[], scheduled_ats timestamp with time zone[])
 RETURNS integer
 LANGUAGE sql
AS $function$
    SELECT chimes_notify_runs('run_succeeded', array_agg(r.run_id), array_agg(r.scheduled_at),
                              array_agg(NULL::text))
    FROM unnest(run_ids, scheduled_ats) AS e(run_id, scheduled_at)
    JOIN runs r ON r.run_id = e.run_id AND r.scheduled_at = e.scheduled_at AND r.status = 'succeeded'
    JOIN jobs j ON j.job_id = r.job_id AND 'succeeded' = ANY (j.notify_on)
$function$;

CREATE OR REPLACE FUNCTION public.chimes_partition_of(job_id uuid)
 RETURNS integer
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE STRICT
RETURN ((crc32(uuid_send(job_id)) % (1024)::bigint))::integer;

CREATE OR REPLACE FUNCTION public.chimes_pause_failing(run_ids uuid[], scheduled_ats timestamp with time zone[])
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION public.chimes_plan_version()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION public.chimes_refuse_jobs_moved()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
BEGIN
    IF current_setting('chimes.moving', true) IS DISTINCT FROM 'on' THEN
        PERFORM chimes_refuse_moved(NEW.job_id);
    END IF;
    RETURN NEW;
END
$function$;

CREATE OR REPLACE FUNCTION public.chimes_refuse_jobs_of_shards()
 RETURNS trigger
 LANGUAGE plpgsql
AS $function$
DECLARE
    partition integer;
BEGIN
    IF current_setting('chimes.moving', true) = 'on' THEN
        RETURN NEW;
    END IF;
    partition := chimes_partition_of(NEW.job_id);
    IF EXISTS (SELECT 1 FROM shard_ranges WHERE partition BETWEEN first_partition AND last_partition) THEN
        RAISE EXCEPTION 'partition % of job % is held by a shard: reload the shard map', partition, NEW.job_id
            USING ERRCODE = 'CH001';
    END IF;
    RETURN NEW;
END
$function$;

CREATE OR REPLACE FUNCTION public.chimes_refuse_moved(job_id uuid)
 RETURNS boolean
 LANGUAGE plpgsql
AS $function$
DECLARE
    partition integer;
BEGIN
    IF current_setting('chimes.moving', true) = 'on' THEN
        RETURN true;
    END IF;
    partition := chimes_partition_of(job_id);
    IF EXISTS (SELECT 1 FROM partition_leases WHERE partition_id = partition AND closed_by_move IS NOT NULL) THEN
        RAISE EXCEPTION 'partition % of job % is moving to another database: reload the shard map', partition, job_id
            USING ERRCODE = 'CH001';
    END IF;
    RETURN true;
END
$function$;

CREATE OR REPLACE FUNCTION public.chimes_release_held(job_ids uuid[])
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
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
$function$;

CREATE OR REPLACE FUNCTION public.chimes_runs_ended(ended_jobs uuid[], ended_runs uuid[])
 RETURNS integer
 LANGUAGE plpgsql
AS $function$
DECLARE
    released integer;
BEGIN
    DELETE FROM active_runs a
    USING unnest(ended_jobs, ended_runs) AS e(job_id, run_id)
    WHERE a.job_id = e.job_id AND a.run_id = e.run_id;
    SELECT chimes_release_held(ended_jobs) INTO released;
    RETURN released;
END
$function$;

CREATE TRIGGER calendars_change BEFORE INSERT OR UPDATE ON public.calendars FOR EACH ROW EXECUTE FUNCTION chimes_calendar_changed();
CREATE TRIGGER jobs_plan_version BEFORE UPDATE ON public.jobs FOR EACH ROW EXECUTE FUNCTION chimes_plan_version();
