"""OpenAI Responses on the chat path: the request's chat form (``translate``), its output (``convert``,
``answer``), stored responses (``store``) that later turns continue from (``chain``), background runs
(``background``), Conversations (``conversations``) and ``truncation: "auto"`` (``truncation``)."""

__all__ = ["answer", "background", "chain", "conversations", "convert", "store", "translate", "truncation"]
