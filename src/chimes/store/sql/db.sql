-- Connections as such (chimes/store/db.py), and the database a Patroni cluster starts without
-- (chimes/store/cluster.py).

-- name: ping
-- GET /healthz: the database answers.
SELECT 1;

-- name: in_recovery
-- GET /healthz, for each host of a multi-host URL: a standby is in recovery, a primary is not.
SELECT pg_is_in_recovery();

-- name: database_exists
SELECT true FROM pg_database WHERE datname = $1;

-- name: create_database
-- {database}: an identifier, quoted by the caller; CREATE DATABASE takes no parameters.
CREATE DATABASE {database};

-- name: current_wal_lsn
SELECT pg_current_wal_lsn();

-- name: standbys_behind
-- Standbys that have not replayed the WAL up to $1 yet (or report no replay position).
SELECT count(*) FROM pg_stat_replication WHERE replay_lsn < $1 OR replay_lsn IS NULL;
