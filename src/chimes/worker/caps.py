"""Admitting capped runs: at most N running at once per owner, per tag of one owner, or per tag of
every owner (a fleet-wide tag cap, the operator's explicit choice), across the whole fleet.

Pure admission logic; the worker runs it under an advisory lock so two workers never admit past a
cap together, with usage counted live from the running runs (one database) or from the slots taken
in the catalog (a shard map with ranges: chimes.store.cap_slots).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from chimes.store.caps import Candidate, CapKey, cap_key, caps_of

__all__ = ["Candidate", "CapKey", "admit", "cap_key", "caps_of"]


def admit(candidates: Iterable[Candidate], rooms: Mapping[CapKey, int], limit: int) -> list[int]:
    """The queue ids to claim, in queue order: each only if every cap it falls under has room left.
    A run that does not fit is skipped, not blocking the ones behind it that fall under other caps."""
    left = dict(rooms)
    admitted: list[int] = []
    for candidate in candidates:
        if len(admitted) >= limit:
            break
        keys = caps_of(candidate, left)
        if all(left[key] > 0 for key in keys):
            for key in keys:
                left[key] -= 1
            admitted.append(candidate.queue_id)
    return admitted
