"""A Responses turn that continues a stored one (``previous_response_id``), and what a turn leaves for
the next (``store``).

A follow-up is rendered as one chat: the stored conversation, then the new input. vLLM's own rule
(``construct_input_messages`` with a previous response) is followed where it speaks: earlier
instructions and system messages do not carry over (the new request's ``instructions`` apply), and
earlier reasoning output is dropped. Where vLLM 0.32 drops more, we keep it: vLLM carries only the
previous output's *messages*, so the ``function_call`` an agent answers with ``function_call_output``
would vanish and the model would see a tool result for a call it never made; here the calls stay,
and render turns them into the assistant's ``tool_calls`` (docs/responses-api.md).

The stored conversation travels as Responses input items, so the render sidecar converts a follow-up
exactly as it converts a client that sent the whole conversation itself, and the prompt's tokens
(hence the engine holding its prefix) are the same either way.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from coordinator.pipeline.errors import BadRequest, PipelineError
from coordinator.pipeline.responses.conversations import Conversations
from coordinator.pipeline.responses.convert import ResponsesForm
from coordinator.pipeline.responses.store import ResponseStore, StoredResponse, StoreUnavailable
from coordinator.pipeline.responses.translate import ResponsesTranslator
from coordinator.pipeline.responses.truncation import Measure, fit

Item = dict[str, Any]
log = logging.getLogger(__name__)


class ResponseNotFound(PipelineError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, response_id: str, param: str | None = None) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param=param)


@dataclass
class Turn:
    """One Responses request, read against the store. ``body``: what the sidecar converts (the
    stored conversation prepended to ``input``, ``previous_response_id`` taken out)."""

    body: Any
    store: bool = False
    background: bool = False
    previous_id: str | None = None
    own_input: list[Item] = field(default_factory=list)
    history: list[Item] = field(default_factory=list)
    conversation: str | None = None

    @property
    def kept(self) -> bool:
        """Whether its answer goes to the store: as a response (``store``), or into a conversation."""
        return self.store or self.conversation is not None


def as_items(value: Any) -> list[Item] | None:
    """``input`` as items (a string is one user message); None for a shape render will refuse."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        return list(value)
    return None


def as_input(item: Item) -> Item:
    """A conversation's item as request input: a user, system or developer message without the id
    and status a conversation gives it (input messages have neither); the rest as kept."""
    if item.get("type", "message") == "message" and item.get("role") != "assistant":
        return {k: v for k, v in item.items() if k not in ("id", "status")}
    return item


def _carried(item: Item) -> bool:
    """Whether an item of an earlier turn reaches the next one (vLLM: no system messages, no reasoning)."""
    if item.get("type") == "reasoning":
        return False
    return not (item.get("type", "message") == "message" and item.get("role") == "system")


def listed(items: list[Item], response_id: str) -> list[Item]:
    """The request's input as ``input_items`` lists it: every item with an id, a message's text as an
    ``input_text`` part (OpenAI's shape)."""
    out: list[Item] = []
    stem = response_id.removeprefix("resp_")
    for i, item in enumerate(items):
        entry = dict(item)
        kind = entry.setdefault("type", "message")
        if kind == "message" and isinstance(entry.get("content"), str):
            part = "output_text" if entry.get("role") == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": entry["content"]}]
        if kind == "message":
            entry.setdefault("status", "completed")
        entry.setdefault("id", f"{'msg' if kind == 'message' else 'item'}_{stem}_{i}")
        out.append(entry)
    return out


class ResponseChain:
    """Reads ``previous_response_id`` from the store before render, and keeps a finished turn."""

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store

    def require(self) -> ResponseStore:
        """The store, for work that only runs when there is one (background runs)."""
        if self.store is None:
            raise StoreUnavailable("the response store is off on this server")
        return self.store

    async def begin(self, body: Any, tenant: str) -> Turn:
        if not isinstance(body, dict):
            return Turn(body)
        conversation = body.get("conversation")
        if conversation is not None and body.get("previous_response_id") is not None:
            raise BadRequest("Mutually exclusive parameters: provide only one of 'previous_response_id' "
                             "or 'conversation'.", param="conversation")
        store = self.store is not None and body.get("store", True) is not False
        background = body.get("background") is True
        if background:
            if not store:
                raise BadRequest("background can only be used when `store` is true (and the server's "
                                 "response store is on)", param="background")
            body = {k: v for k, v in body.items() if k != "background"}  # the sidecar's form is a turn's
        previous = body.get("previous_response_id")
        own = as_items(body.get("input"))
        if conversation is not None:
            return await self._in_conversation(body, conversation, tenant, store, background, own)
        if previous is None:
            return Turn(body, store=store, background=background, own_input=own or [])
        if not isinstance(previous, str) or not previous.startswith("resp_") or "#" in previous:
            if not isinstance(previous, str):
                raise BadRequest("previous_response_id must be a string", param="previous_response_id")
            raise ResponseNotFound(previous, "previous_response_id")
        if self.store is None:
            raise BadRequest("previous_response_id needs the response store, and it is off on this server "
                             "(responses.store.backend); send the whole conversation in 'input'",
                             param="previous_response_id")
        entry = await self.store.get(tenant, previous)
        if entry is None:
            raise ResponseNotFound(previous, "previous_response_id")
        rest = {k: v for k, v in body.items() if k != "previous_response_id"}
        if own is not None:
            rest["input"] = entry.history + own
        return Turn(rest, store=store, background=background, previous_id=previous, own_input=own or [],
                    history=entry.history)

    async def _in_conversation(self, body: dict[str, Any], conversation: Any, tenant: str, store: bool,
                               background: bool, own: list[Item] | None) -> Turn:
        """A response in a conversation: its items first, then the input; both appended when answered."""
        cid = conversation.get("id") if isinstance(conversation, dict) else conversation
        if not isinstance(cid, str):
            raise BadRequest("conversation must be a conversation id or {\"id\": ...}", param="conversation")
        if self.store is None:
            raise BadRequest("conversation needs the response store, and it is off on this server",
                             param="conversation")
        entry = await Conversations(self.store).get(tenant, cid, param="conversation")
        history = [as_input(item) for item in entry.input_items if item.get("type") != "reasoning"]
        rest = {k: v for k, v in body.items() if k != "conversation"}
        if own is not None:
            rest["input"] = history + own
        return Turn(rest, store=store, background=background, own_input=own or [], history=history,
                    conversation=cid)

    async def keep(self, turn: Turn, response: dict[str, Any], tenant: str) -> None:
        """Store a finished turn: the answer, its input, and the conversation so far (with ``store``);
        its input and output appended to its conversation (with ``conversation``, whatever ``store``)."""
        if self.store is None:
            return
        output = [item for item in response.get("output") or [] if isinstance(item, dict)]
        if turn.conversation is not None:
            await Conversations(self.store).append(tenant, turn.conversation, turn.own_input + output)
        if not turn.store:
            return
        history = [item for item in turn.history + turn.own_input if _carried(item)]
        history += [item for item in output if _carried(item)]
        rid = str(response.get("id") or f"resp_{uuid.uuid4().hex}")
        await self.store.put(tenant, StoredResponse(rid, response, listed(turn.own_input, rid), history,
                                                    time.time()))


@dataclass
class Opened:
    """A Responses request ready for the pipeline: its turn (what to store) and its chat form."""

    turn: Turn
    form: ResponsesForm
    tenant: str


class ResponsesIntake:
    """How every door (HTTP, NNRP) takes a Responses request in and keeps its answer: the store's part
    first (``previous_response_id``), then the sidecar's conversion; ``keep`` once the answer is whole.
    A request the sidecar cannot convert raises ``ConversionUnavailable`` for the native chain, whose
    call carries the conversation already read from the store."""

    def __init__(self, translator: ResponsesTranslator, chain: ResponseChain,
                 measure: Measure | None = None) -> None:
        """``measure``: render's token count of a chat form and its context (``truncation: "auto"``;
        without it the sidecar refuses ``auto``)."""
        self.translator = translator
        self.chain = chain
        self.measure = measure

    async def open(self, body: Any, request_id: str, tenant: str) -> Opened:
        turn = await self.chain.begin(body, tenant)
        form = await self._form(turn.body, request_id)
        form.response["previous_response_id"] = turn.previous_id
        form.response["background"] = turn.background
        if turn.conversation is not None:  # OpenAI's field; vLLM's object has none (it has no conversations)
            form.response["conversation"] = {"id": turn.conversation}
        return Opened(turn, form, tenant)

    async def _form(self, body: Any, request_id: str) -> ResponsesForm:
        """The sidecar's chat form; with ``truncation: "auto"`` the input's oldest turns dropped until
        it fits (``truncation.py``)."""
        items = as_items(body.get("input")) if isinstance(body, dict) else None
        if self.measure is None or items is None or body.get("truncation") != "auto":
            return await self.translator.form(body, request_id)
        plain = {k: v for k, v in body.items() if k != "truncation"}
        form = await fit(plain, items, lambda b: self.translator.form(b, request_id), self.measure)
        form.response["truncation"] = "auto"
        return form

    async def keep(self, opened: Opened, response: dict[str, Any]) -> None:
        """Store the answer. A store that is down costs the client its stored copy, not the answer it
        waited for (vLLM's response object has no ``store`` field to say so; the log does)."""
        try:
            await self.chain.keep(opened.turn, response, opened.tenant)
        except StoreUnavailable as exc:
            log.warning("response %s was answered but not stored: %s", response.get("id"), exc.message)
