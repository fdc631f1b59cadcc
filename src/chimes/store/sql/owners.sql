-- Owners (teams): what the operator allows each, and their signing secrets.

-- name: lock_owner_for_job
-- Makes the owner's row if missing and locks it until the end of the transaction, so concurrent
-- creates for one owner count their jobs one after the other and the quota holds exactly.
INSERT INTO owners (owner) VALUES ($1)
ON CONFLICT (owner) DO UPDATE SET owner = excluded.owner
RETURNING job_quota, allow_commands;

-- name: owner_allows_commands
SELECT coalesce((SELECT allow_commands FROM owners WHERE owner = $1), false);

-- name: count_owner_jobs_up_to
-- Counts at most $2 rows: a quota check never reads more of an owner's jobs than the quota.
SELECT count(*) FROM (SELECT 1 FROM jobs WHERE owner = $1 LIMIT $2) AS some_jobs;

-- name: get_owner
SELECT owner, allow_commands, job_quota, signing_secret IS NOT NULL AS has_signing_secret,
       (SELECT count(*) FROM jobs WHERE jobs.owner = owners.owner) AS jobs
FROM owners WHERE owner = $1;

-- name: list_owners
SELECT owner, allow_commands, job_quota, signing_secret IS NOT NULL AS has_signing_secret,
       (SELECT count(*) FROM jobs WHERE jobs.owner = owners.owner) AS jobs
FROM owners ORDER BY owner;

-- name: set_owner
-- $2 / $3 NULL leave allow_commands / job_quota as they are; $4 true sets job_quota to NULL (default).
INSERT INTO owners (owner, allow_commands, job_quota)
VALUES ($1, coalesce($2::boolean, false), CASE WHEN $4::boolean THEN NULL ELSE $3::integer END)
ON CONFLICT (owner) DO UPDATE
SET allow_commands = coalesce($2::boolean, owners.allow_commands),
    job_quota = CASE WHEN $4::boolean THEN NULL ELSE coalesce($3::integer, owners.job_quota) END,
    updated_at = now();

-- name: signing_secret
SELECT signing_secret FROM owners WHERE owner = $1;

-- name: put_signing_secret
-- $3 false: only when the owner has none yet (the first caller's secret wins); true: replace it.
INSERT INTO owners (owner, signing_secret) VALUES ($1, $2)
ON CONFLICT (owner) DO UPDATE
SET signing_secret = CASE WHEN $3 OR owners.signing_secret IS NULL THEN excluded.signing_secret
                          ELSE owners.signing_secret END,
    updated_at = now()
RETURNING signing_secret;

-- name: record_secret_key
-- The id of the key this database's secrets are sealed with: the first process's key, from then on.
WITH recorded AS (
    INSERT INTO secret_key (key_id) VALUES ($1) ON CONFLICT (singleton) DO NOTHING RETURNING key_id
)
SELECT key_id FROM recorded UNION ALL SELECT key_id FROM secret_key LIMIT 1;

-- name: recorded_secret_key
SELECT key_id FROM secret_key;
