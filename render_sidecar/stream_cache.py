"""Streaming chat derender with parsers, served from live parser sessions when the state matches.

vLLM 0.32's ``OnlineDerenderer._derender_chat_stream_parsed`` builds a parser (``parser_cls(...)``),
seeds an incremental detokenizer from the prompt, replays ``state.output_token_ids`` chunk by chunk
through ``self._detokenize_delta`` and ``parser.parse_delta``, then handles the new chunk. This module
runs *that same method* in both cases, with a stand-in for its ``self``:

* **miss** (no session, or the state is not the one the session last returned): the method runs as
  vLLM wrote it, with the full state; the stand-in only records the parser it built and the
  detokenizer state it ended with. This is vLLM's stateless replay, unchanged.
* **hit**: the method gets the state with an empty history (nothing to replay), the session's parser
  instead of a new one and the session's detokenizer state instead of the prompt-seeded one; the
  history is put back on the state it returns. Only the new chunk goes through ``parse_delta``.

Equivalence with the replay is what the tests check at every chunk size; ``check_vllm_shape`` fails
loudly when the method or the state stops looking the way this relies on.

**Logprobs.** vLLM 0.32's parsed method drops the chunk's logprobs (its note: "that parsed path does
not resolve logprobs yet"), where native ``vllm serve`` with the same parser streams them on every
chunk unless ``include_reasoning`` is false (``hide_stream_metadata`` in its chat serving). Both paths
here resolve them as vLLM's plain path does (``_resolve_logprobs`` with the carried
``logprob_context_token_ids``) and apply native's rule, so a parser on the sidecar no longer costs a
client its streamed logprobs.

Calls this module does not answer (no parser, not a streaming body, a body vLLM would refuse, the
usage chunk) return None and go to vLLM's own route, so their answers (errors included) are vLLM's.
The one answer of its own: a call whose state needs a replay but that carries no ``prompt_token_ids``
(the coordinator leaves them out while the stream hits) gets 409 ``stream_session_miss``, and the
caller sends the call again with them.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any

import msgspec
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    DerenderChatStreamRequest,
    DerenderChatStreamResponse,
    DerenderStreamState,
    GenerateTokensStreamResponse,
)
from vllm.renderers.online_derenderer import OnlineDerenderer, _logprob_context_tail, _resolve_logprobs

from render_sidecar.sessions import Session, SessionCache, estimate_bytes

SESSION_MISS_TYPE = "stream_session_miss"
HISTORY_FIELDS = ("output_token_ids", "output_chunk_lens")

_encode = msgspec.json.Encoder().encode
_STATE_FIELDS = tuple(DerenderStreamState.model_fields)


class _Call(msgspec.Struct):
    """The parts of a derender body this module looks at before deciding anything (cheap to decode:
    the big parts stay raw JSON until needed)."""

    stream: bool = False
    model: str | None = None
    generate_chunk: msgspec.Raw = msgspec.Raw(b"null")
    stream_state: msgspec.Raw = msgspec.Raw(b"null")
    prompt_tokens: int | None = None
    prompt_token_ids: msgspec.Raw = msgspec.Raw(b"null")
    chat_request: msgspec.Raw = msgspec.Raw(b"null")


_decode_call = msgspec.json.Decoder(_Call).decode
_decode_ids = msgspec.json.Decoder(list[int]).decode
_decode_any = msgspec.json.Decoder().decode


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


class _Self:
    """Stands in for the ``OnlineDerenderer`` as ``self`` of its parsed stream method, for one call:
    hands it a parser and a detokenizer state to resume from (hit) or records the ones it built (miss)."""

    def __init__(self, real: OnlineDerenderer, resume_detok: DerenderStreamState | None) -> None:
        self._real = real
        self._resume = resume_detok
        self.detok: DerenderStreamState | None = resume_detok
        self.text_chars = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def _detokenize_delta(self, tokenizer: Any, delta_token_ids: list[int], state: DerenderStreamState,
                          **kwargs: Any) -> tuple[str, DerenderStreamState]:
        if self._resume is not None:  # the method seeded a fresh window from the prompt: continue ours
            state, self._resume = self._resume, None
        text, self.detok = self._real._detokenize_delta(tokenizer, delta_token_ids, state, **kwargs)
        self.text_chars += len(text)
        return text, self.detok


class _Recording:
    """``parser_cls`` for a miss: builds vLLM's parser as usual and remembers it."""

    def __init__(self, parser_cls: Any) -> None:
        self._cls = parser_cls
        self.parser: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.parser = self._cls(*args, **kwargs)
        return self.parser


class CachedChatStream:
    """Answers streaming chat derender calls of a parser-configured sidecar from ``cache``."""

    def __init__(self, serving: Any, cache: SessionCache) -> None:
        self._serving = serving                          # vLLM's ServingDerender
        self._derenderer: OnlineDerenderer = serving.online_derenderer
        self.cache = cache

    @property
    def parser_cls(self) -> Any:
        return self._derenderer.parser

    async def handle(self, body: bytes) -> Answer | None:
        """The answer to a ``/v1/chat/completions/derender`` body, or None for vLLM's route."""
        if self.parser_cls is None:
            return None
        try:
            call = _decode_call(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if not call.stream:
            return None
        try:
            chunk = GenerateTokensStreamResponse.model_validate_json(bytes(call.generate_chunk))
        except ValueError:
            return None
        if len(chunk.choices) != 1:
            return None  # the usage chunk, or a malformed one: nothing to resume
        key = (chunk.request_id, chunk.choices[0].index)
        session = self.cache.take(key)
        if session is not None and self._matches(session, call):
            self.cache.hits += 1
            return await self._resume(session, call, chunk)
        fresh = bytes(call.stream_state) == b"null"
        if not fresh:
            self.cache.misses["state_mismatch" if session is not None else "absent"] += 1
            if bytes(call.prompt_token_ids) == b"null":
                return self._session_miss()
        return await self._replay(key, call, body)

    def _matches(self, session: Session, call: _Call) -> bool:
        """The call continues exactly where ``session`` stopped: same state, options and model."""
        if call.model != session.model or bytes(call.chat_request) != session.options_json:
            return False
        raw = bytes(call.stream_state)
        if raw != session.state_json and (
                raw == b"null" or _decode_any(raw) != _decode_any(session.state_json)):
            return False  # bytes differ only if a client re-encoded it: compare the values
        ids = bytes(call.prompt_token_ids)
        return ids == b"null" or _decode_ids(ids) == session.prompt_token_ids

    async def _replay(self, key: tuple[str, int], call: _Call, body: bytes) -> Answer | None:
        """vLLM's stateless path, recording the parser and detokenizer it ends with."""
        try:
            request = DerenderChatStreamRequest.model_validate_json(body)
        except ValueError:
            return None
        if (request.chat_request is None or request.prompt_token_ids is None
                or await self._serving._check_model(request) is not None):
            return None
        state = request.stream_state or DerenderStreamState()
        prompt = request.prompt_token_ids
        if self._too_long(len(prompt), len(state.output_token_ids), request.generate_chunk) is not None:
            return None
        stand_in = _Self(self._derenderer, None)
        recording = _Recording(self.parser_cls)
        try:
            chunk, new_state = await self._run(
                stand_in, recording, request.model or self._serving.models.model_name(),
                request.generate_chunk, state, request.chat_request, request.prompt_tokens, prompt)
        except Exception:
            return None  # vLLM's route replays it again and answers its own 400
        session = Session(key=key, parser=recording.parser, detok=stand_in.detok, state=new_state,
                          state_json=b"", options_json=bytes(call.chat_request),
                          chat_request=request.chat_request, model=request.model,
                          prompt_token_ids=prompt, text_chars=stand_in.text_chars)
        return self._answer(session, chunk, new_state)

    async def _resume(self, session: Session, call: _Call, chunk: GenerateTokensStreamResponse) -> Answer:
        prior = session.state
        error = self._too_long(len(session.prompt_token_ids), len(prior.output_token_ids), chunk)
        if error is not None:
            return Answer(400, _encode(self._serving.create_error_response(error).model_dump()))
        stand_in = _Self(self._derenderer, session.detok)
        empty = prior.model_copy(update={key: [] for key in HISTORY_FIELDS})
        try:
            out, state = await self._run(
                stand_in, lambda *a, **k: session.parser, call.model or self._serving.models.model_name(),
                chunk, empty, session.chat_request, call.prompt_tokens, session.prompt_token_ids)
        except Exception:
            # Same answer as vLLM's route for a parser failure; the session is gone with it.
            error_response = self._serving.create_error_response("invalid stream_state: derender failed")
            return Answer(400, _encode(error_response.model_dump()))
        state = state.model_copy(update={
            "output_token_ids": prior.output_token_ids + state.output_token_ids,
            "output_chunk_lens": prior.output_chunk_lens + state.output_chunk_lens,
        })
        session.detok = stand_in.detok
        session.text_chars += stand_in.text_chars
        return self._answer(session, out, state)

    def _answer(self, session: Session, chunk: Any, state: DerenderStreamState) -> Answer:
        """Encode the reply; keep the session for the next call unless the stream finished."""
        # What DerenderChatStreamResponse(...).model_dump() gives, without pydantic walking every
        # output token id of the state on every call (its fields are plain lists, ints and bools).
        state_json = _encode({name: getattr(state, name) for name in _STATE_FIELDS})
        body = b'{"chunk":' + _encode(chunk.model_dump()) + b',"stream_state":' + state_json + b"}"
        if any(c.finish_reason is not None for c in chunk.choices):
            self.cache.finished += 1
        else:
            session.state, session.state_json = state, state_json
            session.nbytes = estimate_bytes(len(session.prompt_token_ids), len(state.output_token_ids),
                                            session.text_chars, len(state_json))
            self.cache.put(session)
        return Answer(200, body)

    async def _run(self, stand_in: _Self, parser_cls: Any, model: str,
                   chunk: GenerateTokensStreamResponse, state: DerenderStreamState, chat_request: Any,
                   prompt_tokens: int | None, prompt_token_ids: list[int]) -> Any:
        """vLLM's parsed stream method on the renderer's executor, as vLLM's own route runs it, then
        the chunk's logprobs (module docstring)."""
        def run() -> tuple[Any, DerenderStreamState]:
            out, new_state = OnlineDerenderer._derender_chat_stream_parsed(
                stand_in,  # type: ignore[arg-type]  # duck-typed self, see _Self
                parser_cls, model, chunk, state, chat_request, prompt_tokens, prompt_token_ids)
            return out, self._with_logprobs(out, new_state, chunk, chat_request)

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._derenderer.renderer._executor, run)

    def _with_logprobs(self, out: Any, state: DerenderStreamState, chunk: GenerateTokensStreamResponse,
                       chat_request: Any) -> DerenderStreamState:
        """Put the engine chunk's logprobs on ``out``'s choice, as native does with a parser; the
        state's logprob context moves on by the chunk's tokens."""
        if not chunk.choices or not out.choices:
            return state
        source = chunk.choices[0]
        if source.logprobs is None or not chat_request.logprobs or chat_request.include_reasoning is False:
            return state
        tokenizer = self._derenderer.renderer.get_tokenizer()
        out.choices[0].logprobs = _resolve_logprobs(
            source.logprobs, tokenizer, initial_context_token_ids=state.logprob_context_token_ids)
        return state.model_copy(update={"logprob_context_token_ids": _logprob_context_tail(
            state.logprob_context_token_ids, source.token_ids or [])})

    def _too_long(self, prompt_len: int, prior_len: int, chunk: GenerateTokensStreamResponse) -> str | None:
        """vLLM's length bound of a streaming chat derender call (ServingDerender), same message."""
        delta_len = sum(len(c.token_ids) for c in chunk.choices if c.token_ids)
        max_model_len = self._serving.model_config.max_model_len
        if prompt_len + prior_len + delta_len > max_model_len:
            return (f"prompt_token_ids length ({prompt_len}) plus output_token_ids length ({prior_len}) "
                    f"plus delta ({delta_len}) exceeds max_model_len ({max_model_len}).")
        return None

    def _session_miss(self) -> Answer:
        error = self._serving.create_error_response(
            "this sidecar holds no parser session for this stream_state; send the call again with "
            "prompt_token_ids (the full prompt) so it can replay the stream", err_type=SESSION_MISS_TYPE)
        dumped = error.model_dump()
        dumped["error"]["code"] = 409
        return Answer(409, _encode(dumped))


def check_vllm_shape() -> None:
    """Raise if the vLLM internals this module drives are not the ones it was written against."""
    method = OnlineDerenderer._derender_chat_stream_parsed
    params = list(inspect.signature(method).parameters)
    expected = ["self", "parser_cls", "model", "generate_chunk", "state", "chat_request", "prompt_tokens",
                "prompt_token_ids"]
    if params != expected:
        raise RuntimeError(f"OnlineDerenderer._derender_chat_stream_parsed takes {params}, not {expected}")
    source = inspect.getsource(method)
    for needle in ("parser_cls(", "self._detokenize_delta(", "_seed_stream_state(",
                   "_replay(state.output_token_ids, state.output_chunk_lens)", "parser.parse_delta("):
        if needle not in source:
            raise RuntimeError(f"OnlineDerenderer._derender_chat_stream_parsed no longer calls {needle!r}")
    if source.count("parser_cls(") != 1:
        raise RuntimeError("OnlineDerenderer._derender_chat_stream_parsed builds more than one parser")
    fields = set(DerenderStreamState.model_fields)
    needed = {*HISTORY_FIELDS, "prev_tokens", "prefix_offset", "read_offset", "role_sent", "tools_streamed",
              "last_tool_call_ids"}
    if not needed <= fields:
        raise RuntimeError(f"DerenderStreamState lacks {sorted(needed - fields)}")
    if list(DerenderChatStreamResponse.model_fields) != ["chunk", "stream_state"]:
        raise RuntimeError(f"DerenderChatStreamResponse has {list(DerenderChatStreamResponse.model_fields)}")
    plain = (list, str, int, bool)
    for name, field in DerenderStreamState.model_fields.items():
        origin = getattr(field.annotation, "__origin__", field.annotation)
        if origin not in plain:
            raise RuntimeError(f"DerenderStreamState.{name} is {field.annotation}, not plain JSON data")
    if "logprob_context_token_ids" not in fields:
        raise RuntimeError("DerenderStreamState lacks logprob_context_token_ids")
    resolve = list(inspect.signature(_resolve_logprobs).parameters)
    if resolve != ["logprobs", "tokenizer", "initial_context_token_ids"]:
        raise RuntimeError(f"_resolve_logprobs takes {resolve}")
    detok = list(inspect.signature(OnlineDerenderer._detokenize_delta).parameters)
    if detok[:4] != ["self", "tokenizer", "delta_token_ids", "state"]:
        raise RuntimeError(f"OnlineDerenderer._detokenize_delta takes {detok}")
