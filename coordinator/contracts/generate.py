"""Typed views of vLLM 0.32's token-in/token-out wire: ``/inference/v1/generate`` requests, answers and
stream chunks, and the sampling parameters render fills in.

They are views, not models: the JSON stays a plain dict (nothing is parsed or copied on the hot
path), mypy checks every subscript against the field names, and a field this module does not know
still travels (``total=False``, and nothing here drops keys). Names and shapes follow
``vllm/entrypoints/scale_out/token_in_token_out/protocol.py`` and ``vllm/sampling_params.py``;
``tests/unit/test_wire_views.py`` holds them to the installed vLLM, field for field.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict


class SamplingParams(TypedDict, total=False):
    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    watermarking: Any
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool
    max_tokens: int  # vLLM allows None (the rest of the context); render always sets it
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    prompt_logprob_token_ids: list[int] | None
    prompt_logprob_start: int | None
    logprob_token_ids: list[int] | None
    flat_logprobs: bool
    detokenize: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    output_kind: int
    stream_interval: int
    skip_clone: bool
    output_text_buffer_length: int
    structured_outputs: dict[str, Any] | None
    logit_bias: dict[int, float] | None
    allowed_token_ids: list[int] | None
    extra_args: dict[str, Any] | None
    bad_words: list[str] | None
    skip_reading_prefix_cache: bool | None
    thinking_token_budget: int | None
    repetition_detection: dict[str, Any] | None
    routed_experts_prompt_start: int | None
    trace_decode_token_ids: list[int] | None


class StreamOptions(TypedDict, total=False):
    include_usage: bool | None
    continuous_usage_stats: bool | None


class GenerateRequest(TypedDict, total=False):
    """What render answers and the engine takes (``block_hashes`` is ours: the sidecar adds it on
    request and the coordinator takes it out before the engine sees the body)."""

    request_id: str
    token_ids: list[int]
    token_offsets: list[tuple[int, int]] | None
    features: dict[str, Any] | None
    content_parts: list[dict[str, Any]] | None
    sampling_params: SamplingParams
    model: str | None
    reasoning_ended: bool | None
    reasoning_parser_kwargs: dict[str, Any] | None
    return_token_ids: bool | None
    output_mode: Literal["tokens", "text"]
    stream: bool | None
    stream_options: StreamOptions | None
    cache_salt: str | None
    priority: int
    kv_transfer_params: dict[str, Any] | None
    ec_transfer_params: dict[str, Any] | None
    block_hashes: list[int]


class LogProb(TypedDict, total=False):
    token_id: int
    logprob: float
    rank: int | None


class LogProbsContent(LogProb, total=False):
    top_logprobs: list[LogProb]


class LogProbs(TypedDict, total=False):
    content: list[LogProbsContent] | None


class Choice(TypedDict, total=False):
    """One choice of an answer or of a stream chunk (the fields are the same in 0.32)."""

    index: int
    finish_reason: str | None
    stop_reason: int | str | None
    token_ids: list[int] | None
    routed_experts: str | None
    sampling_mask: list[list[int]] | None
    weight_versions: list[dict[str, Any]] | None
    logprobs: LogProbs | None


class Usage(TypedDict, total=False):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None
    prompt_tokens_details: dict[str, Any] | None
    completion_tokens_details: dict[str, Any] | None


class StreamChunk(TypedDict, total=False):
    """One SSE event of a ``stream: true`` generate call."""

    request_id: str
    usage: Usage | None
    prompt_token_ids: list[int] | None
    mm_placeholders: dict[str, list[dict[str, int]]] | None
    metrics: dict[str, Any] | None
    output_mode: Literal["tokens"]
    choices: list[Choice]


class GenerateResponse(TypedDict, total=False):
    """The answer of a ``stream: false`` generate call."""

    request_id: str
    model: str | None
    created: int | None
    usage: Usage | None
    prompt_logprobs: list[dict[str, Any] | None] | None
    prompt_token_id_logprobs: str | None
    prompt_token_ids: list[int] | None
    mm_placeholders: dict[str, list[dict[str, int]]] | None
    metrics: dict[str, Any] | None
    kv_transfer_params: dict[str, Any] | None
    ec_transfer_params: dict[str, Any] | None
    output_mode: Literal["tokens"]
    choices: list[Choice]
