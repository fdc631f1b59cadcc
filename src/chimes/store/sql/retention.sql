-- Retention: run history by whole daily partitions, and the notification outbox by age.

-- name: old_run_partitions
-- The daily partitions of runs and run_attempts that end before $1, by day, oldest first.
SELECT to_date(right(c.relname, 8), 'YYYYMMDD') AS day, array_agg(c.relname::text ORDER BY c.relname) AS tables
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
JOIN pg_class p ON p.oid = i.inhparent
WHERE p.relname IN ('runs', 'run_attempts')
  AND c.relname ~ '_[0-9]{8}$'
  AND to_date(right(c.relname, 8), 'YYYYMMDD') < $1::date
GROUP BY 1
ORDER BY 1;

-- name: limit_lock_wait
-- Dropping a partition takes an ACCESS EXCLUSIVE lock on its parent: while it waits for a long
-- reader, every new reader of runs queues behind it. Waiting at most this long keeps the API
-- answering; the drop is tried again at the next round.
SELECT set_config('lock_timeout', $1, true);

-- name: lock_run_partitions
SELECT pg_advisory_xact_lock(hashtext('chimes_run_partitions'));

-- name: delete_old_default_runs
-- The (rare) rows of days that had no partition: row by row, but only the default partitions.
WITH runs_gone AS (DELETE FROM runs_default WHERE scheduled_at < $1 RETURNING 1),
     attempts_gone AS (DELETE FROM run_attempts_default WHERE scheduled_at < $1 RETURNING 1)
SELECT (SELECT count(*) FROM runs_gone) + (SELECT count(*) FROM attempts_gone);

-- name: delete_old_notifications
-- Delivered and dead-lettered notifications queued before $1, at most $2 at a time (oldest first,
-- from notifications_created), so one round never holds a long transaction: picked once, in a
-- materialised step, and deleted by their keys as one array, so that the subquery is not run again
-- for each row of the table (working.sql, claim_runs).
WITH outdated AS MATERIALIZED (
    SELECT notification_id FROM notifications
    WHERE created_at < $1 AND (sent_at IS NOT NULL OR dead_at IS NOT NULL)
    ORDER BY created_at
    LIMIT $2
)
DELETE FROM notifications WHERE notification_id = ANY (ARRAY(SELECT notification_id FROM outdated));

-- name: drop_tables
-- {tables}: the partitions of one day from old_run_partitions, each quoted as an identifier
-- (chimes.store.retention): a statement cannot take table names as parameters.
DROP TABLE {tables};
