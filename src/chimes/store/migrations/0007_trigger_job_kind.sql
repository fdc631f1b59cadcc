-- The trigger index by job, with the trigger's kind in the key: "has this job a schedule trigger?"
-- (the health check's sweep for schedules without one, 20,000 jobs every 10 s; deleting a job's
-- schedule trigger; a job's next run) is answered from the index alone, without reading the table.
-- Reading the table there cost one random page of `triggers` per job swept: past a million
-- schedules that read pushed the pages the fires need out of the server's cache.
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
