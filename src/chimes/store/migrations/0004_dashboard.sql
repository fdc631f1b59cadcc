-- Indexes for the dashboard (store/sql/dashboard.sql), so that no page reads all jobs or all runs:
-- jobs in name order from a name prefix, for one owner and for admins; paused jobs (few, so a
-- small partial index); and recent failures, for the "failing" filter and failures per minute.
-- Names are compared lower-cased in the "C" collation: byte order, so a prefix is a plain range.
CREATE INDEX jobs_owner_name ON jobs (owner, (lower(name)) COLLATE "C", job_id);
CREATE INDEX jobs_name ON jobs ((lower(name)) COLLATE "C", job_id);
CREATE INDEX jobs_paused_name ON jobs ((lower(name)) COLLATE "C", job_id) WHERE paused;
CREATE INDEX runs_failed ON runs (finished_at) INCLUDE (job_id, owner) WHERE status = 'failed';
