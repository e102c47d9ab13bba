"""Structured request events: the text line an operator greps and the JSON a log pipeline parses."""

from __future__ import annotations

import json
import logging

import pytest

from coordinator.observability.events import JsonFormatter, event


def test_event_line_carries_request_id_and_fields(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.events")
    with caplog.at_level(logging.INFO, logger="test.events"):
        event(log, "relay", "req-1", committed=12, from_engine="http://e0:8000", why="no other engine")
    [record] = caplog.records
    assert record.getMessage() == ('event=relay request_id=req-1 committed=12 from_engine=http://e0:8000 '
                                   'why="no other engine"')
    parsed = json.loads(JsonFormatter().format(record))
    assert parsed["event"] == "relay" and parsed["request_id"] == "req-1"
    assert parsed["committed"] == 12 and parsed["why"] == "no other engine"


def test_disabled_level_builds_nothing(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.events.quiet")
    with caplog.at_level(logging.WARNING, logger="test.events.quiet"):
        event(log, "render", "req-2", latency_ms=1.5)
    assert caplog.records == []


def test_plain_records_become_json_messages() -> None:
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "engine %s gone", ("e0",), None)
    parsed = json.loads(JsonFormatter().format(record))
    assert parsed["message"] == "engine e0 gone" and parsed["level"] == "WARNING"
