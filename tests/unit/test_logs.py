"""Log lines: one JSON object per line for machines, text with key=value fields for people."""

from __future__ import annotations

import io
import json
import logging

import pytest

from chimes import logs


def emit(formatter: logging.Formatter, message: str, *args: object, **extra: object) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger(f"chimes.test.{id(stream)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.warning(message, *args, extra=extra)
    return stream.getvalue()


def test_json_lines_carry_the_run_and_job_ids_as_fields() -> None:
    line = emit(logs.JsonFormatter(), "run %s failed", "r-1", run_id="r-1", job_id="j-9", attempt=2)
    assert line.count("\n") == 1
    entry = json.loads(line)
    assert entry["message"] == "run r-1 failed" and entry["level"] == "WARNING"
    assert entry["run_id"] == "r-1" and entry["job_id"] == "j-9" and entry["attempt"] == 2
    assert entry["time"].endswith("Z") and entry["logger"].startswith("chimes.test.")


def test_json_keeps_a_traceback_on_one_line_and_odd_values_as_text() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("chimes.test.exc")
    logger.handlers[:] = [handler]
    logger.propagate = False
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logger.exception("it broke", extra={"node_id": object.__new__(object)})
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert "ValueError: bad" in entry["exception"] and entry["node_id"].startswith("<object")


def test_text_appends_fields_after_the_message() -> None:
    line = emit(logs.TextFormatter(), "reaped run %s", "r-1", run_id="r-1", job_id="j-9")
    assert line.rstrip().endswith("reaped run r-1 run_id=r-1 job_id=j-9")


def test_run_fields_takes_anything_with_run_and_job_ids() -> None:
    class Run:
        run_id, job_id = "r", "j"

    assert logs.run_fields(Run()) == {"run_id": "r", "job_id": "j"}


@pytest.mark.parametrize("log_format, tty, expect_json", [
    ("auto", False, True), ("auto", True, False), ("json", True, True), ("text", False, False),
])
def test_auto_is_json_unless_stderr_is_a_terminal(
    monkeypatch: pytest.MonkeyPatch, log_format: str, tty: bool, expect_json: bool,
) -> None:
    class Stderr(io.StringIO):
        def isatty(self) -> bool:
            return tty

    monkeypatch.setattr("sys.stderr", Stderr())
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.configure("INFO", log_format)
        formatter = root.handlers[0].formatter
        assert isinstance(formatter, logs.JsonFormatter) is expect_json
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
