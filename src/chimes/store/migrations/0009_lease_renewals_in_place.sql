-- Room on every page of `partition_leases` for a second version of each of its rows. A node renews
-- every partition it holds each second (every row, each second, idle or not). A full page has no
-- room for the new versions, so many renewals would go to another page: a non-HOT update, with a
-- lock record, a new primary-key entry and the whole row in the WAL. With half of each page free,
-- the previous round's versions are pruned and every renewal stays on its page (a HOT update: no
-- index entry, a smaller record), so an idle fleet writes less WAL (`python -m bench idle-wal`).
--
-- Its statistics are not worth keeping fresh either: a fixed set of rows, always looked up by key.
-- With the default thresholds the table would be analyzed every few seconds.
--
-- Locks: CLUSTER rewrites the table (a few pages) under an ACCESS EXCLUSIVE lock, so fires, reaps
-- and lease rounds wait for an instant while it runs.
ALTER TABLE partition_leases SET (fillfactor = 40, autovacuum_analyze_scale_factor = 100);
CLUSTER partition_leases USING partition_leases_pkey;
