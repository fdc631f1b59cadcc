-- The audit trail (migration 0017): written by chimes.store.audit.record in the caller's transaction.

-- name: insert_audit_entry
-- The subject's owner, when the caller (an admin) does not know it, is the job's.
INSERT INTO audit_log (entry_id, at, actor_token, actor_name, actor_owner, request_id, action, subject, job_id,
                       subject_owner, changes)
VALUES ($entry_id, $at, $actor_token, $actor_name, $actor_owner, $request_id, $action, $subject, $job_id,
        coalesce($subject_owner::text, (SELECT owner FROM jobs WHERE job_id = $job_id::uuid)), $changes);

-- name: list_audit_entries
-- Newest first, after the cursor ($1, $2: the last entry's time and id), each filter ignored when NULL:
-- $3 the subject's owner (an owner's token: only the entries of its own jobs and calendars, what it changes
-- itself; operators' changes of its caps and settings stay the admins'), $4 the actor's owner or token name, $5 a job,
-- $6 an action, $7 and $8 the time range [since, until).
SELECT entry_id, at, actor_token, actor_name, actor_owner, request_id, action, subject, job_id, subject_owner,
       changes
FROM audit_log
WHERE ($1::timestamptz IS NULL OR (at, entry_id) < ($1, $2::uuid))
  AND ($3::text IS NULL OR (subject_owner = $3 AND (job_id IS NOT NULL OR action LIKE 'calendar.%')))
  AND ($4::text IS NULL OR actor_owner = $4 OR actor_name = $4)
  AND ($5::uuid IS NULL OR job_id = $5)
  AND ($6::text IS NULL OR action = $6)
  AND ($7::timestamptz IS NULL OR at >= $7)
  AND ($8::timestamptz IS NULL OR at < $8)
ORDER BY at DESC, entry_id DESC
LIMIT $9;

-- name: delete_old_audit_entries
-- Entries older than the run history kept ($1), at most $2 at a time, oldest first (audit_log_at), so
-- one round never holds a long transaction: picked once, in a materialised step, and deleted by their
-- keys as one array, so that the subquery is not run again for each row of the table (working.sql,
-- claim_runs).
WITH outdated AS MATERIALIZED (
    SELECT entry_id FROM audit_log WHERE at < $1 ORDER BY at, entry_id LIMIT $2
)
DELETE FROM audit_log WHERE entry_id = ANY (ARRAY(SELECT entry_id FROM outdated));
