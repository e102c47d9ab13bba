"""Structured request events: one log line per stage outcome, correlated by request id.

``event(log, "relay", request_id, engine=..., committed=12)`` writes
``event=relay request_id=... engine=... committed=12`` with the standard logging machinery, and puts
the same fields on the record (``record.event``, ``record.request_id``, ``record.fields``) so
``JsonFormatter`` (``server.log_format: json``) emits them as JSON keys for a log pipeline. Plain
``logging`` instead of a structured-logging library: the fields ride on ordinary records, so
uvicorn's and vLLM's log handling keeps working unchanged.

The events (docs/observability.md): ``render`` (tokenizer_source, prompt_tokens, latency_ms),
``render_fallback`` (reason, latency_ms), ``leg`` (engine, phase, result), ``derender_error``
(prompt, choice, attempt, error), ``relay`` (committed, remaining, from/to engine), ``cancelled``
(failed prompt, cancelled siblings, reason).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any


def _value(v: Any) -> str:
    text = str(v)
    return json.dumps(text) if (not text or any(c in text for c in ' "=')) else text


def event(logger: logging.Logger, name: str, request_id: str, *, level: int = logging.INFO,
          **fields: Any) -> None:
    """Log one structured event (skipped cheaply when the level is off)."""
    if not logger.isEnabledFor(level):
        return
    line = " ".join(f"{k}={_value(v)}" for k, v in fields.items())
    logger.log(level, "event=%s request_id=%s %s", name, request_id, line,
               extra={"event": name, "request_id": request_id, "fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per line; an event's fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname,
                               "logger": record.name}
        name = getattr(record, "event", None)
        if name is not None:
            out["event"] = name
            out["request_id"] = getattr(record, "request_id", None)
            out.update(getattr(record, "fields", {}) or {})
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)
