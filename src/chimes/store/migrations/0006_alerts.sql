-- Alerts that give up and clean up: dead-lettered notifications, and what retention and the API
-- read them by. See docs/semantics.md (Notifications) and docs/operations.md (Retention).

-- A notification still undelivered this long after it was queued (the notifier's give-up time, 24 h
-- by default) is dead-lettered: kept with its last error, never tried again.
ALTER TABLE notifications ADD COLUMN dead_at timestamptz;
DROP INDEX notifications_pending;
CREATE INDEX notifications_pending ON notifications (next_attempt_at) WHERE sent_at IS NULL AND dead_at IS NULL;
-- Listing (GET /notifications, newest first, per owner or for admins) and retention (oldest first).
CREATE INDEX notifications_created ON notifications (created_at, notification_id);
CREATE INDEX notifications_owner_created ON notifications (owner, created_at, notification_id);
CREATE INDEX notifications_dead ON notifications (created_at, notification_id) WHERE dead_at IS NOT NULL;
