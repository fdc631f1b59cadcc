-- A worker's claim writes one lease row for the runs it took together, instead of one per run: the
-- per-run row (`run_leases`), inserted by the claim and deleted by the outcome, cost 242 bytes of WAL
-- a run, a sixth of all a run writes (docs/benchmarks.md, "What a run writes to the WAL").
--
-- * `claim_leases`: one row per claim, keyed by the lease token that all its runs now share. It
--   lists the runs (id, scheduled time, deadline each) and keeps the claim's expiry, renewed by the
--   worker's heartbeat for all of them at once, and the earliest of their deadlines (so the reaper
--   opens only the rows with something due). The worker deletes the row once every run of it has
--   left its hands (recorded, refused, handed back, cancelled); a row of a worker that died is
--   deleted by a reaper once it expired and none of its runs still runs under its token.
-- * The run keeps its lease token, and the fence is still that token, on the run: an outcome, a reap
--   or a cancel changes a run only if it is still `running` under the token.
-- * `run_leases` stays for runs with a lease of their own, which overrides their claim's: a callback
--   task's run (its target renews it, not the worker), and a run its worker gave up without an
--   outcome (written expired, so that it is reaped now rather than when its siblings are done).
-- * The view `leases_in_force` reads both as one row per run in flight, for everyone but the reaper
--   and the heartbeat (caps, the dashboard, the chaos checks).
--
-- Mixed versions: workers of earlier versions keep writing `run_leases` rows, which this version's
-- reaper reads as before. A scheduler node of an earlier version does not read `claim_leases`, so it
-- cannot reap the runs of this version's workers: upgrade scheduler nodes before workers
-- (docs/operations.md, "Upgrades"). Runs already running keep their rows in `run_leases`.
CREATE TABLE claim_leases (
    token uuid NOT NULL,
    expires_at timestamptz NOT NULL,
    deadline_at timestamptz NOT NULL,
    run_ids uuid[] NOT NULL,
    scheduled_ats timestamptz[] NOT NULL,
    deadlines timestamptz[] NOT NULL,
    CONSTRAINT claim_leases_pkey PRIMARY KEY (token),
    CONSTRAINT claim_leases_runs CHECK (cardinality(run_ids) = cardinality(scheduled_ats)
                                        AND cardinality(run_ids) = cardinality(deadlines))
) WITH (fillfactor = 50, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_cost_delay = 0);

CREATE VIEW leases_in_force AS
SELECT l.run_id, l.scheduled_at, l.token, l.expires_at, l.deadline_at FROM run_leases l
UNION ALL
SELECT u.run_id, u.scheduled_at, c.token, c.expires_at, u.deadline_at
FROM claim_leases c
CROSS JOIN LATERAL unnest(c.run_ids, c.scheduled_ats, c.deadlines) AS u(run_id, scheduled_at, deadline_at)
WHERE NOT EXISTS (SELECT 1 FROM run_leases own WHERE own.run_id = u.run_id AND own.token = c.token);
