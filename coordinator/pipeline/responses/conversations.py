"""OpenAI's Conversations: a named, stored list of items that responses read and append to.

A conversation lives in the response store (``store.py``) as one entry per tenant and id
(``conv_…``): ``response`` holds the conversation object (``id``, ``object``, ``created_at``,
``metadata``), ``input_items`` its items, each with an id. A response naming ``conversation`` is
rendered with the conversation's items before its own input (``chain.py``); when it is answered, its
input and output items are appended. Two responses answered at once on one conversation append in the
order their answers are stored, each to the conversation as it was when its own was read back (last
write wins for the item list, as a single-writer store gives; docs/responses-api.md).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from coordinator.pipeline.errors import BadRequest, PipelineError
from coordinator.pipeline.responses.store import ResponseStore, StoredResponse

Item = dict[str, Any]
MAX_NEW_ITEMS = 20   # OpenAI's limit on items in one create or add call


class ConversationNotFound(PipelineError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, conversation_id: str, param: str | None = "conversation_id") -> None:
        super().__init__(f"Conversation with id '{conversation_id}' not found.", param=param)


def with_id(item: Item) -> Item:
    """An item as a conversation keeps it: typed, with an id, a message's text as a content part."""
    entry = dict(item)
    kind = entry.setdefault("type", "message")
    if kind == "message":
        if isinstance(entry.get("content"), str):
            part = "output_text" if entry.get("role") == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": entry["content"]}]
        entry.setdefault("status", "completed")
    entry.setdefault("id", f"{'msg' if kind == 'message' else 'item'}_{uuid.uuid4().hex}")
    return entry


def _items(value: Any, param: str) -> list[Item]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(i, dict) for i in value):
        raise BadRequest(f"{param} must be a list of items", param=param)
    if len(value) > MAX_NEW_ITEMS:
        raise BadRequest(f"at most {MAX_NEW_ITEMS} items may be added at once", param=param)
    return [with_id(i) for i in value]


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if value is None:
        return None
    ok = (isinstance(value, dict) and len(value) <= 16
          and all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                  for k, v in value.items()))
    if not ok:
        raise BadRequest("metadata must be at most 16 string pairs (keys up to 64 characters, values up "
                         "to 512)", param="metadata")
    return dict(value)


class Conversations:
    """The Conversations API's operations on a store, for one tenant at a time."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def create(self, tenant: str, body: Any) -> dict[str, Any]:
        body = body if isinstance(body, dict) else {}
        cid = f"conv_{uuid.uuid4().hex}"
        conv: dict[str, Any] = {"id": cid, "object": "conversation", "created_at": int(time.time()),
                                "metadata": _metadata(body.get("metadata")) or {}}
        await self.store.put(tenant, StoredResponse(cid, conv, _items(body.get("items"), "items"), [],
                                                    time.time()))
        return conv

    async def get(self, tenant: str, conversation_id: str,
                  param: str | None = "conversation_id") -> StoredResponse:
        entry = None
        if conversation_id.startswith("conv_") and "#" not in conversation_id:
            entry = await self.store.get(tenant, conversation_id)
        if entry is None:
            raise ConversationNotFound(conversation_id, param)
        return entry

    async def update(self, tenant: str, conversation_id: str, body: Any) -> dict[str, Any]:
        entry = await self.get(tenant, conversation_id)
        metadata = _metadata(body.get("metadata") if isinstance(body, dict) else None)
        if metadata is None:
            raise BadRequest("metadata is required", param="metadata")
        conv = {**entry.response, "metadata": metadata}
        await self.store.put(tenant, StoredResponse(entry.id, conv, entry.input_items, [], entry.created_at))
        return conv

    async def delete(self, tenant: str, conversation_id: str) -> dict[str, Any]:
        await self.get(tenant, conversation_id)
        await self.store.delete(tenant, conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    async def add(self, tenant: str, conversation_id: str, items: Any, param: str = "items") -> list[Item]:
        """Append items (given ids where they have none); the added items, as stored."""
        entry = await self.get(tenant, conversation_id)
        added = _items(items, param)
        await self.store.put(tenant, StoredResponse(entry.id, entry.response, entry.input_items + added, [],
                                                    entry.created_at))
        return added

    async def append(self, tenant: str, conversation_id: str, items: list[Item]) -> None:
        """A response's input and output, appended once it is answered (no count limit: one turn)."""
        entry = await self.get(tenant, conversation_id)
        await self.store.put(tenant, StoredResponse(entry.id, entry.response,
                                                    entry.input_items + [with_id(i) for i in items], [],
                                                    entry.created_at))

    async def remove(self, tenant: str, conversation_id: str, item_id: str) -> dict[str, Any]:
        entry = await self.get(tenant, conversation_id)
        kept = [i for i in entry.input_items if i.get("id") != item_id]
        if len(kept) == len(entry.input_items):
            raise BadRequest(f"Item with id '{item_id}' not found in conversation '{conversation_id}'.",
                             param="item_id", status=404)
        await self.store.put(tenant, StoredResponse(entry.id, entry.response, kept, [], entry.created_at))
        return entry.response

    async def item(self, tenant: str, conversation_id: str, item_id: str) -> Item:
        entry = await self.get(tenant, conversation_id)
        for i in entry.input_items:
            if i.get("id") == item_id:
                return i
        raise BadRequest(f"Item with id '{item_id}' not found in conversation '{conversation_id}'.",
                         param="item_id", status=404)
