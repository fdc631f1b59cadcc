-- concurrency "replace": a new slot cancels the job's active runs and starts its own
-- (docs/semantics.md, "Concurrency"). Adding the CHECK reads every job once under the ACCESS
-- EXCLUSIVE lock the DROP takes: fires and edits of jobs wait that long (a second or two at a
-- million jobs), and nothing is lost.
ALTER TABLE jobs DROP CONSTRAINT jobs_concurrency;
ALTER TABLE jobs ADD CONSTRAINT jobs_concurrency CHECK (concurrency IN ('skip', 'queue', 'allow', 'replace'));
