"""Block hashes of each rendered prompt, computed in the sidecar that made its token ids.

Why here: hashing a prompt is ~24 ns a token in Python (reading its ids at all costs that much), so
a 100k-token prompt costs the coordinator ~2.5 ms on its event loop, more than the whole scheduling
decision it serves. The sidecar has the ids in hand and has just spent far longer tokenising them;
it adds the hashes to its answer and the coordinator only reads them.

Opt-in per call: the coordinator sends ``x-prefix-hash: <block_size> <model>`` (the model name seeds
the chain, see ``hashing.chain_seed``) and gets each ``GenerateRequest`` of the answer with a
``block_hashes`` list, and the header echoed back, so a sidecar without this route (vLLM's own) is
recognised and the coordinator hashes itself. The hash function and the header are the shared
contract (``coordinator.contracts``), shipped into the render images beside this module.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import msgspec

from coordinator.contracts.hashing import block_hashes, chain_seed, prompt_media
from coordinator.contracts.sidecar import PREFIX_HASH_HEADER, parse_prefix_hash_spec

HEADER = PREFIX_HASH_HEADER.encode()
RENDER_PATHS = ("/v1/chat/completions/render", "/v1/completions/render")

Message = MutableMapping[str, Any]

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def add_hashes(body: bytes, block_size: int, model: str) -> bytes:
    """The render answer (one GenerateRequest or a list of them) with ``block_hashes`` in each."""
    doc = _decode(body)
    for item in doc if isinstance(doc, list) else [doc]:
        if isinstance(item, dict) and isinstance(item.get("token_ids"), list):
            salt = item.get("cache_salt")
            seed = chain_seed(model, salt if isinstance(salt, str) else None)
            media = prompt_media(item.get("features"))
            item["block_hashes"] = block_hashes(item["token_ids"], block_size, seed, media=media)
    return _encode(doc)


class HashingRenderRoute:
    """ASGI app in front of vLLM's render route: without the header the call passes untouched;
    with it, a 200 JSON answer gets the hashes (any other answer is passed on as it is)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        raw = dict(scope.get("headers") or ()).get(HEADER)
        spec = parse_prefix_hash_spec(raw) if raw is not None else None
        if spec is None:
            await self.app(scope, receive, send)
            return
        start: Message = {}
        parts: list[bytes] = []

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
            else:
                await send(message)

        await self.app(scope, receive, capture)
        body = b"".join(parts)
        headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"]
        is_json = any(k.lower() == b"content-type" and b"json" in v for k, v in headers)
        if start.get("status") == 200 and is_json:
            try:
                body = add_hashes(body, *spec)
                headers.append((HEADER, raw))
            except (msgspec.DecodeError, TypeError, ValueError):
                pass  # not ours to judge: the coordinator reads vLLM's answer as it is
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})
