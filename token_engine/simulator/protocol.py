"""Wire models of `/inference/v1/generate`, copied field-for-field from vLLM 0.32.

Why copies and not imports: the simulator must run without vLLM installed. Field names, order, defaults
and types follow `vllm/entrypoints/scale_out/token_in_token_out/protocol.py` (GenerateRequest,
GenerateTokensResponse, GenerateTokensStreamResponse, choices, logprobs),
`vllm/entrypoints/serve/engine/protocol.py` (UsageInfo, ErrorResponse, ModelList) and
`vllm/sampling_params.py` (SamplingParams), so `model_dump`/`model_dump_json` emit the same bytes as vLLM.
Request-side checks that vLLM raises outside pydantic (SamplingParams.__post_init__, validate_cache_salt)
raise `SimValidationError`, which pydantic lets escape, so they surface as vLLM's `BadRequestError` in the
same order as vLLM's.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    ValidationError,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from .errors import SimValidationError

_MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")
_MAX_N_SEQUENCES = 16384  # VLLM_MAX_N_SEQUENCES default


def random_uuid() -> str:
    """vLLM's default request id: 16 hex chars."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


class _OpenAIBase(BaseModel):
    """vLLM's OpenAIBaseModel accepts (and ignores) unknown keys."""

    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- request


class StreamOptions(_OpenAIBase):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingParams(BaseModel):
    """The SamplingParams keys the simulator reads, with vLLM's types and defaults.

    Unknown keys are ignored, as vLLM's msgspec-backed schema does. The remaining vLLM keys are accepted as
    opaque values so a request that vLLM accepts is accepted here too.
    """

    model_config = ConfigDict(extra="ignore")

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    watermarking: bool | None = None
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprob_token_ids: Any = None
    prompt_logprob_start: int | None = None
    logprob_token_ids: list[int] | None = None
    flat_logprobs: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = 0
    stream_interval: int | None = None
    skip_clone: bool = False
    output_text_buffer_length: int = 0
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None
    skip_reading_prefix_cache: bool | None = None
    thinking_token_budget: int | None = None
    repetition_detection: dict[str, Any] | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _post_init(self) -> SamplingParams:
        """vLLM's SamplingParams.__post_init__ normalisation and _verify_args, same messages and order."""
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        self.bad_words = [] if self.bad_words is None else list(dict.fromkeys(self.bad_words))
        self._verify_args()
        if self.temperature < 1e-5:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise SimValidationError(f"n must be 1 when using greedy sampling, got {self.n}.")
        return self

    def _verify_args(self) -> None:
        """A flat list of vLLM's checks, kept in vLLM's order so the first failure matches."""
        if self.n < 1:
            raise SimValidationError(f"n must be at least 1, got {self.n}.")
        if self.n > _MAX_N_SEQUENCES:
            raise SimValidationError(
                f"n must be at most {_MAX_N_SEQUENCES}, got {self.n}. "
                "To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
            )
        if self.extra_args:
            _verify_extra_args(self.extra_args)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SimValidationError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SimValidationError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not math.isfinite(self.repetition_penalty):
            raise SimValidationError(
                f"repetition_penalty must be a finite number, got {self.repetition_penalty}."
            )
        if self.repetition_penalty <= 0.0:
            raise SimValidationError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        t = self.temperature
        if not math.isfinite(t):
            raise SimValidationError(f"temperature must be a finite number, got {t}.", "temperature", t)
        if t < 0.0:
            raise SimValidationError(f"temperature must be non-negative, got {t}.", "temperature", t)
        if t > 2.0:
            raise SimValidationError(f"temperature must be in [0, 2], got {t}.", "temperature", t)
        if not 0.0 < self.top_p <= 1.0:
            raise SimValidationError(f"top_p must be in (0, 1], got {self.top_p}.", "top_p", self.top_p)
        if self.top_k < -1:
            raise SimValidationError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise SimValidationError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise SimValidationError(
                f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens", self.max_tokens
            )
        if self.min_tokens < 0:
            raise SimValidationError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SimValidationError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        if self.stream_interval is not None and self.stream_interval < 1:
            raise SimValidationError(
                f"stream_interval must be at least 1, got {self.stream_interval}.",
                "stream_interval",
                self.stream_interval,
            )
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise SimValidationError(
                f"logprobs must be non-negative or -1, got {self.logprobs}.", "logprobs", self.logprobs
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs != -1 and self.prompt_logprobs < 0:
            raise SimValidationError(
                f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}.",
                "prompt_logprobs",
                self.prompt_logprobs,
            )
        assert isinstance(self.stop, list)
        if any(not s for s in self.stop):
            raise SimValidationError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise SimValidationError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
            )
        if any(not w for w in self.bad_words or []):
            raise SimValidationError(
                f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}"
            )


def _verify_extra_args(extra_args: dict[str, Any]) -> None:
    """MessagePack only carries 64-bit integers, so vLLM rejects larger ones in extra_args."""
    pending: list[Any] = [extra_args]
    while pending:
        value = pending.pop()
        if isinstance(value, int) and not -(2**63) <= value < 2**64:
            raise SimValidationError(
                "extra_args integers must be between -2**63 and 2**64 - 1.", "extra_args"
            )
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list | tuple):
            pending.extend(value)


def _as_sampling_params(value: Any, handler: Any) -> Any:
    """Reproduce vLLM's union schema errors (`is_instance_of SamplingParams` first, then the dict branch)."""
    if isinstance(value, SamplingParams):
        return value
    head = InitErrorDetails(type="is_instance_of", loc=(), input=value, ctx={"class": "SamplingParams"})
    if not isinstance(value, dict):
        raise ValidationError.from_exception_data(
            "SamplingParams", [head, InitErrorDetails(type="dict_type", loc=(), input=value)]
        )
    try:
        return handler(value)
    except ValidationError as exc:
        details: list[InitErrorDetails] = [head]
        for err in exc.errors():
            detail = InitErrorDetails(type=err["type"], loc=tuple(err["loc"]), input=err["input"])
            if "ctx" in err:
                detail["ctx"] = err["ctx"]
            details.append(detail)
        try:
            rebuilt = ValidationError.from_exception_data("SamplingParams", details)
        except (KeyError, TypeError, ValueError):  # an error type that cannot be rebuilt: keep pydantic's
            raise exc from None
        raise rebuilt from None


class ReasoningParserKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class GenerateRequest(BaseModel):
    """vLLM's GenerateRequest (multimodal fields accepted but not interpreted)."""

    request_id: str = Field(default_factory=random_uuid)
    token_ids: list[int] = Field(min_length=1)

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v

    token_offsets: list[tuple[int, int]] | None = None
    features: dict[str, Any] | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: Annotated[SamplingParams, WrapValidator(_as_sampling_params)]
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: ReasoningParserKwargs | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _validate_cache_salt(cls, data: Any) -> Any:
        if isinstance(data, dict):
            salt = data.get("cache_salt")
            if salt is not None:
                if not isinstance(salt, str) or not salt:
                    raise SimValidationError(
                        "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
                    )
                if len(salt) > _MAX_CACHE_SALT_LENGTH or any(c in _CACHE_SALT_FORBIDDEN_CHARS for c in salt):
                    raise SimValidationError(
                        "Parameter 'cache_salt' must be at most 128 characters and must "
                        "not contain '@', '/', '\\\\', or NUL.",
                        "cache_salt",
                    )
        return data

    @model_validator(mode="after")
    def _check_mm_fields_exclusive(self) -> GenerateRequest:
        if self.content_parts and self.features:
            raise ValueError("content_parts and features are mutually exclusive")
        return self

    @model_validator(mode="after")
    def _check_output_mode_detokenizes(self) -> GenerateRequest:
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ValueError(
                f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be true"
            )
        return self

    def max_tokens_provided(self) -> bool:
        """vLLM only applies server-side max_tokens defaulting when the key was absent from the JSON."""
        return "max_tokens" in self.sampling_params.model_fields_set


# --------------------------------------------------------------------------- responses


class PromptTokenUsageInfo(_OpenAIBase):
    cached_tokens: int | None = None
    created_cache_tokens: int | None = None
    multimodal_tokens: dict[str, int] | None = None


class UsageInfo(_OpenAIBase):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None
    completion_tokens_details: dict[str, int] | None = None


class WeightVersionSpan(BaseModel):
    """vLLM's `WeightVersionSpan` dataclass: output tokens [start, end) came from weights `version`."""

    version: str
    start: int
    end: int


class GenerateLogProb(BaseModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


class GenerateTokensChoice(BaseModel):
    index: int
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    logprobs: GenerateLogProbs | None = None


class GenerateTokensStreamChoice(BaseModel):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    logprobs: GenerateLogProbs | None = None


class GenerateTokensStreamResponse(BaseModel):
    request_id: str = Field(default_factory=random_uuid)
    usage: UsageInfo | None = None
    prompt_token_ids: list[NonNegativeInt] | None = None
    mm_placeholders: dict[str, list[dict[str, int]]] | None = None
    metrics: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateTokensStreamChoice]


class GenerateTokensResponse(BaseModel):
    request_id: str = Field(default_factory=random_uuid)
    model: str | None = None
    created: int | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[NonNegativeInt] | None = None
    mm_placeholders: dict[str, list[dict[str, int]]] | None = None
    metrics: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateTokensChoice]


class ModelPermission(_OpenAIBase):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(_OpenAIBase):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(_OpenAIBase):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)
