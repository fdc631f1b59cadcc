-- Who changed what: one row per state-changing call (docs/security.md, "Audit trail"), written in the
-- same transaction as the change it describes, on the database that holds the change: a job's
-- changes (and its runs') on the job's home, tokens, caps and owner settings on the catalog. So no
-- change commits without its entry, and no entry without its change.
--
-- * `actor_*`: the token that made the call (its id, name and owner); a change made with the
--   command line on the database (`chimes token create`, `chimes cap set`, ...) has no token and
--   names the operating-system user as `actor_name`.
-- * `subject_owner`: whose thing changed; an owner's token reads the entries whose subject is its own.
-- * `changes`: the fields that changed, `{"field": {"before": ..., "after": ...}}`; secrets stay
--   sealed or redacted, never in clear.
-- * Kept as long as run history (the retention sweep deletes entries older than it).
CREATE TABLE audit_log (
    entry_id      uuid PRIMARY KEY,
    at            timestamptz NOT NULL,
    actor_token   uuid,
    actor_name    text,
    actor_owner   text NOT NULL,
    request_id    text,
    action        text NOT NULL,
    subject       text NOT NULL,
    job_id        uuid,
    subject_owner text,
    changes       jsonb NOT NULL
);
-- The listing, newest first, and its cursor (at, entry_id).
CREATE INDEX audit_log_at ON audit_log (at DESC, entry_id DESC);
-- A job's page shows its own entries.
CREATE INDEX audit_log_job ON audit_log (job_id, at DESC) WHERE job_id IS NOT NULL;
