"""Configuration of the simulated token-only engine.

One pydantic model so the CLI, pytest fixtures and benchmark harnesses all describe an engine the
same way. Defaults imitate `vllm serve SmolLM2-135M-Instruct --tokens-only --max-model-len 2048`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

OutputMode = Literal["echo", "script", "random", "context"]
KvRole = Literal["prefill", "decode", "both"]
EcRole = Literal["ec_producer", "ec_consumer", "ec_both"]
StreamOrder = Literal["sequential", "interleaved"]
SchedulingPolicy = Literal["fcfs", "priority"]

# SmolLM2's added special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...) are ids 0..16.
_SMOLLM2_SPECIAL_IDS = list(range(17))
# The first 64 SmolLM2 ids that decode to " <lowercase word>" (" the", " and", " for", ...): "context" mode
# draws from them, so derendered output reads as words and never splits a UTF-8 character.
_SMOLLM2_WORD_IDS = [
    260, 284, 327, 338, 345, 346, 348, 351, 359, 379, 416, 429, 436, 441, 451, 457,
    458, 464, 469, 480, 495, 498, 499, 502, 503, 510, 511, 521, 523, 527, 540, 550,
    553, 555, 563, 564, 566, 567, 578, 582, 592, 597, 599, 600, 601, 606, 617, 618,
    622, 623, 624, 633, 634, 635, 638, 639, 641, 645, 650, 653, 654, 655, 656, 664,
]


class SimConfig(BaseModel):
    """Everything that shapes a simulated engine's wire behaviour, output and timing."""

    model_config = ConfigDict(extra="forbid")

    # --- identity (what /v1/models and error messages show) ---
    model: str = "smollm2-135m-instruct"
    """Served model name; a request naming another model gets vLLM's 404."""
    model_root: str | None = None
    """`root` in /v1/models (vLLM shows the model path); defaults to `model`."""
    vllm_version: str | None = "0.32.0"
    """What ``GET /version`` says (vLLM's ``{"version": ...}``); None: no such route (404), as a
    server that is not vLLM. The coordinator refuses engines of lines it cannot use (docs/versions.md)."""
    max_model_len: int = Field(default=2048, ge=2)
    vocab_size: int = Field(default=49152, ge=2)
    max_num_seqs: int = Field(default=256, ge=1)
    """vLLM rejects `sampling_params.n` above this with a 400."""
    max_logprobs: int = 20
    """vLLM's `--max-logprobs` (-1 = vocab size); larger `logprobs` requests fail at the engine."""
    default_max_tokens: int | None = None
    """A generation_config `max_new_tokens`; caps `max_tokens` when the client omits it."""

    # --- stopping ---
    eos_token_id: int | None = 2
    eos_as_stop_token_id: bool = True
    """True mirrors `--tokens-only`: without a tokenizer vLLM's EOS id is None and the generation
    config's EOS becomes a stop token id, so EOS finishes with `stop_reason: <eos id>`. False mirrors a
    server that loads a tokenizer (`stop_reason: null` on EOS)."""

    # --- output model ---
    mode: OutputMode = "echo"
    script_tokens: list[int] = Field(default_factory=lambda: [31, 1046, 314, 253, 3174, 30])
    """Tokens emitted by mode "script" before EOS."""
    echo_skip_last: int = Field(default=8, ge=0)
    """Echo drops a trailing generation prompt: everything from the last special token among the prompt's
    last this-many tokens (SmolLM2's `<|im_start|>assistant\\n` is 4 tokens: 1, 520, 9531, 198)."""
    echo_skip_ids: list[int] = Field(default_factory=lambda: list(_SMOLLM2_SPECIAL_IDS))
    """Ids never echoed (special tokens), so the echo decodes to plain text and never hits EOS."""
    echo_fallback_token_id: int = 30
    echo_max_cycles: int | None = None
    """When set, echo emits EOS after repeating the source this many times."""
    context_tokens: list[int] = Field(default_factory=lambda: list(_SMOLLM2_WORD_IDS), min_length=1)
    """Ids mode "context" picks from (by a rolling hash of the whole context)."""
    context_eos_after: int | None = Field(default=None, ge=1)
    """Mode "context": emit EOS once the context's tail after its last special id (`echo_skip_ids`) holds
    this many tokens; for a chat prompt that tail is `assistant\n` plus the output so far."""
    random_lo: int = 17
    random_hi: int = 49152
    random_eos_prob: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int = 0
    """Mixed into every request's PRNG so two simulators can be told apart."""

    # --- timing (seconds) ---
    ttft_s: float = Field(default=0.0, ge=0.0)
    prefill_s_per_token: float = Field(default=0.0, ge=0.0)
    decode_s_per_token: float = Field(default=0.0, ge=0.0)
    max_concurrency: int = Field(default=256, ge=1)
    """Requests beyond this wait (counted in `vllm:num_requests_waiting`)."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    stream_interval: int = Field(default=1, ge=1)
    """vLLM's `--stream-interval`: tokens per streamed delta (first token and finish always flush)."""
    n_stream_order: StreamOrder = "sequential"
    """"sequential": all of choice 0's chunks, then choice 1's (observed on vLLM 0.32 with n=2)."""

    # --- prefix cache / KV ---
    block_size: int = Field(default=16, ge=1)
    capacity_blocks: int = Field(default=4096, ge=1)
    enable_prefix_caching: bool = True
    offload_blocks: int = Field(default=0, ge=0)
    """A CPU offload tier of this many blocks, as vLLM's OffloadingConnector with
    `self_describing_kv_events` (prefix_cache.py): its KV events carry `medium: "CPU"`. 0: none."""
    offload_load_share: float = Field(default=0.1, ge=0.0)
    """Time to load a token back from the CPU tier, as a share of its prefill time."""
    enable_prompt_tokens_details: bool = False
    """vLLM's `--enable-prompt-tokens-details`: usage carries `prompt_tokens_details.cached_tokens`."""

    # --- KV cache events (vLLM's --kv-events-config) ---
    kv_events_endpoint: str | None = None
    """ZMQ PUB endpoint for vLLM-format KV events; None publishes nothing. `tcp://*:PORT` (anything with
    `*` or `::`, or ipc/inproc) is bound, `tcp://host:PORT` is connected to. `tcp://*:0` binds a free port
    (shown in `/sim/state`)."""
    kv_events_topic: str = "kv"
    """First frame of every message (vLLM's own default is "" when `topic` is left out)."""
    kv_events_replay_endpoint: str | None = None
    """Optional ZMQ ROUTER endpoint (always bound) that replays buffered batches from a sequence number."""
    kv_events_int_hashes: bool = True
    """Publish block hashes as 64-bit ints, like vLLM's default `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`;
    False publishes the 32-byte sha256 digests."""

    # --- P/D (NixlConnector-shaped kv_transfer_params) ---
    kv_role: KvRole | None = None
    kv_connector: Literal["nixl", "layerwise"] = "nixl"
    """nixl: handoff P/D (the prefill leg returns `kv_transfer_params`, the decode leg pulls). layerwise:
    trigger P/D as vLLM-Ascend's MooncakeLayerwiseConnector (the decode engine calls the request's
    `metaserver` URL and waits for the prefill's KV; see layerwise.py)."""
    engine_id: str = "sim-engine-0"
    side_channel_host: str = "localhost"
    side_channel_port: int = 5600
    tp_size: int = 1
    kv_lease_s: float = Field(default=30.0, ge=0.0)
    """NixlConnector's `kv_lease_duration`: a finished prefill's blocks stay pinned this long unless a
    decode engine consumes them first."""
    advertise_peer_url: bool = False
    """Add `sim_peer_url` (the URL the request came in on) to a prefill's kv_transfer_params, so a decode
    simulator can release the pinned blocks with `POST /sim/kv_transfer/consume`. Off by default: the
    wire then stays exactly vLLM's."""

    # --- encoder disaggregation (vLLM's --ec-transfer-config with ECExampleConnector) ---
    encode_s_per_image_token: float = Field(default=0.0, ge=0.0)
    """Vision-encoder time per placeholder token of an image the engine encodes (part of its prefill)."""
    ec_role: EcRole | None = None
    """ec_producer: an encode-only engine (encodes, stores, answers no tokens); ec_consumer: loads an
    image's embedding from the store when it is there instead of encoding it; ec_both: both."""
    ec_storage_path: str | None = None
    """ECExampleConnector's ``shared_storage_path``, required with ``ec_role``:
    ``<path>/<mm_hash>/encoder_cache.safetensors``. The simulator writes empty marker files there (not
    embeddings: never share a store with real engines)."""

    # --- LoRA (vLLM's --enable-lora; lora.py) ---
    enable_lora: bool = False
    max_loras: int = Field(default=1, ge=1)
    """Distinct adapters running at once; requests for others wait ("deferred")."""
    max_cpu_loras: int | None = Field(default=None, ge=1)
    """Adapters whose weights stay read (LRU); None = max_loras."""
    max_lora_rank: int = Field(default=16, ge=1)
    lora_modules: dict[str, str] = Field(default_factory=dict)
    """`--lora-modules name=path`: registered at start (their weights are read on first use)."""
    runtime_lora_updating: bool = True
    """`VLLM_ALLOW_RUNTIME_LORA_UPDATING`: serves /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    lora_load_s: float = Field(default=0.0, ge=0.0)
    """Reading one adapter's weights (a load call, or a request for an adapter evicted from the cache)."""

    # --- misc wire details ---
    weight_version: str = "default"
    api_key: str | None = None
    """vLLM's `--api-key`: guards /v1, /v2, /inference with `401 {"error":"Unauthorized"}`."""
    legacy_abort_route: bool = True
    """`--tokens-only` also mounts the unauthenticated `POST /abort_requests`."""
    abort_route: bool = True
    """`POST /inference/v1/abort_requests`, which vLLM 0.32 always mounts beside generate; off, the engine
    is one that serves generate alone, aborted only by closing the request's connection."""

    @model_validator(mode="after")
    def _check_ranges(self) -> SimConfig:
        if self.random_lo >= self.random_hi:
            raise ValueError("random_lo must be below random_hi")
        if self.ec_role is not None and not self.ec_storage_path:
            raise ValueError("ec_role needs ec_storage_path (the store the engines share)")
        return self

    @property
    def served_root(self) -> str:
        return self.model_root or self.model
