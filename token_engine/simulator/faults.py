"""Fault hooks installed over HTTP (`POST /sim/faults`) so failure handling can be tested end to end.

Each hook reproduces something a coordinator meets in production: an engine answering errors, slow
headers, a connection cut mid-stream, a stalled stream, a dead engine, or vLLM's post-200 error event.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class SimFaults(BaseModel):
    """The active fault set; `POST /sim/faults` replaces it, `DELETE /sim/faults` resets it."""

    model_config = ConfigDict(extra="forbid")

    fail_next: int = Field(default=0, ge=0)
    """Fail this many upcoming generate calls (before any engine work) with `fail_status`/`fail_body`."""
    fail_status: int = Field(default=503, ge=100, le=599)
    fail_body: dict[str, Any] | str | None = None
    """JSON object or raw text; None gives a vLLM-shaped ErrorResponse for the status."""
    delay_headers_s: float = Field(default=0.0, ge=0.0)
    """Sleep before answering (before the status line) on every generate call."""
    hang: bool = False
    """Never answer generate calls (the request is not submitted; a client disconnect ends it)."""
    drop_after_tokens: int | None = Field(default=None, ge=0)
    """Streaming: cut the TCP connection (no `[DONE]`, no final chunk) once this many tokens were sent."""
    stall_after_tokens: int | None = Field(default=None, ge=0)
    """Streaming: stop sending (connection kept open) once this many tokens were sent."""
    error_after_tokens: int | None = Field(default=None, ge=1)
    """The engine fails the request (finish_reason "error") after this many tokens: a streaming client gets
    `data: {"error": {..., "code": 500}}` then `data: [DONE]`; a non-streaming one gets a 500."""
    health_dead: bool = False
    """`GET /health` answers 503 and generate answers vLLM's 500 EngineDeadError."""
    calls: int | None = Field(default=None, ge=1)
    """Limit delay/hang/drop/stall/error hooks to this many upcoming generate calls (None: until cleared)."""

    def take_failure(self) -> bool:
        """Consume one `fail_next` slot."""
        if self.fail_next > 0:
            self.fail_next -= 1
            return True
        return False

    def take_call(self) -> SimFaults | None:
        """The hooks that apply to this generate call (None when the call budget is spent)."""
        if self.calls is None:
            return self
        if self.calls <= 0:
            return None
        self.calls -= 1
        return self.model_copy()
