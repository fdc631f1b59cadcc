-- The catalog's fence against a stale router (docs/scaling.md, "Shards"): once `chimes shards add`
-- gives partitions to a shard, the catalog refuses new jobs in them, so an API process that has not
-- reloaded the map yet cannot leave a job behind in the catalog; it reloads the map and creates the
-- job on its shard. The trigger is created on the catalog by `chimes shards add` (not here): a
-- database without shards pays nothing per job.

-- A job's partition, as chimes.ids.partition_of computes it: CRC-32 (IEEE) of the id's 16 bytes,
-- modulo 1,024. PostgreSQL 18 has crc32(); before it, the same CRC written out in PL/pgSQL (slower:
-- it runs once per job created in a catalog with shards, never on a hot path).
DO $migration$
BEGIN
    IF current_setting('server_version_num')::integer >= 180000 THEN
        EXECUTE $f$
            CREATE FUNCTION chimes_partition_of(job_id uuid) RETURNS integer
            LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
            RETURN (crc32(uuid_send(job_id)) % 1024)::integer
        $f$;
    ELSE
        EXECUTE $f$
            CREATE FUNCTION chimes_partition_of(job_id uuid) RETURNS integer
            LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $body$
            DECLARE
                bytes bytea := uuid_send(job_id);
                crc bigint := 4294967295;
            BEGIN
                FOR i IN 0..15 LOOP
                    crc := crc # get_byte(bytes, i);
                    FOR bit IN 1..8 LOOP
                        crc := CASE WHEN crc & 1 = 1 THEN (crc >> 1) # 3988292384 ELSE crc >> 1 END;
                    END LOOP;
                END LOOP;
                RETURN ((crc # 4294967295) % 1024)::integer;
            END
            $body$
        $f$;
    END IF;
END
$migration$;

-- Refuses a job whose partition a shard holds, with SQLSTATE CH001 (chimes.store.shards.PartitionMoved).
-- Volatile, so its query sees the map as committed when the row is inserted, not when the statement began.
CREATE FUNCTION chimes_refuse_jobs_of_shards() RETURNS trigger
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    partition integer := chimes_partition_of(NEW.job_id);
BEGIN
    IF EXISTS (SELECT 1 FROM shard_ranges WHERE partition BETWEEN first_partition AND last_partition) THEN
        RAISE EXCEPTION 'partition % of job % is held by a shard: reload the shard map', partition, NEW.job_id
            USING ERRCODE = 'CH001';
    END IF;
    RETURN NEW;
END
$$;
