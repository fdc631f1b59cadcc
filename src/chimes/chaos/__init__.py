"""``chimes chaos``: a real fleet broken on purpose, then every invariant checked (docs/reliability.md).

fleet: the processes and their PostgreSQL; target: the HTTP target recording every call; workload:
the jobs; faults: the seeded schedule of faults and its runner; observer: partition ownership over
time; evidence, invariants, timing: the checker; report: the outcome; harness: one run, end to end.
"""
