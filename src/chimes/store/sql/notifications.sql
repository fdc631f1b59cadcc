-- The notification outbox: claimed with a lease (next_attempt_at pushed ahead), sent, marked.

-- name: claim_notifications
-- At most $1, picked once in a materialised step and updated by their keys as one array, so that
-- the limit holds whatever the plan (working.sql, claim_runs, says how it is lost otherwise).
WITH due AS MATERIALIZED (
    SELECT notification_id FROM notifications
    WHERE sent_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
    ORDER BY next_attempt_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
UPDATE notifications n SET attempts = n.attempts + 1, next_attempt_at = now() + make_interval(secs => $2)
WHERE n.notification_id = ANY (ARRAY(SELECT notification_id FROM due))
RETURNING n.notification_id, n.owner, n.url, n.payload, n.attempts;

-- name: mark_notifications_sent
UPDATE notifications SET sent_at = now(), last_error = NULL WHERE notification_id = ANY($1::uuid[]);

-- name: retry_notifications
-- A failed delivery is tried again after its backoff, unless the notification was queued more than
-- $4 seconds ago: then it is dead-lettered, kept with its last error and never tried again.
UPDATE notifications n SET next_attempt_at = now() + make_interval(secs => f.delay), last_error = f.error,
                           dead_at = CASE WHEN n.created_at < now() - make_interval(secs => $4) THEN now() END
FROM unnest($1::uuid[], $2::float8[], $3::text[]) AS f(notification_id, delay, error)
WHERE n.notification_id = f.notification_id
RETURNING n.notification_id, n.dead_at IS NOT NULL AS dead;

-- name: list_notifications
-- Newest first, one page after the cursor ($4, $5); $2 owner (NULL: every owner), $3 status.
SELECT notification_id, job_id, owner, kind, url, payload, created_at, attempts, next_attempt_at, sent_at,
       dead_at, last_error,
       CASE WHEN sent_at IS NOT NULL THEN 'sent' WHEN dead_at IS NOT NULL THEN 'dead' ELSE 'pending' END AS status
FROM notifications
WHERE ($2::text IS NULL OR owner = $2)
  AND ($6::uuid IS NULL OR job_id = $6)
  AND CASE $3::text
          WHEN 'dead' THEN dead_at IS NOT NULL
          WHEN 'sent' THEN sent_at IS NOT NULL
          WHEN 'pending' THEN sent_at IS NULL AND dead_at IS NULL
          ELSE true
      END
  AND ($4::timestamptz IS NULL OR (created_at, notification_id) < ($4, $5::uuid))
ORDER BY created_at DESC, notification_id DESC
LIMIT $1;

-- name: set_setting
INSERT INTO settings (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = excluded.value;

-- name: delete_setting
DELETE FROM settings WHERE key = $1;

-- name: set_cap
-- $3: the owner whose jobs a tag cap counts, '' for an owner cap or a fleet-wide tag cap.
INSERT INTO concurrency_caps (scope, name, owner, max_running) VALUES ($1, $2, $3, $4)
ON CONFLICT (scope, name, owner) DO UPDATE SET max_running = excluded.max_running;

-- name: remove_cap
DELETE FROM concurrency_caps WHERE scope = $1 AND name = $2 AND owner = $3 RETURNING name;

-- name: list_caps
SELECT scope, name, owner, max_running FROM concurrency_caps ORDER BY scope, name, owner;
