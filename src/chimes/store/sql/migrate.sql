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

-- name: migrations_layout
-- Where the applied migrations are recorded: `schema_migrations` (a table) until the first contract
-- step, `chimes_migrations` from then on (chimes/store/migrate.py).
SELECT CASE WHEN to_regclass('chimes_migrations') IS NOT NULL THEN 'contracted'
            WHEN to_regclass('schema_migrations') IS NOT NULL THEN 'before_contract'
            ELSE 'new' END;

-- name: applied_steps
SELECT version, name, contract_release FROM chimes_migrations;

-- name: applied_steps_before_contract
SELECT version, name, NULL::text AS contract_release FROM schema_migrations;

-- name: record_step
INSERT INTO chimes_migrations (version, name, contract_release) VALUES ($1, $2, $3);

-- name: contract_layout
-- Run with the first contract step, in its transaction. Release 0.1.0 knows nothing of contract
-- steps: at start-up it runs `CREATE TABLE IF NOT EXISTS schema_migrations` (skipped: a relation of
-- that name exists) and then reads `SELECT version FROM schema_migrations`. That read now raises,
-- naming the release to run, before that process has changed anything.
ALTER TABLE schema_migrations RENAME TO chimes_migrations;
ALTER TABLE chimes_migrations RENAME CONSTRAINT schema_migrations_pkey TO chimes_migrations_pkey;
ALTER TABLE chimes_migrations ADD COLUMN contract_release text;
CREATE FUNCTION chimes_refuse_old_release() RETURNS TABLE (version integer, name text, applied_at timestamptz)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    needed text;
BEGIN
    SELECT m.contract_release INTO needed FROM chimes_migrations m WHERE m.contract_release IS NOT NULL
    ORDER BY string_to_array(m.contract_release, '.')::int[] DESC LIMIT 1;
    RAISE EXCEPTION 'this database''s schema needs chimes % or later (a contract migration was applied): run chimes % or later', needed, needed
        USING HINT = 'docs/operations.md, "Upgrades"';
END
$$;
CREATE VIEW schema_migrations AS SELECT * FROM chimes_refuse_old_release();
