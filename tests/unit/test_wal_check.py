"""The WAL arithmetic a restore checks its replay with: segment names from positions and back, and
where the server said replay ended."""

from __future__ import annotations

from chimes.store.wal_check import end_of, redo_done_at, segment_of

MB16 = 16 * 2**20


def test_a_position_is_in_the_segment_its_name_says() -> None:
    assert segment_of("0/4000028", 1, MB16) == "000000010000000000000004"
    assert segment_of("0/3FFFFFF", 1, MB16) == "000000010000000000000003"
    assert segment_of("1/0", 2, MB16) == "000000020000000100000000"
    assert segment_of("0/2000000", 1, 2**30) == "000000010000000000000000"  # 1 GB segments: four per id


def test_the_end_of_a_segment_is_the_start_of_the_next() -> None:
    assert end_of("000000010000000000000007", MB16) == "0/8000000"
    assert end_of("0000000100000000000000FF", MB16) == "1/0"
    assert segment_of(end_of("000000010000000000000007", MB16), 1, MB16) == "000000010000000000000008"


def test_the_last_redo_done_line_of_the_log_is_where_replay_ended() -> None:
    log = ("LOG:  redo starts at 0/2000028\n"
           "LOG:  redo done at 0/3001D38 system usage: CPU: user: 0.00 s, system: 0.00 s, elapsed: 0.02 s\n"
           "LOG:  last completed transaction was at log time 2026-12-07 13:59:05.94489+00\n")
    assert redo_done_at(log) == "0/3001D38"
    assert redo_done_at("LOG:  redo starts at 0/2000028\n") is None
