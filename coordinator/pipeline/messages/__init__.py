"""Anthropic Messages on the chat path: the request converted to chat (``translate.py``), the chat
output converted back (``convert.py``)."""

__all__ = ["convert", "translate"]
