-- The trigger index by job, with the trigger's kind in the key, so "has this job a schedule
-- trigger?" is answered from the index alone: the health check's sweep for schedules without one
-- does not read the table. Without it the sweep reads all of `triggers` and scattered pages of
-- `jobs`, mostly from outside the server's cache, and pushes out of the cache the pages the fires
-- are using. Deleting a job's schedule trigger and a job's next run find their row through it as before.
--
-- Locks: CREATE INDEX holds a SHARE lock on `triggers` while it builds, so fires, job edits and
-- retries wait (nothing is lost: they run once it commits, late). It reads the whole table: a few
-- seconds at a million triggers, roughly 10-30 s at 10 million (docs/operations.md). To avoid the
-- wait on a live fleet, build it beforehand without blocking writes:
--     CREATE INDEX CONCURRENTLY triggers_job_kind ON triggers (job_id, kind);
-- then this migration finds it (IF NOT EXISTS) and only drops the old index, which takes an
-- ACCESS EXCLUSIVE lock for an instant.
CREATE INDEX IF NOT EXISTS triggers_job_kind ON triggers (job_id, kind);
DROP INDEX IF EXISTS triggers_job;

-- Vacuum the trigger table after every 10,000 fires, not after a fifth of it (200,000 rows at a
-- million schedules, 2 million at ten): a vacuum marks the pages of the next fires all-visible, and
-- the due scan's second-by-second re-read of the keys it already holds (scan_due_keys) and the sweep
-- above are index-only only on such pages; on the others each key costs a visit to the table (at
-- 50,000 held keys: about 87,000 buffers a scan instead of 3,300). A vacuum reads only the pages
-- changed since the last one, and skips the indexes while few entries are dead. These settings take
-- a SHARE UPDATE EXCLUSIVE lock, which fires do not wait for.
ALTER TABLE triggers SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
                          autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 10000);
