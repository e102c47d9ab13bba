"""The Anthropic Messages front door (``/v1/messages``, ``/v1/messages/count_tokens``)."""

__all__ = ["routes"]
