"""The request's state, handed from stage to stage (no stage reaches into another's internals)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from coordinator.contracts.generate import GenerateRequest
from coordinator.contracts.hashing import Media
from coordinator.observability.record import Record
from coordinator.pipeline.errors import UpstreamTimeout, UpstreamUnavailable

Kind = Literal["chat", "completion"]
Route = Literal["tokens", "native"]  # token-only engines via render/derender, or an engine's OpenAI API
TokenizerSource = Literal["render", "local"]
# Another API's request sent as it is to the engines' own route for it (``pipeline/native_api.py``).
NativeApi = Literal["messages", "responses"]


@dataclass(frozen=True)
class StopSpec:
    """Stop-string settings of one request, taken out of the rendered sampling params (render
    writes them, derender enforces them: ``derender/stop.py``)."""

    strings: tuple[str, ...] = ()
    include_in_output: bool = False
    min_tokens: int = 0

    @property
    def active(self) -> bool:
        return bool(self.strings)

    @property
    def holdback(self) -> int:
        if not self.strings or self.include_in_output:
            return 0
        return max(len(s) for s in self.strings) - 1


@dataclass(frozen=True)
class NativeCall:
    """A request for another API that the chat path cannot take: which API, and why (the sidecar's
    error: it becomes the answer when no engine serves the API either)."""

    api: NativeApi
    reason: UpstreamUnavailable | UpstreamTimeout


class ChunkStream(Protocol):
    """What a door's stream writer consumes: ``derender/session.py``'s ``StreamSession`` (token-only)
    and ``native_route.py``'s ``NativeStream`` offer it."""

    def events(self) -> AsyncIterator[dict[str, Any]]: ...

    async def aclose(self) -> None: ...

    @property
    def buffered_tokens(self) -> int: ...


@dataclass
class PromptPlan:
    """One rendered prompt, i.e. one engine request (completions may carry several)."""

    index: int
    generate: GenerateRequest         # the JSON exactly as sent to the engine (a typed view of a dict)
    prompt_token_ids: list[int]
    n: int
    stop: StopSpec
    attempt: int = 1                  # engine attempt now streaming (a relay starts the next one)
    block_hashes: list[int] | None = None  # the prompt's prefix-index hashes, when render sent them
    media: Media = ()                 # its images, for media-aware hashes (contracts/hashing.py)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return int(self.generate["sampling_params"]["max_tokens"])


@dataclass
class RequestContext:
    """Everything one client request owns while it moves through the pipeline."""

    kind: Kind
    request_id: str                   # coordinator id (client X-Request-Id or generated)
    body: dict[str, Any]              # client request; ``model`` rewritten to the served name
    model: str                        # served model name (an adapter's base: what render and derender know)
    stream: bool
    include_usage: bool
    priority: int = 0                 # admission order within the tenant: lower = sooner (vLLM's convention)
    tenant: str = "default"           # whose limits and share (the API key's tenant)
    rate_headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* for the answer
    created: int = field(default_factory=lambda: int(time.time()))
    prompts: list[PromptPlan] = field(default_factory=list)
    derender_request: dict[str, Any] = field(default_factory=dict)  # see derender.client.request_view
    encoded: dict[str, Any] = field(default_factory=dict)  # JSON fragments encoded once per request
    route: Route = "tokens"
    tokenizer_source: TokenizerSource = "render"  # "local": render was unavailable (render fallback)
    visible: bool = False             # a chunk was handed to the client writer (no whole-request retry)
    native_api: NativeApi | None = None  # the body is this API's, for the engines' own route (native chain)
    adapter: str | None = None        # the LoRA adapter the client named: engines run it, answers name it
    record: Record = field(default_factory=lambda: Record("internal"))  # observation record (doors share it)

    @property
    def public_model(self) -> str:
        """The ``model`` answers carry: the adapter when one was named (as vLLM answers), else the model."""
        return self.adapter or self.model

    @property
    def response_id(self) -> str:
        """OpenAI id shown to the client (derender would otherwise show the engine's internal id)."""
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    @property
    def object_name(self) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"
