"""The OpenAI front door (chat, completions, models, Responses). The other doors share its error body
(``errors``: OpenAI's ``{"error": ...}`` shape) and its SSE writer (``sse``)."""

__all__ = ["errors", "responses", "routes", "sse"]
