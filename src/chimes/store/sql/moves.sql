-- Moving ranges of partitions between homes (chimes.store.moves, migration 0021).

-- name: lock_mover
-- One mover at a time, held for the mover's whole life on its catalog connection (a mover killed
-- drops its connection, and the lock with it). False: another mover runs.
SELECT pg_try_advisory_lock(hashtext('chimes_shard_mover'));

-- Every statement that returns a move returns read_at, the catalog's clock as it read the row: how old
-- the mover's heartbeat is, and how long the range has been fenced, are told by one clock, the one
-- that wrote them.

-- name: move_under_way
SELECT *, now() AS read_at FROM shard_moves WHERE phase IN ('copying', 'fenced', 'cut_over');

-- name: recent_moves
-- The move under way, if any, then the last ones that ended, newest first.
SELECT *, now() AS read_at FROM shard_moves
ORDER BY phase IN ('copying', 'fenced', 'cut_over') DESC, move_id DESC LIMIT $1;

-- name: a_move
SELECT *, now() AS read_at FROM shard_moves WHERE move_id = $1;

-- name: move_heartbeat
-- The mover is alive: written on a connection of its own every few seconds, whatever its phase's
-- work is doing meanwhile (a long copy, the wait for the range's runs in flight).
UPDATE shard_moves SET heartbeat_at = now(), mover = $2
WHERE move_id = $1 AND phase IN ('copying', 'fenced', 'cut_over');

-- name: begin_move
INSERT INTO shard_moves (first_partition, last_partition, source_shard, target_shard, mover, heartbeat_at)
VALUES ($1, $2, $3, $4, $5, now())
RETURNING *, now() AS read_at;

-- name: move_progress
UPDATE shard_moves
SET passes = $2, rows_copied = $3, rows_per_sec = $4, rows_left = $5, note = $6, mover = $7, heartbeat_at = now()
WHERE move_id = $1
RETURNING *, now() AS read_at;

-- name: move_fenced
UPDATE shard_moves SET phase = 'fenced', fenced_at = now(), note = $2, heartbeat_at = now()
WHERE move_id = $1 AND phase IN ('copying', 'fenced')
RETURNING *, now() AS read_at;

-- name: move_cut_over
UPDATE shard_moves SET phase = 'cut_over', cut_over_at = now(), cut_over_version = $2, note = NULL,
                       heartbeat_at = now()
WHERE move_id = $1 AND phase = 'fenced'
RETURNING *, now() AS read_at;

-- name: move_ended
-- $2: 'done' or 'cancelled'; $3 the note (why it was cancelled).
UPDATE shard_moves SET phase = $2, note = $3, finished_at = now(), heartbeat_at = now()
WHERE move_id = $1 AND phase IN ('copying', 'fenced', 'cut_over')
RETURNING *, now() AS read_at;

-- name: shard_url
SELECT url FROM shards WHERE shard_id = $1;

-- name: shard_by_url
SELECT shard_id FROM shards WHERE url = $1;

-- name: register_shard
INSERT INTO shards (url) VALUES ($1) ON CONFLICT (url) DO UPDATE SET url = EXCLUDED.url RETURNING shard_id;

-- name: forget_shard_without_ranges
-- A cancelled move's target that holds no range of the map: registered by the move (--to URL), it is
-- no shard of the map, and nothing routes to it. One that holds a range is kept.
DELETE FROM shards s WHERE s.shard_id = $1 AND NOT EXISTS (SELECT 1 FROM shard_ranges r WHERE r.shard_id = s.shard_id)
RETURNING s.url;

-- name: close_partitions
-- A home's lease rows of the range, closed by move $3: no node holds them from this commit on. The
-- rows are locked first (FOR UPDATE waits for every fire and reap that holds them FOR KEY SHARE), so
-- a batch that checked its lease before this commit has committed when it returns; every later one
-- finds the lease gone.
WITH locked AS (
    SELECT partition_id FROM partition_leases WHERE partition_id BETWEEN $1 AND $2 ORDER BY partition_id FOR UPDATE
)
UPDATE partition_leases l
SET owner = 'move ' || $3::bigint, token = l.token + 1, expires_at = 'infinity', closed_by_move = $3
FROM locked WHERE l.partition_id = locked.partition_id;

-- name: open_partitions
-- The range's lease rows, open to this home's nodes again (the cut-over's target; a cancelled move's
-- source). The token is raised: a token is never issued twice.
UPDATE partition_leases l
SET owner = NULL, token = l.token + 1, expires_at = '-infinity', closed_by_move = NULL
WHERE l.partition_id BETWEEN $1 AND $2 AND l.closed_by_move IS NOT NULL;

-- name: create_moved_fence
-- Migration 0021: this home refuses new jobs of partitions it has closed (SQLSTATE CH001).
CREATE OR REPLACE TRIGGER jobs_stay_off_moved BEFORE INSERT ON jobs
    FOR EACH ROW EXECUTE FUNCTION chimes_refuse_jobs_moved();

-- name: older_transactions
-- Transactions of other sessions that began before $1 (the fence's commit) and are still open: what
-- they write may have passed the fence's checks before it committed.
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
  AND xact_start < $1;

-- name: database_now
SELECT clock_timestamp();

-- name: range_in_flight
-- What still runs, or waits to, on the source of a fenced range: runs in flight under a live lease,
-- and queue entries (the source's workers still claim those).
SELECT (SELECT count(*) FROM leases_in_force l
        JOIN runs r ON r.run_id = l.run_id AND r.scheduled_at = l.scheduled_at
        WHERE r.partition_id BETWEEN $1 AND $2 AND r.status = 'running' AND r.lease_token = l.token
          AND l.expires_at > now() AND l.deadline_at > now()) AS running,
       (SELECT count(*) FROM run_queue q WHERE chimes_partition_of(q.job_id) BETWEEN $1 AND $2) AS queued;

-- name: hand_over_lost_runs
-- Every run of the range still 'running' on the source once it is at rest (its lease expired: its
-- worker is gone, or frozen) is handed over: a new lease token, and a lease row of its own under it,
-- expired, so that the target's reaper ends the attempt after the cut-over, as the source's would
-- have. The old token is void from this commit on: should the worker wake, its outcome, renewal,
-- give-up or release is refused here as for any lease it lost (an outcome accepted here now would be
-- deleted with the source's copies: acknowledged, then lost). A run left without any lease row at
-- all is handed over the same way. The UPDATE re-checks each run, so an outcome that commits first wins.
WITH running AS (
    SELECT r.run_id, r.scheduled_at, r.lease_token, l.deadline_at
    FROM runs r
    LEFT JOIN leases_in_force l ON l.run_id = r.run_id AND l.scheduled_at = r.scheduled_at AND l.token = r.lease_token
    WHERE r.partition_id BETWEEN $1 AND $2 AND r.status = 'running'
),
handed AS (
    UPDATE runs r SET lease_token = gen_random_uuid()
    FROM running o
    WHERE r.run_id = o.run_id AND r.scheduled_at = o.scheduled_at AND r.status = 'running'
      AND r.lease_token IS NOT DISTINCT FROM o.lease_token
    RETURNING r.run_id, r.scheduled_at, r.partition_id, r.lease_token, o.deadline_at
)
INSERT INTO run_leases (run_id, scheduled_at, partition_id, token, expires_at, deadline_at)
SELECT run_id, scheduled_at, partition_id, lease_token, now(), coalesce(deadline_at, 'infinity') FROM handed
ON CONFLICT (run_id) DO UPDATE
SET token = EXCLUDED.token, expires_at = EXCLUDED.expires_at, deadline_at = EXCLUDED.deadline_at;

-- name: lease_arrived_runs
-- The target, once it has opened the range: a run of it that arrived 'running' with no lease in force
-- under its token (none should: the source hands every one over) gets a row of its own, expired, for
-- the reaper. Its worker is on the source, so no one here renews it; without a row no reaper would
-- ever end it. Runs this home's workers claimed since the range opened hold their claim's lease and
-- are left alone (each claim, reap and outcome commits whole: one snapshot sees none half-done).
INSERT INTO run_leases (run_id, scheduled_at, partition_id, token, expires_at, deadline_at)
SELECT r.run_id, r.scheduled_at, r.partition_id, r.lease_token, now(), 'infinity'
FROM runs r
WHERE r.partition_id BETWEEN $1 AND $2 AND r.status = 'running' AND r.lease_token IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM leases_in_force l WHERE l.run_id = r.run_id AND l.token = r.lease_token)
ON CONFLICT (run_id) DO UPDATE
SET token = EXCLUDED.token, expires_at = EXCLUDED.expires_at, deadline_at = EXCLUDED.deadline_at
RETURNING run_id;

-- name: queue_arrived_runs
-- Then a run of the range that arrived 'scheduled' waits for one of three things: a place in the
-- queue (the source's queue of the range was empty at the drain, and queues are not copied), its
-- retry trigger, or the end of its job's active run (held). One with none of them (a run the source
-- queued after the drain; none should) is queued here, where the workers claim it.
INSERT INTO run_queue (tier, run_id, scheduled_at, job_id)
SELECT r.priority, r.run_id, r.scheduled_at, r.job_id
FROM runs r
WHERE r.partition_id BETWEEN $1 AND $2 AND r.status = 'scheduled'
  AND NOT EXISTS (SELECT 1 FROM run_queue q WHERE q.run_id = r.run_id)
  AND NOT EXISTS (SELECT 1 FROM triggers t WHERE t.trigger_id = r.run_id AND t.kind = 1)
  AND NOT EXISTS (SELECT 1 FROM active_runs a WHERE a.run_id = r.run_id AND a.held)
ON CONFLICT DO NOTHING
RETURNING run_id;

-- name: run_days
-- The day partitions of run history, oldest first, so that the target has the same before the copy.
SELECT min(to_date(right(c.relname, 8), 'YYYYMMDD')) AS first_day, max(to_date(right(c.relname, 8), 'YYYYMMDD')) AS last_day
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
WHERE p.relname = 'runs' AND c.relname ~ '_[0-9]{8}$';

-- name: ensure_run_days
SELECT chimes_ensure_run_partitions($1::date, $2::integer);

-- name: copied_fingerprints
SELECT partition_id, fingerprint FROM shard_move_copies WHERE move_id = $1 AND table_name = $2;

-- name: record_copies
INSERT INTO shard_move_copies (move_id, table_name, partition_id, fingerprint, row_count)
SELECT $1, $2, c.partition_id, c.fingerprint, c.row_count
FROM unnest($3::smallint[], $4::text[], $5::bigint[]) AS c(partition_id, fingerprint, row_count)
ON CONFLICT (move_id, table_name, partition_id)
DO UPDATE SET fingerprint = EXCLUDED.fingerprint, row_count = EXCLUDED.row_count;

-- name: forget_copies
DELETE FROM shard_move_copies WHERE move_id = $1 AND table_name = $2 AND partition_id = ANY($3::smallint[]);

-- name: forget_move_copies
DELETE FROM shard_move_copies WHERE move_id = $1;

-- name: any_copies
SELECT EXISTS (SELECT 1 FROM shard_move_copies WHERE move_id = $1);

-- name: delete_shard_range
DELETE FROM shard_ranges WHERE first_partition = $1;

-- name: partition_job_counts
-- Jobs per partition of this home: what `chimes shards rebalance` evens out.
SELECT chimes_partition_of(job_id) AS partition_id, count(*) AS jobs FROM jobs GROUP BY 1;

-- name: partition_due_counts
-- Triggers due within $1 seconds per partition of this home (the runs it will fire soon).
SELECT partition_id, count(*) AS due FROM triggers WHERE fire_at < now() + make_interval(secs => $1) GROUP BY 1;
