-- Releases of live processes, for rolling upgrades (chimes/store/upgrades.py).

-- name: heartbeat_api_server
INSERT INTO api_servers (server_id, hostname, pid, release) VALUES ($1, $2, $3, $4)
ON CONFLICT (server_id) DO UPDATE SET heartbeat_at = now(), release = excluded.release;

-- name: forget_api_server
DELETE FROM api_servers WHERE server_id = $1;

-- name: forget_dead_api_servers
DELETE FROM api_servers WHERE heartbeat_at < now() - interval '1 hour';

-- name: live_processes
-- Each live process of this database and its release (NULL: 0.1.0 or earlier, which recorded none).
-- Live as the metrics count them: a scheduler node heartbeats every second or so, a worker at a third
-- of its lease, an API server every API_HEARTBEAT_SEC.
SELECT 'scheduler' AS role, node_id AS id, release FROM scheduler_nodes
WHERE heartbeat_at > now() - interval '30 seconds'
UNION ALL
SELECT 'worker', worker_id, release FROM workers WHERE heartbeat_at > now() - interval '60 seconds'
UNION ALL
SELECT 'api', server_id, release FROM api_servers WHERE heartbeat_at > now() - interval '30 seconds'
ORDER BY 1, 2;

-- name: live_processes_before_releases
-- As live_processes, on a database that migration 0020 has not reached: no process records a release.
SELECT 'scheduler' AS role, node_id AS id, NULL::text AS release FROM scheduler_nodes
WHERE heartbeat_at > now() - interval '30 seconds'
UNION ALL
SELECT 'worker', worker_id, NULL FROM workers WHERE heartbeat_at > now() - interval '60 seconds'
ORDER BY 1, 2;

-- name: releases_recorded
SELECT to_regclass('api_servers') IS NOT NULL;
