-- Concurrency caps across shards (docs/scaling.md, "Caps and quotas across shards"): with a shard map
-- that gives partitions to other databases, a worker admits a capped run by first taking one slot of
-- each cap the run falls under here, in the catalog, then claiming the run on its home. The slots of
-- a cap are counted under one lock (chimes.store.cap_slots), so workers claiming from different
-- shards never admit past a cap together. The run's outcome frees its slots; the worker renews them
-- with its heartbeat; a slot whose lease lapsed (its worker died) is deleted by the next take. With
-- one database (an empty map) this table stays empty: caps are counted from the running runs, as before.
CREATE TABLE cap_slots (
    scope text NOT NULL,             -- the cap's key, as in concurrency_caps
    name text NOT NULL,
    owner text NOT NULL,
    run_id uuid NOT NULL,            -- the run that holds the slot
    shard_id integer,                -- the run's home: a shard of the map; NULL: the catalog
    holder text NOT NULL,            -- the worker that claimed it
    expires_at timestamptz NOT NULL, -- renewed with the worker's heartbeat
    PRIMARY KEY (scope, name, owner, run_id)
);
CREATE INDEX cap_slots_run ON cap_slots (run_id);
