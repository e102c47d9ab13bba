"""OpenAI Responses request → the chat request the pipeline serves, plus what writing it back needs.

The render sidecar assembles the chat form from vLLM's own Responses render pieces
(``render_sidecar/responses.py``), so rendering it gives ``/v1/responses/render``'s token ids, and
answers vLLM's response object for the request. The pipeline then serves the chat form as any chat
request; ``convert.py`` turns its output into Responses items and events.
"""

from __future__ import annotations

from typing import Any

from coordinator.contracts.sidecar import RESPONSES_CHAT_PATH
from coordinator.pipeline.chat_form import convert_on_sidecar, in_client_terms
from coordinator.pipeline.errors import PipelineError, UpstreamUnavailable
from coordinator.pipeline.responses.convert import ResponsesForm
from coordinator.pipeline.sidecar import SidecarClient

# Chat fields of the conversion → the Responses field the client wrote (error messages and params).
RESPONSES_PARAMS = {
    "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
    "response_format": "text", "reasoning_effort": "reasoning", "logprobs": "include",
    "stream_options": "stream",
    "input_tokens": "input",  # render's "prompt too long" names its count; the client wrote the input
}
_LOGPROBS = "message.output_text.logprobs"


class ResponsesTranslator:
    def __init__(self, sidecar: SidecarClient) -> None:
        self._sidecar = sidecar

    async def form(self, body: Any, request_id: str) -> ResponsesForm:
        """The sidecar's conversion of a ``/v1/responses`` body."""
        out = await convert_on_sidecar(self._sidecar, RESPONSES_CHAT_PATH, body, request_id,
                                       api="responses")
        chat = out.get("chat") if isinstance(out, dict) else None
        if not isinstance(chat, dict) or not isinstance(out.get("response"), dict):
            raise UpstreamUnavailable("render sidecar returned an unexpected Responses conversion")
        include = body.get("include") or []
        return ResponsesForm(chat=chat, response=out["response"], tool_names=out.get("tool_names") or {},
                             custom_tools=frozenset(out.get("custom_tools") or ()),
                             parser=bool(out.get("parser")),
                             include_reasoning=body.get("include_reasoning") is not False,
                             logprobs=isinstance(include, list) and _LOGPROBS in include)


def in_responses_terms(exc: PipelineError) -> PipelineError:
    """A chat-path refusal of a converted request, naming the Responses field the client wrote."""
    return in_client_terms(exc, RESPONSES_PARAMS)
