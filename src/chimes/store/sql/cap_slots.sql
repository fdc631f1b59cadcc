-- Concurrency caps across shards (migration 0011): a capped run's slots in the catalog.

-- name: lock_cap_slots
-- One counter of slots at a time, fleet-wide: two workers on different shards never both see room
-- for the last slot of a cap.
SELECT pg_advisory_xact_lock(hashtext('chimes_cap_slots'));

-- name: drop_lapsed_cap_slots
-- The slots of a worker that stopped renewing them (killed, cut off): its runs are reaped on their
-- shards after the same lease.
DELETE FROM cap_slots WHERE expires_at < now();

-- name: cap_slot_usage
-- Each cap and its slots taken, in the shape of cap_usage.
SELECT cap.scope, cap.name, cap.owner, cap.max_running,
       (SELECT count(*) FROM cap_slots s
        WHERE s.scope = cap.scope AND s.name = cap.name AND s.owner = cap.owner) AS running
FROM concurrency_caps cap;

-- name: take_cap_slots
-- $1-$4: one row per slot (the cap's key and the run); $5: the run's home (NULL: the catalog);
-- $6: the worker. A slot left by an earlier attempt of the same run is taken over.
INSERT INTO cap_slots (scope, name, owner, run_id, shard_id, holder, expires_at)
SELECT s.scope, s.name, s.owner, s.run_id, $5, $6, now() + make_interval(secs => $7::float8)
FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[]) AS s(scope, name, owner, run_id)
ON CONFLICT (scope, name, owner, run_id)
DO UPDATE SET shard_id = excluded.shard_id, holder = excluded.holder, expires_at = excluded.expires_at;

-- name: free_cap_slots
-- Only the holder's: a run reaped and claimed again belongs to its new worker's slots.
DELETE FROM cap_slots WHERE run_id = ANY($1::uuid[]) AND holder = $2;

-- name: renew_cap_slots
UPDATE cap_slots SET expires_at = now() + make_interval(secs => $3::float8)
WHERE run_id = ANY($1::uuid[]) AND holder = $2;
