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

-- name: switch_wal
-- A clean stop of a cluster that archives its WAL: close the segment in use so that it is archived.
-- With no WAL since the last switch, pg_switch_wal returns the start of the segment in use, and
-- pg_walfile_name of a segment's start names the segment before it, already closed.
SELECT pg_walfile_name(pg_switch_wal());

-- name: archiver_state
-- The last segment the archiver took and the last one it failed on.
SELECT last_archived_wal, last_failed_wal FROM pg_stat_archiver;
