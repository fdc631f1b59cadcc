"""``chimes chaos``: a real fleet broken on purpose, then every invariant checked (docs/reliability.md).

A package of its own beside ``chimes``, shipped with it: it starts and breaks Chimes from outside and
nothing in ``chimes`` imports it but the ``chimes chaos`` command, lazily.

fleet: the processes and their PostgreSQL; target: the HTTP target recording every call; workload:
the jobs; faults: the seeded schedule of faults and its runner; observer: partition ownership over
time; evidence, invariants, timing: the checker; report: the outcome; harness: one run, end to end.
"""
