-- Room on every page of `partition_leases` for a second version of each of its rows. A node renews
-- every partition it holds each second (1,024 rows a second for the fleet, idle or not). A full page
-- has no room for the new versions, so a quarter to a half of the renewals went to another page: a
-- non-HOT update, with a lock record, a new primary-key entry and the whole row in the WAL. With
-- half of each page free, the previous round's versions are pruned and every renewal stays on its
-- page (a HOT update: no index entry, a smaller record). An idle fleet wrote 121 KB of WAL a second
-- before (10.7 GB a day, shipped to every standby), 98 KB after (`python -m bench idle-wal`).
--
-- Its statistics are not worth keeping fresh either: 1,024 rows, always looked up by key. Analyzed
-- after 50 + 10% of its rows changed, the table was analyzed every ten seconds.
--
-- Locks: CLUSTER rewrites the table (a few pages) under an ACCESS EXCLUSIVE lock, so fires, reaps
-- and lease rounds wait for an instant while it runs.
ALTER TABLE partition_leases SET (fillfactor = 40, autovacuum_analyze_scale_factor = 100);
CLUSTER partition_leases USING partition_leases_pkey;
