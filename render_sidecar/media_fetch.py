"""An image URL that cannot be downloaded is the client's error, not the render server's.

Why: vLLM's media connector raises a download that times out, a refused connection, a name that does
not resolve or a 5xx from the image's server as it is, so that its retry loop can try again, and the
render route then answers 500 with an empty message. Behind the coordinator (one try,
``launch.media_env``) that 500 is a bad gateway for a client whose URL was the problem, and it cannot
tell what went wrong. OpenAI answers such a URL with a 4xx naming it; so does this sidecar: the same
exception becomes vLLM's own ``VLLMUnprocessableEntityError`` (422, the status vLLM already gives a
URL answering 404), with the URL and the reason.

A patch of one method of vLLM's ``MediaConnector`` in the sidecar's process, installed by
``server.install``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
        return "the download timed out"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def install() -> bool:
    """Patch vLLM's media connector in this process; False when this vLLM has no such method."""
    try:
        import aiohttp
        from vllm.exceptions import VLLMUnprocessableEntityError, VLLMValidationError
        from vllm.multimodal.media.connector import MediaConnector
    except ImportError:
        return False
    original: Callable[..., Any] | None = getattr(MediaConnector, "load_from_url_async", None)
    if original is None or getattr(original, "__client_errors__", False):
        return original is not None

    @functools.wraps(original)
    async def load(self: Any, url: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, url, *args, **kwargs)
        except (VLLMValidationError, ValueError):
            raise   # already a 4xx of vLLM's (a bad image, a 404, a domain not allowed)
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            shown = url if len(url) <= 200 else url[:200] + "..."
            raise VLLMUnprocessableEntityError(
                f"Failed to fetch media from URL {shown}: {_reason(exc)}", parameter="image_url",
                value=shown) from exc

    load.__client_errors__ = True  # type: ignore[attr-defined]
    MediaConnector.load_from_url_async = load  # type: ignore[method-assign]
    return True
