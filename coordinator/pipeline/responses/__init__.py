"""OpenAI Responses on the chat path: the request's chat form (``translate``) and its output (``convert``)."""

__all__ = ["answer", "convert", "translate"]
