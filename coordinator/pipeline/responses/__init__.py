"""OpenAI Responses on the chat path: the request's chat form (``translate``), its output (``convert``,
``answer``), and stored responses (``store``) that later turns continue from (``chain``)."""

__all__ = ["answer", "chain", "convert", "store", "translate"]
