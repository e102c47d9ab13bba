"""Anthropic Messages request → the OpenAI chat request the pipeline serves.

The conversion is vLLM's own, run in the render sidecar (``render_sidecar/messages.py``): the
sidecar already runs vLLM, and the conversion depends on the chat template (whether a system
message may sit inline), which the sidecar has loaded. The answer is a chat body; from there a
Messages request is a chat request: render (its token ids equal ``/v1/messages/render``'s),
admission, KV-affinity scheduling, the topology, token-only engines, derender with its tools and
parsers, relay. Only the output is turned back (``convert.py``).

vLLM's own render server has no conversion route: its bare 404 is a ``UpstreamUnavailable``, and the
client gets a 502 saying ``/v1/messages`` needs this project's render sidecar.
"""

from __future__ import annotations

from typing import Any

from coordinator.contracts.sidecar import COUNT_TOKENS_CHAT_PATH, MESSAGES_CHAT_PATH
from coordinator.pipeline.chat_form import convert_on_sidecar, in_client_terms
from coordinator.pipeline.errors import PipelineError, UpstreamUnavailable
from coordinator.pipeline.sidecar import SidecarClient

# Chat fields of the conversion → the Messages field the client wrote (error messages and params).
MESSAGES_PARAMS = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
    "thinking_token_budget": "thinking", "reasoning_effort": "thinking", "response_format": "output_config",
    "tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": "tool_choice",
    "messages": "messages", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
}


class MessagesTranslator:
    def __init__(self, sidecar: SidecarClient) -> None:
        self._sidecar = sidecar

    async def chat(self, body: Any, request_id: str) -> dict[str, Any]:
        """The chat form of a ``/v1/messages`` body (sampling fields included)."""
        return await self._convert(MESSAGES_CHAT_PATH, body, request_id)

    async def count_tokens_chat(self, body: Any, request_id: str) -> dict[str, Any]:
        """The chat form of a ``/v1/messages/count_tokens`` body (no sampling fields)."""
        return await self._convert(COUNT_TOKENS_CHAT_PATH, body, request_id)

    async def _convert(self, path: str, body: Any, request_id: str) -> dict[str, Any]:
        chat = await convert_on_sidecar(self._sidecar, path, body, request_id, api="messages")
        if not isinstance(chat, dict) or not isinstance(chat.get("messages"), list):
            raise UpstreamUnavailable("render sidecar returned an unexpected Messages conversion")
        return chat


def in_messages_terms(exc: PipelineError) -> PipelineError:
    """A chat-path refusal of a converted request, naming the Messages field the client wrote."""
    return in_client_terms(exc, MESSAGES_PARAMS)
