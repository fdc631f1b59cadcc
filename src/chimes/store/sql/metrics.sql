-- Fleet-wide gauges the API reads when Prometheus scrapes /metrics (chimes/metrics.py).

-- name: metrics_queue_tier
-- Counting stops at $2: a huge backlog is reported as the cap rather than read in full.
SELECT (SELECT count(*) FROM (SELECT 1 FROM run_queue WHERE tier = $1 LIMIT $2) capped) AS depth,
       (SELECT extract(epoch FROM now() - enqueued_at)::float8 FROM run_queue
        WHERE tier = $1 ORDER BY queue_id LIMIT 1) AS oldest_sec;

-- name: metrics_fleet
SELECT (SELECT count(*) FROM scheduler_nodes WHERE heartbeat_at > now() - interval '30 seconds') AS nodes,
       (SELECT count(*) FROM workers WHERE heartbeat_at > now() - interval '60 seconds') AS workers,
       (SELECT count(*) FROM partition_leases WHERE owner IS NULL OR expires_at <= now()) AS unleased;
