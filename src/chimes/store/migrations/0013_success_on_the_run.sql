-- A run that succeeds keeps its last attempt on the run row instead of in `run_attempts`. Most runs
-- succeed at their first try, and their attempt row repeated what the run says (worker, start, end,
-- status, error) and added only the output's tail: an insert and an index entry per run, 223 bytes
-- of WAL of the 1,750 a run wrote (docs/benchmarks.md, "What a run writes to the WAL"). Now the
-- outcome's update of the run (in place, migration 0012) carries that output too, when it is short
-- (complete_runs: up to 16 bytes, an empty body, "ok", {"ok":true}; a longer one keeps its attempt
-- row, so that the run's new version still fits on its page). Attempts that did not succeed (failed,
-- lost, cancelled) keep their rows, so failures are still found through `run_attempts_failed`.
--
-- Readers ask `run_attempt_history`: the attempt rows, and a succeeded run's last attempt from the
-- run when it has no row of its own. Runs that succeeded before this migration have their row and
-- are not counted twice. Adding a column without a default rewrites nothing: this runs at once.
ALTER TABLE runs ADD COLUMN output text;

CREATE VIEW run_attempt_history AS
SELECT a.run_id, a.scheduled_at, a.attempt, a.worker_id, a.status, a.started_at, a.finished_at, a.error, a.output
FROM run_attempts a
UNION ALL
SELECT r.run_id, r.scheduled_at, r.attempt, r.worker_id, r.status, r.started_at, r.finished_at, r.error, r.output
FROM runs r
WHERE r.status = 'succeeded'
  AND NOT EXISTS (SELECT 1 FROM run_attempts a
                  WHERE a.run_id = r.run_id AND a.scheduled_at = r.scheduled_at AND a.attempt = r.attempt);
