"""Background Responses (``background: true``): the run goes on without the client.

A background request is answered at once with its response object (``queued``), stored; the run is a
task of the coordinator process that took it. It serves the chat form through the pipeline like any
request (admission counts it against its tenant, as it holds engine tokens), turns the chunks into the
Responses events a stream would carry and keeps them, numbered, so a client can read them live or
resume after ``sequence_number`` N; the stored response moves ``queued`` → ``in_progress`` →
``completed`` / ``incomplete`` / ``failed`` / ``cancelled``.

Which process runs it matters for three things, decided here:

* **Polling** (``GET /v1/responses/{id}``) reads the store, so any replica answers it.
* **Cancel** from the replica running it stops the task (the engine request is aborted, its tokens
  released); from another replica it writes ``cancelled`` into the store, and the runner, which looks
  at its entry every ``lease_s / 3`` seconds, stops within that time.
* **A runner that dies** stops renewing its lease (``lease_until`` in the stored entry, renewed on
  the same beat): a read after ``lease_s`` answers the run ``failed`` and stores it so. A run survives
  its client, never its process.

The events themselves stay in the runner's memory (bounded), so resuming a stream
(``?stream=true&starting_after=N``) works on the replica that runs or ran it; the others say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from coordinator.pipeline.context import ChunkStream, RequestContext
from coordinator.pipeline.errors import PipelineError
from coordinator.pipeline.responses.answer import ResponseEvents
from coordinator.pipeline.responses.chain import Opened, ResponsesIntake, listed
from coordinator.pipeline.responses.convert import Event
from coordinator.pipeline.responses.store import StoredResponse, StoreUnavailable
from coordinator.pipeline.responses.translate import in_responses_terms

log = logging.getLogger(__name__)
ACTIVE = ("queued", "in_progress")


def cancel_marker(response_id: str) -> str:
    """The store id of a request to cancel a run ("#" never appears in a response id)."""
    return f"{response_id}#cancel"


class Served(Protocol):
    @property
    def ctx(self) -> RequestContext: ...

    @property
    def stream(self) -> ChunkStream | None: ...

    async def aclose(self) -> None: ...


Serve = Callable[[dict[str, Any]], Awaitable[Served]]   # the chat body → the pipeline's served stream


@dataclass
class Run:
    """One background run on this process: its numbered events so far and its latest response."""

    opened: Opened
    response: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    done: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)   # one write of its entry at a time

    @property
    def id(self) -> str:
        return str(self.response["id"])

    def add(self, event: Event) -> None:
        self.events.append(event)
        self.changed.set()


class BackgroundRuns:
    """This process's background runs, and the store's view of everyone's."""

    def __init__(self, intake: ResponsesIntake, lease_s: float = 15.0, keep_finished: int = 256) -> None:
        self.intake = intake
        self.lease_s = lease_s
        self._keep = keep_finished
        self._runs: OrderedDict[tuple[str, str], Run] = OrderedDict()

    # -- starting and running ----------------------------------------------------------------------
    async def start(self, opened: Opened, queued: dict[str, Any], serve: Serve) -> Run:
        """Store the queued response and start the run; the caller answers ``queued`` (or streams the
        run's events, which outlive the caller)."""
        run = Run(opened, queued)
        await self._put(run)
        self._runs[(opened.tenant, run.id)] = run
        self._trim()
        run.task = asyncio.create_task(self._run(run, serve), name=f"background-{run.id}")
        return run

    async def _run(self, run: Run, serve: Serve) -> None:
        chat = {**run.opened.form.chat, "stream": True, "stream_options": {"include_usage": True}}
        served: Served | None = None
        lease = asyncio.create_task(self._renew(run))
        try:
            served = await serve(chat)
            assert served.stream is not None, "a stream was asked for"
            events = ResponseEvents(run.opened.form, served.ctx)
            for event in events.start():
                run.add(event)
            run.response = {**run.events[0]["response"], "background": True}
            await self._put(run)
            async for chunk in served.stream.events():
                for event in events.feed(chunk):
                    run.add(event)
            for event in events.close():
                run.add(event)
            completed = events.completed()
            completed["response"]["background"] = True
            async with run.writing:
                run.response = completed["response"]
                await self.intake.keep(run.opened, run.response)  # the whole turn, for follow-ups too
            run.add(completed)
        except asyncio.CancelledError:
            await self._end(run, "cancelled", None)
            raise
        except PipelineError as exc:
            err = in_responses_terms(exc)
            await self._end(run, "failed", {"code": err.type, "message": err.message})
        except Exception as exc:
            log.exception("background response %s failed", run.id)
            await self._end(run, "failed", {"code": "server_error", "message": str(exc) or "internal error"})
        finally:
            lease.cancel()
            if served is not None:
                await served.aclose()  # aborts the engine request when it is still running
            run.done = True
            run.changed.set()

    async def _end(self, run: Run, status: str, error: dict[str, Any] | None) -> None:
        """A run that ends without its answer: ``failed`` gets OpenAI's ``response.failed`` event; a
        cancelled one just ends its stream (OpenAI has no event for it; the stored status says it)."""
        async with run.writing:
            run.response = {**run.response, "status": status, "error": error}
            with contextlib.suppress(StoreUnavailable):
                await self._put(run)
        if status == "failed":
            run.add({"type": "response.failed", "response": run.response, "sequence_number": len(run.events)})

    async def _renew(self, run: Run) -> None:
        """Renew the lease, and stop the run when another replica asked to cancel it (its marker)."""
        store = self.intake.chain.require()
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                if await store.get(run.opened.tenant, cancel_marker(run.id)) is not None:
                    if run.task is not None:
                        run.task.cancel()
                    return
                async with run.writing:  # never after the final write: that one checks the status first
                    if run.response.get("status") in ACTIVE:
                        await self._put(run)
            except StoreUnavailable as exc:
                log.warning("background response %s: lease not renewed: %s", run.id, exc.message)

    async def _put(self, run: Run) -> None:
        """The run's entry as it stands; a lease while it is queued or running."""
        turn = run.opened.turn
        running = run.response.get("status") in ACTIVE
        await self.intake.chain.require().put(run.opened.tenant, StoredResponse(
            run.id, run.response, listed(turn.own_input, run.id), turn.history, time.time(),
            lease_until=time.time() + self.lease_s if running else None))

    def _trim(self) -> None:
        while len(self._runs) > self._keep:
            oldest = next((k for k, r in self._runs.items() if r.done), None)
            if oldest is None:
                return
            del self._runs[oldest]

    # -- what clients ask of a run -----------------------------------------------------------------
    def local(self, tenant: str, response_id: str) -> Run | None:
        return self._runs.get((tenant, response_id))

    async def events(self, run: Run, after: int = -1) -> AsyncIterator[Event]:
        """The run's events numbered above ``after``, then live ones until it ends."""
        sent = after + 1
        while True:
            while sent < len(run.events):
                yield run.events[sent]
                sent += 1
            if run.done:
                return
            run.changed.clear()
            if sent < len(run.events):
                continue
            await run.changed.wait()

    async def settled(self, tenant: str, entry: StoredResponse) -> StoredResponse:
        """A stored entry as it stands: a run whose runner stopped renewing its lease is ``failed``."""
        status = entry.response.get("status")
        if status not in ACTIVE or entry.lease_until is None or entry.lease_until >= time.time():
            return entry
        if self.local(tenant, entry.id) is not None:
            return entry
        failed = {**entry.response, "status": "failed", "error": {
            "code": "server_error", "message": "the coordinator running this response stopped"}}
        entry = replace(entry, response=failed, lease_until=None)
        await self.intake.chain.require().put(tenant, entry)
        return entry

    async def cancel(self, tenant: str, entry: StoredResponse) -> dict[str, Any]:
        """Cancel a queued or running background response (the caller checked it is one)."""
        run = self.local(tenant, entry.id)
        if run is not None and run.task is not None and not run.done:
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run.task
            return run.response
        # Another replica runs it: a marker it reads on its next beat (a separate entry, so the runner's
        # own lease renewal cannot overwrite the request), and the status pollers see meanwhile.
        store = self.intake.chain.require()
        await store.put(tenant, StoredResponse(cancel_marker(entry.id), {}, [], [], time.time()))
        cancelled = {**entry.response, "status": "cancelled"}
        await store.put(tenant, replace(entry, response=cancelled, lease_until=None))
        return cancelled

    async def aclose(self) -> None:
        """Shutting down: every run still going ends ``failed`` (a run does not survive its process)."""
        for run in list(self._runs.values()):
            if run.task is not None and not run.done:
                run.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await run.task
                run.response = {**run.response, "status": "failed",
                                "error": {"code": "server_error", "message": "the coordinator stopped"}}
                with contextlib.suppress(StoreUnavailable):
                    await self._put(run)
