-- The shard map (docs/scaling.md, "Shards"): which PostgreSQL database holds which ranges of the
-- 1,024 trigger partitions. It is read from the catalog, the database of the configured URL; a
-- partition in no range lives in the catalog itself, so the empty map (version 0) is the single
-- database of before. Every shard database gets these tables too (the same migrations) and leaves
-- them empty: only the catalog's map counts.

-- One row: the map's version, raised by one with every change of `shards` or `shard_ranges`, in the
-- same transaction and under this row's lock: two changes of the map run one after the other.
CREATE TABLE shard_map (
    singleton boolean PRIMARY KEY DEFAULT true CONSTRAINT shard_map_one_row CHECK (singleton),
    version bigint NOT NULL DEFAULT 0 CONSTRAINT shard_map_version CHECK (version >= 0)
);
INSERT INTO shard_map DEFAULT VALUES;

-- The shard databases, by URL (as given, password included: guard the catalog like the shards'
-- own credentials).
CREATE TABLE shards (
    shard_id integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    url text NOT NULL UNIQUE CONSTRAINT shards_url CHECK (url <> ''),
    added_at timestamptz NOT NULL DEFAULT now()
);

-- Ranges of partitions (both ends included) and the shard holding them, with the map version that
-- put them there. No two ranges overlap: a partition has one home. A shard may hold several ranges
-- (moving partitions splits ranges). No foreign key to `shards`, as everywhere in Chimes: the rows
-- are written together, in one transaction, by chimes.store.shards.
CREATE TABLE shard_ranges (
    first_partition smallint PRIMARY KEY CONSTRAINT shard_ranges_first CHECK (first_partition BETWEEN 0 AND 1023),
    last_partition smallint NOT NULL
        CONSTRAINT shard_ranges_last CHECK (last_partition BETWEEN first_partition AND 1023),
    shard_id integer NOT NULL,
    since_version bigint NOT NULL,
    CONSTRAINT shard_ranges_disjoint
        EXCLUDE USING gist (int4range(first_partition, last_partition, '[]') WITH &&)
);
