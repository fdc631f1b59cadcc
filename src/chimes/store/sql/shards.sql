-- The shard map in the catalog (chimes.store.shards, migration 0008).

-- name: shard_map_head
SELECT version FROM shard_map;

-- name: shard_map_version
-- What a process compares with the version it holds, to reload the map only when it changed.
SELECT version FROM shard_map;

-- name: lock_shard_map
-- Every change of the map holds this row's lock until it commits: changes run one after the other,
-- and each one is one version.
SELECT version FROM shard_map FOR UPDATE;

-- name: shard_map_ranges
SELECT r.first_partition, r.last_partition, r.shard_id, s.url, r.since_version
FROM shard_ranges r JOIN shards s USING (shard_id)
ORDER BY r.first_partition;

-- name: shards_without_ranges
-- Databases registered as shards that hold no range of the map (a move's target before its cut-over).
SELECT s.shard_id, s.url FROM shards s
WHERE NOT EXISTS (SELECT 1 FROM shard_ranges r WHERE r.shard_id = s.shard_id) ORDER BY s.shard_id;

-- name: add_shard
-- A URL already in the map is the same shard: it gets another range.
INSERT INTO shards (url) VALUES ($1)
ON CONFLICT (url) DO UPDATE SET url = EXCLUDED.url
RETURNING shard_id;

-- name: add_shard_range
INSERT INTO shard_ranges (first_partition, last_partition, shard_id, since_version) VALUES ($1, $2, $3, $4);

-- name: raise_shard_map_version
UPDATE shard_map SET version = version + 1 RETURNING version;

-- name: shard_probe
-- What a database offered as a new shard is, read before anything is written to it. is_catalog: the
-- catalog's connection holds advisory lock $1 (a random key, for this check alone) in this very
-- database; advisory locks are per database, and a copy of the catalog (a restored backup, a
-- template) does not see them. has_jobs: the table may not be there (a new database).
SELECT EXISTS (SELECT 1 FROM pg_locks
               WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
                 AND ((classid::bigint << 32) | objid::bigint) = $1) AS is_catalog,
       to_regclass('public.jobs') IS NOT NULL AS has_jobs;

-- name: hold_probe_lock
SELECT pg_advisory_lock($1);

-- name: release_probe_lock
SELECT pg_advisory_unlock($1);


-- name: any_job
SELECT EXISTS (SELECT 1 FROM jobs);

-- name: all_job_ids
-- Read through a cursor: the partition of a job is crc32 of its id, which PostgreSQL before 18
-- cannot compute, so `shards add` reads and hashes every job id of the catalog.
SELECT job_id FROM jobs;

-- name: partitions_with_triggers
-- The trigger index leads with the partition: one range read.
SELECT DISTINCT partition_id FROM triggers WHERE partition_id BETWEEN $1 AND $2 ORDER BY partition_id;

-- name: snapshot_horizon
-- Every transaction this snapshot does not see has this id or a later one (as a 64-bit xid).
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint;

-- name: lock_catalog_jobs
-- While the map changes, no job is created, changed or deleted in the catalog: the creates that were
-- in flight have committed (and are read below), and those after it meet the fence.
LOCK TABLE jobs IN SHARE ROW EXCLUSIVE MODE;

-- name: create_catalog_fence
-- Migration 0010: the catalog refuses new jobs in partitions a shard holds (SQLSTATE CH001).
CREATE OR REPLACE TRIGGER jobs_stay_off_shards BEFORE INSERT ON jobs
    FOR EACH ROW EXECUTE FUNCTION chimes_refuse_jobs_of_shards();

-- name: jobs_written_since
-- The jobs written by a transaction at or after the horizon $1 (from snapshot_horizon): those a scan
-- with that snapshot may have missed. One pass over the table, with no index: a rare, admin's read.
SELECT job_id FROM jobs WHERE age(xmin) <= age(($1::bigint % 4294967296)::text::xid);

-- name: all_settings
SELECT key, value FROM settings ORDER BY key;
