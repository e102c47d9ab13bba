"""Trigger P/D: the decode engine first; its connector calls us back; then the prefill leg.

As vLLM-Ascend's ``MooncakeLayerwiseConnector`` and MindIE Motor's ``UnifiedPDRouter`` do it
(docs/trigger-protocol.md has each fact and its source):

1. The decode engine is chosen and sent the request with ``kv_transfer_params = {do_remote_decode:
   false, do_remote_prefill: true, metaserver: <this attempt's callback URL>}``.
2. When it allocates blocks, its connector POSTs its own transfer parameters to that URL.
3. The coordinator then chooses the prefill engine and sends it the prefill (one token, the
   callback's parameters with ``do_remote_decode: true`` and no ``metaserver``), under the *same*
   engine request id: the prefill engine tags its KV with it and the decode engine matches on it.
   The callback is answered with the prefill engine's JSON once it is done.
4. The prefill engine pushes the KV layer by layer; the decode engine's stream then yields tokens.

``TriggerLegs`` is the topology unit (legs.py); ``TriggerBoard`` is the table the metaserver door
(``api/metaserver.py``) looks callbacks up in; a ``TriggerCall`` is one attempt's entry. The attempt
opens once the decode stream's first chunk is in, so a failed prefill leg (or a decode engine that
never calls back) is retried like any failure before the first byte. Beyond upstream (whose URL
carries only an attempt number), each attempt's URL carries an unguessable token, and a callback
with any other token is refused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from coordinator.config import TopologySettings
from coordinator.contracts.generate import GenerateRequest, GenerateResponse, StreamChunk
from coordinator.observability import tracing
from coordinator.pipeline.admission.controller import Grant
from coordinator.pipeline.engines.client import EngineClient, engine_request_id
from coordinator.pipeline.errors import NoHealthyEngine, UpstreamUnavailable
from coordinator.pipeline.scheduling.request import SchedRequest
from coordinator.pipeline.topology.attempts import Attempts
from coordinator.pipeline.topology.legs import prepend

log = logging.getLogger(__name__)
T = TypeVar("T")
RunPrefill = Callable[[dict[str, Any]], Awaitable[GenerateResponse]]
METASERVER_PATH = "/v1/metaserver"
_ENDED_KEPT = 4096  # ended attempts remembered, so a late callback gets 409 (stale), not 404


class CallbackRefused(Exception):
    """What the metaserver answers a callback it does not act on (status and message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PrefillLegFailed(Exception):
    """The prefill leg of a trigger attempt failed: the attempt fails with ``cause`` (the prefill
    engine's own error, already judged against that engine), not as the decode engine's failure."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class NoCallback(UpstreamUnavailable):
    """The decode engine never called the metaserver back: it is misconfigured or stuck."""


class TriggerCall:
    """One trigger attempt: its token, the engine request id its callback must carry, the prefill."""

    def __init__(self, token: str, request_id: str, run_prefill: RunPrefill) -> None:
        self.token = token
        self.request_id = request_id
        self._run_prefill = run_prefill
        self.called = False                  # a callback arrived (and was acted on)
        self.completed = False               # the prefill leg finished: repeats get {}
        self.delivered = False               # the decode engine streamed or answered: it has the KV
        self._prefill: asyncio.Task[GenerateResponse] | None = None
        self._failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self._after_prefill: list[Callable[[], None]] = []

    # -- the callback side (the metaserver's request task) ----------------------------------------
    async def callback(self, body: dict[str, Any]) -> GenerateResponse:
        if body.get("request_id") != self.request_id:
            raise CallbackRefused(409, "the callback's request_id is not this attempt's")
        if self.completed:
            return {}  # a repeat after the prefill finished (upstream answers the same)
        if self._prefill is not None:
            raise CallbackRefused(409, "Prefill dispatch did not complete")
        if self._failed.done():
            raise CallbackRefused(409, "Trigger attempt is no longer active")
        self.called = True
        self._prefill = asyncio.ensure_future(self._run_prefill(body))
        try:
            result = await self._prefill
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the metaserver itself is going away
            raise CallbackRefused(409, "Trigger attempt is no longer active") from None
        except Exception as exc:
            if not self._failed.done():
                self._failed.set_result(exc)
            raise CallbackRefused(500, f"the prefill leg failed: {type(exc).__name__}") from exc
        self.completed = True
        for hook in self._after_prefill:
            hook()
        return result

    # -- the decode side (the attempt's task) -----------------------------------------------------
    def after_prefill(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once the prefill leg has finished (now, if it has)."""
        if self.completed:
            hook()
        else:
            self._after_prefill.append(hook)

    async def race(self, work: Awaitable[T], callback_timeout_s: float, engine_url: str) -> T:
        """Await the decode engine's ``work`` (its answer, or its stream's first chunk) unless the
        prefill leg fails first (``PrefillLegFailed``) or no callback arrives within
        ``callback_timeout_s`` (``NoCallback``: the decode engine's failure). ``work`` is cancelled
        when it loses."""
        task = asyncio.ensure_future(work)
        try:
            waiting: set[asyncio.Future[Any]] = {task, self._failed}
            done, _ = await asyncio.wait(waiting, timeout=callback_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                if not self.called:
                    raise NoCallback(f"decode engine {engine_url} did not call the metaserver within "
                                     f"{callback_timeout_s:g} s")
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                result = task.result()
                self.delivered = True
                return result
            raise PrefillLegFailed(self._failed.result())
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def end(self) -> None:
        """The attempt is over. A prefill leg still running is cancelled (which aborts it) unless the
        decode engine already had the KV: the prefill engine pushes it before it answers, so a short
        decode can end before that answer arrives, and the answer is then left to come back to the
        decode engine's callback (its budget share is released with the attempt's)."""
        if not self._failed.done():
            self._failed.set_result(asyncio.CancelledError())
        if self._prefill is not None and not self._prefill.done() and not self.delivered:
            self._prefill.cancel()


class TriggerBoard:
    """The open trigger attempts by token, and the URL their decode engines call."""

    def __init__(self, on_answer: Callable[[int], None] | None = None) -> None:
        self.base_url: str | None = None  # http://<advertise host>:<port>/v1/metaserver, once serving
        self._open: dict[str, TriggerCall] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._on_answer = on_answer  # each callback's HTTP status (the trigger_callbacks metric)

    @property
    def open_calls(self) -> int:
        return len(self._open)

    def open(self, request_id: str, run_prefill: RunPrefill) -> TriggerCall:
        """Register an attempt before its decode request is sent (the callback may beat the 200)."""
        if self.base_url is None:
            raise UpstreamUnavailable("the trigger metaserver is not serving")
        call = TriggerCall(secrets.token_urlsafe(18), request_id, run_prefill)
        self._open[call.token] = call
        return call

    def url(self, call: TriggerCall) -> str:
        return f"{self.base_url}?attempt={call.token}"

    def close(self, call: TriggerCall) -> None:
        call.end()
        if self._open.pop(call.token, None) is not None:
            self._ended[call.token] = None
            while len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)

    async def callback(self, token: str | None, body: Any) -> GenerateResponse:
        """Act on one callback; raises ``CallbackRefused`` with the status to answer."""
        try:
            if not token:
                raise CallbackRefused(400, "Missing attempt query parameter")
            if not isinstance(body, dict) or not body:
                raise CallbackRefused(400, "Empty request json")
            if not body.get("request_id"):
                raise CallbackRefused(400, "Missing request_id")
            call = self._open.get(token)
            if call is None:
                if token in self._ended:
                    raise CallbackRefused(409, "Stale trigger attempt callback")
                raise CallbackRefused(404, "Trigger attempt not found")
            result = await call.callback(body)
        except CallbackRefused as refused:
            self.answered(refused.status)
            log.log(logging.WARNING if refused.status >= 500 else logging.INFO,
                    "metaserver callback answered %d: %s", refused.status, refused.message)
            raise
        self.answered(200)
        return result

    def answered(self, status: int) -> None:
        """Count one answer (the door calls it too, for a body it could not parse)."""
        if self._on_answer is not None:
            self._on_answer(status)


class TriggerLegs:
    """The legs of a trigger placement (a ``Legs`` unit, see legs.py): decode first, prefill at its
    callback, under the decode leg's engine request id (the prefill engine tags the KV it pushes
    with it)."""

    def __init__(self, client: EngineClient, attempts: Attempts, topology: TopologySettings,
                 board: TriggerBoard | None) -> None:
        self._client = client
        self._attempts = attempts
        self._timeout_s = topology.trigger.callback_timeout_s
        self._board = board

    async def stream(self, stack: contextlib.AsyncExitStack, grant: Grant, generate: GenerateRequest,
                     req: SchedRequest, rid: str, include_usage: bool
                     ) -> tuple[AsyncIterator[StreamChunk], tracing.Leg | None]:
        """Open the decode stream and wait for its first chunk (the prefill leg runs meanwhile, from
        the callback); the prefill engine's share of the budget goes back once both are done."""
        board, call = self._register(stack, grant, generate, req, rid)
        engine = grant.placement.engine
        leg = tracing.stream_leg("decode", engine.url, engine_request_id(rid), ends_with=stack)
        first: StreamChunk | None = None
        with self._attempts.outcome(engine, req, "decode", ok="streaming"), tracing.opening(leg):
            chunks = await stack.enter_async_context(self._client.stream(
                engine, trigger_decode_body(generate, board.url(call)), rid, include_usage=include_usage))
            with contextlib.suppress(StopAsyncIteration):
                first = await call.race(anext(chunks), self._timeout_s, engine.url)
        call.after_prefill(lambda: _release_prefill(grant))
        return prepend(first, chunks), leg

    async def generate(self, stack: contextlib.AsyncExitStack, grant: Grant, generate: GenerateRequest,
                       req: SchedRequest, rid: str) -> GenerateResponse:
        board, call = self._register(stack, grant, generate, req, rid)
        call.after_prefill(lambda: _release_prefill(grant))  # no first chunk to wait for
        engine = grant.placement.engine
        with self._attempts.outcome(engine, req, "decode"), \
                tracing.engine_leg("decode", engine.url, engine_request_id(rid)):
            body = trigger_decode_body(generate, board.url(call))
            return await call.race(self._client.generate(engine, body, rid), self._timeout_s, engine.url)

    def _register(self, stack: contextlib.AsyncExitStack, grant: Grant, generate: GenerateRequest,
                  req: SchedRequest, rid: str) -> tuple[TriggerBoard, TriggerCall]:
        """The attempt's entry on the board (closed with ``stack``), before the decode request goes
        out: the callback may beat its HTTP 200."""
        board = self._board
        if board is None:
            raise UpstreamUnavailable("trigger P/D engines need the metaserver (topology.trigger)")

        async def run_prefill(callback: dict[str, Any]) -> GenerateResponse:
            try:
                pre = await self._attempts.add_prefill(grant, req)
            except NoHealthyEngine as exc:  # retryable: the next placement takes the hybrid fallback
                raise UpstreamUnavailable(f"no prefill engine for the trigger callback: {exc}") from exc
            try:
                with self._attempts.outcome(pre, req, "prefill"), \
                        tracing.engine_leg("prefill", pre.url, engine_request_id(rid)):
                    return await self._client.generate(pre, trigger_prefill_body(generate, callback), rid)
            except BaseException:
                grant.release_engine(pre)
                raise

        call = board.open(engine_request_id(rid), run_prefill)
        stack.callback(board.close, call)
        return board, call


def _release_prefill(grant: Grant) -> None:
    if grant.placement.prefill is not None:
        grant.release_engine(grant.placement.prefill)


def trigger_decode_body(generate: GenerateRequest, metaserver_url: str) -> GenerateRequest:
    """The decode leg: the whole request, told to wait for a remote prefill and where to call."""
    return {**generate, "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True,
                                               "metaserver": metaserver_url}}


def trigger_prefill_body(generate: GenerateRequest, callback: dict[str, Any]) -> GenerateRequest:
    """The prefill leg: one token (``max_tokens`` = ``min_tokens`` = 1, as upstream), not streamed,
    one choice, carrying the decode engine's callback parameters with the roles swapped."""
    sp = generate["sampling_params"].copy()
    sp["max_tokens"] = 1
    sp["min_tokens"] = 1
    sp["n"] = 1
    sp.pop("logprobs", None)
    sp.pop("prompt_logprobs", None)
    params = {k: v for k, v in callback.items() if k != "metaserver"}
    params["do_remote_decode"] = True
    params["do_remote_prefill"] = False
    return {**generate, "sampling_params": sp, "stream": False, "stream_options": None,
            "kv_transfer_params": params}


__all__ = ["METASERVER_PATH", "CallbackRefused", "NoCallback", "PrefillLegFailed", "TriggerBoard",
           "TriggerCall", "TriggerLegs", "trigger_decode_body", "trigger_prefill_body"]
