-- The notification outbox: claimed with a lease (next_attempt_at pushed ahead), sent, marked.

-- name: claim_notifications
UPDATE notifications n SET attempts = n.attempts + 1, next_attempt_at = now() + make_interval(secs => $2)
WHERE n.notification_id IN (
    SELECT notification_id FROM notifications
    WHERE sent_at IS NULL AND next_attempt_at <= now()
    ORDER BY next_attempt_at
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
RETURNING n.notification_id, n.owner, n.url, n.payload, n.attempts;

-- name: mark_notifications_sent
UPDATE notifications SET sent_at = now(), last_error = NULL WHERE notification_id = ANY($1::uuid[]);

-- name: retry_notifications
UPDATE notifications n SET next_attempt_at = now() + make_interval(secs => f.delay), last_error = f.error
FROM unnest($1::uuid[], $2::float8[], $3::text[]) AS f(notification_id, delay, error)
WHERE n.notification_id = f.notification_id;

-- name: set_setting
INSERT INTO settings (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = excluded.value;

-- name: delete_setting
DELETE FROM settings WHERE key = $1;

-- name: get_settings
SELECT key, value FROM settings ORDER BY key;

-- name: set_cap
-- $3: the owner whose jobs a tag cap counts, '' for an owner cap or a fleet-wide tag cap.
INSERT INTO concurrency_caps (scope, name, owner, max_running) VALUES ($1, $2, $3, $4)
ON CONFLICT (scope, name, owner) DO UPDATE SET max_running = excluded.max_running;

-- name: remove_cap
DELETE FROM concurrency_caps WHERE scope = $1 AND name = $2 AND owner = $3 RETURNING name;

-- name: list_caps
SELECT scope, name, owner, max_running FROM concurrency_caps ORDER BY scope, name, owner;
