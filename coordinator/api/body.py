"""Reading a JSON request body within the limits every front door shares.

Size, time and nesting are bounded before any stage sees the body: a body over ``max_bytes`` is a
413 as soon as the excess arrives, one that trickles in slower than ``timeout_s`` is a 408, and
nesting deeper than ``max_depth`` is a 400 instead of a ``RecursionError`` in the parser (which
used to surface as a 500 and a reset keep-alive connection).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from coordinator.pipeline.errors import BadRequest, RequestTimeout, RequestTooLarge

# A UTF-16 surrogate written as an escape, or as (invalid) UTF-8 bytes, which ``json.loads`` lets
# through. A lone one cannot be encoded again for render, so it was a 500; paired escapes
# (``\ud83d\ude00``, how ``json.dumps`` writes an emoji) also match and pass the check below.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


async def read_json_body(chunks: AsyncIterator[bytes], *, max_bytes: int, max_depth: int,
                         timeout_s: float) -> Any:
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for part in chunks:
                raw += part
                if len(raw) > max_bytes:
                    raise RequestTooLarge(f"Request body larger than {max_bytes} bytes")
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s") from None
    return parse_json(bytes(raw), max_depth=max_depth)


def parse_json(raw: bytes, *, max_depth: int) -> Any:
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc}") from None
    if json_depth_exceeds(value, max_depth):
        raise _too_deep(max_depth)
    if _SURROGATE.search(raw):
        try:
            msgspec.json.encode(value)
        except UnicodeEncodeError:
            raise BadRequest("Request body contains an unpaired UTF-16 surrogate (\\ud800-\\udfff); "
                             "strings must be valid Unicode") from None
    return value


def json_depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether objects/arrays nest deeper than ``max_depth`` (iterative: no recursion to exhaust)."""
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > max_depth:
                    return True
                stack.append((child, depth + 1))
    return False


def _too_deep(max_depth: int) -> BadRequest:
    return BadRequest(f"Request body nests objects or arrays deeper than {max_depth} levels")
