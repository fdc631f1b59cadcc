-- Moving ranges of partitions between homes while the fleet runs (docs/scaling.md, "Moving
-- partitions"). An expand step: release 0.2.0 never reads or writes what this adds, and moves are
-- refused while a process of 0.2.0 or earlier is live (chimes.store.moves).

-- A home's lease row of a partition that is being moved away from it, or to it: closed by the move
-- (its id here), held by no node (owner 'move N', expiring never, so that no node acquires it, and
-- its token raised, so that any node that held it is fenced out). The source closes the range at
-- the fence, and keeps it closed after the cut-over; the target closes it while the copies arrive,
-- and opens it at the cut-over.
ALTER TABLE partition_leases ADD COLUMN closed_by_move bigint;

-- The moves, in the catalog: at most one under way. Its phase is the truth a mover that was killed
-- resumes from (chimes shards move --resume).
CREATE TABLE shard_moves (
    move_id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    first_partition  smallint NOT NULL,
    last_partition   smallint NOT NULL,
    source_shard     integer,          -- NULL: the catalog
    target_shard     integer,          -- NULL: the catalog
    phase            text NOT NULL DEFAULT 'copying',
    passes           integer NOT NULL DEFAULT 0,
    rows_copied      bigint NOT NULL DEFAULT 0,
    rows_per_sec     double precision,
    rows_left        bigint,
    note             text,             -- what it waits for, or why it was cancelled
    mover            text,
    heartbeat_at     timestamptz,
    started_at       timestamptz NOT NULL DEFAULT now(),
    fenced_at        timestamptz,
    cut_over_at      timestamptz,
    cut_over_version bigint,
    finished_at      timestamptz,
    CONSTRAINT shard_moves_phase CHECK (phase IN ('copying', 'fenced', 'cut_over', 'done', 'cancelled')),
    CONSTRAINT shard_moves_range CHECK (0 <= first_partition AND first_partition <= last_partition
                                        AND last_partition <= 1023),
    CONSTRAINT shard_moves_two_homes CHECK (source_shard IS DISTINCT FROM target_shard)
);
CREATE UNIQUE INDEX shard_moves_one_at_a_time ON shard_moves ((true)) WHERE phase IN ('copying', 'fenced', 'cut_over');

-- On the target: which state of the source each copied partition of each table holds, written in the
-- transaction that copied it. A pass compares the source's fingerprints with these and copies again
-- only what differs; a mover that was killed resumes from them.
CREATE TABLE shard_move_copies (
    move_id      bigint NOT NULL,
    table_name   text NOT NULL,
    partition_id smallint NOT NULL,
    fingerprint  text NOT NULL,
    row_count    bigint NOT NULL,
    PRIMARY KEY (move_id, table_name, partition_id)
);

-- Refuses, with SQLSTATE CH001 as the catalog's fence does, a write to a job of a partition this home
-- has closed: the router's map is older than the move. Volatile, so that its query sees the lease
-- rows as committed when it runs, not when the statement began. The mover's own copies set
-- chimes.moving (a setting of the session, open to every role) to pass.
CREATE FUNCTION chimes_refuse_moved(job_id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
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
$$;

-- The same fence on new jobs, as a trigger that the first move creates on both of its homes. The
-- mover's setting is checked first: its copies pass at the cost of one setting read a row.
CREATE FUNCTION chimes_refuse_jobs_moved() RETURNS trigger
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF current_setting('chimes.moving', true) IS DISTINCT FROM 'on' THEN
        PERFORM chimes_refuse_moved(NEW.job_id);
    END IF;
    RETURN NEW;
END
$$;

-- The catalog's fence lets the mover's copies through as well (a move to the catalog copies jobs of
-- partitions a shard still holds until the cut-over).
CREATE OR REPLACE FUNCTION chimes_refuse_jobs_of_shards() RETURNS trigger
LANGUAGE plpgsql VOLATILE AS $$
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
$$;
