-- Applying the numbered migrations of store/migrations (chimes/store/migrate.py).

-- name: lock_migrations
-- One migrator at a time across every process: the others wait here, then find nothing left to do.
SELECT pg_advisory_lock($1);

-- name: unlock_migrations
SELECT pg_advisory_unlock($1);

-- name: create_schema_migrations
CREATE TABLE IF NOT EXISTS schema_migrations (
    version integer PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: applied_migrations
SELECT version FROM schema_migrations;

-- name: record_migration
-- In the transaction of the migration itself: applied and recorded together, or neither.
INSERT INTO schema_migrations (version, name) VALUES ($1, $2);

-- name: ensure_run_partitions
-- The run-history partitions from yesterday (UTC) to $1 days on.
SELECT chimes_ensure_run_partitions((now() AT TIME ZONE 'UTC')::date - 1, $1);
