"""The simulated engine core: admission, prefill/decode timing, stopping rules, abort, statistics.

It plays the part of vLLM's AsyncLLM + scheduler for one `/inference/v1/generate` request: `generate()` is
an async generator of per-choice deltas, checked lazily on first iteration like `AsyncLLM.generate` (so
engine-side rejections reach a streaming client as a post-200 error event), and a cancelled iteration
(client disconnect) aborts the request. Stopping follows `vllm/v1/core/sched/utils.py:check_stop`: EOS/stop
token first (the token is kept in `token_ids`), then length (`max_tokens` or `max_model_len`); min_tokens
masks EOS and stop ids as vLLM's MinTokensLogitsProcessor does.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .config import SimConfig
from .errors import SimValidationError
from .kv_transfer import PeerNotifier, TransferPins
from .layerwise import LayerwiseConnector, callback_body, side_channel
from .lora import SimLoras
from .output_model import TokenSource, fake_logprob, make_source
from .prefix_cache import EventSink, MediaItem, PrefixCache
from .protocol import GenerateLogProb, GenerateLogProbsContent, SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort", "error")
Outcome = Literal["completed", "aborted", "errored"]


@dataclass
class ChoiceDelta:
    """One engine output for one choice: the new tokens, and the finish details on its last delta."""

    index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    weight_versions: list[dict[str, Any]] | None = None
    logprobs: list[GenerateLogProbsContent] | None = None


@dataclass
class ChoiceState:
    index: int
    source: TokenSource
    want_logprobs: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[GenerateLogProbsContent] = field(default_factory=list)
    unsent: int = 0
    sent_any: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    queue: list[ChoiceDelta] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SimRequest:
    """A request as the engine sees it; the HTTP layer reads the final state after `generate()` ends."""

    external_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int | None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error_after_tokens: int | None = None
    peer_url: str | None = None
    """The URL this request reached the server on; advertised as `sim_peer_url` when configured."""
    lora: str | None = None
    """The LoRA adapter it runs (its name); None: the base model."""
    media: list[MediaItem] = field(default_factory=list)
    """Its images (``features``): their hashes key the blocks they overlap, like vLLM's."""
    internal_id: str = ""
    arrival: float = field(default_factory=time.monotonic)
    status: Literal["new", "waiting", "running", "finished"] = "new"
    outcome: Outcome | None = None
    num_cached_tokens: int = 0
    choices: list[ChoiceState] = field(default_factory=list)
    response_kv_transfer_params: dict[str, Any] | None = None
    response_ec_transfer_params: dict[str, Any] | None = None
    peer_notified: bool = False
    kv_pushed: bool = False
    """Trigger prefill side: the done (or failed) message went to the decode engine."""
    abort_event: asyncio.Event = field(default_factory=asyncio.Event)
    _admitted: asyncio.Future[bool] | None = None

    def __post_init__(self) -> None:
        if not self.internal_id:
            # vLLM appends 8 random hex chars so duplicate external ids can coexist.
            self.internal_id = f"{self.external_id}-{secrets.token_hex(4)}"


@dataclass
class EngineStats:
    requests_total: int = 0
    completed: int = 0
    errored: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    aborted_ids: deque[str] = field(default_factory=lambda: deque(maxlen=10_000))


class SimEngine:
    """Holds every in-flight request; all methods run on the server's event loop."""

    def __init__(self, config: SimConfig, on_kv_events: EventSink | None = None) -> None:
        self.config = config
        self.prefix_cache = PrefixCache(
            config.block_size,
            config.capacity_blocks,
            config.enable_prefix_caching,
            on_events=on_kv_events,
            int_event_hashes=config.kv_events_int_hashes,
            offload_blocks=config.offload_blocks,
        )
        self.transfers = TransferPins(config.kv_lease_s)
        self.peer_notifier = PeerNotifier()
        self.layerwise = LayerwiseConnector()
        self.stats = EngineStats()
        self._requests: dict[str, SimRequest] = {}
        self._by_external: dict[str, set[str]] = {}
        self._running: dict[str, SimRequest] = {}
        self._waiting: list[tuple[int, float, int, SimRequest]] = []
        self._seq = itertools.count()
        self._block_counter = itertools.count()
        self.loras = SimLoras(config)

    # ------------------------------------------------------------------ introspection

    @property
    def running(self) -> list[SimRequest]:
        return list(self._running.values())

    @property
    def waiting(self) -> list[SimRequest]:
        return [entry[3] for entry in sorted(self._waiting)]

    def kv_cache_usage(self) -> float:
        """Blocks held by running requests and by pinned P/D transfers over the block pool (cached-but-free
        blocks count as free, as in vLLM)."""
        bs = self.config.block_size
        used = sum(
            math.ceil((len(r.prompt) + max((len(c.tokens) for c in r.choices), default=0)) / bs)
            for r in self._running.values()
        )
        return min(1.0, (used + self.transfers.pinned_blocks) / self.config.capacity_blocks)

    # ------------------------------------------------------------------ abort

    def abort(self, request_ids: list[str] | str) -> None:
        """Abort by *external* id (`generate-tokens-...`).

        Every request sharing the id stops; unknown ids are ignored (vLLM answers 200 either way).
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for ext in ids:
            for internal in list(self._by_external.get(ext, ())):
                req = self._requests.get(internal)
                if req is not None:
                    req.abort_event.set()

    # ------------------------------------------------------------------ generation

    def check_request(self, req: SimRequest) -> None:
        """Engine-side rejections in the order of vLLM's InputProcessor: params, prompt length, max_tokens."""
        cfg, sp = self.config, req.params
        max_allowed = cfg.vocab_size if cfg.max_logprobs == -1 else cfg.max_logprobs
        for kind, param, asked in (("sample", "logprobs", sp.logprobs),
                                   ("prompt", "prompt_logprobs", sp.prompt_logprobs)):
            if not asked:
                continue
            num = cfg.vocab_size if asked == -1 else asked
            if num > max_allowed:
                raise SimValidationError(
                    f"Requested {kind} logprobs of {num}, which is greater than max allowed: {max_allowed}",
                    param,
                    num,
                )
        bad = [t for t in sp.stop_token_ids or [] if t < 0 or t >= cfg.vocab_size]
        if bad:
            raise SimValidationError(
                f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token ids. "
                f"Vocabulary size: {cfg.vocab_size}",
                "stop_token_ids",
                bad,
            )
        n, m = len(req.prompt), cfg.max_model_len
        if n > m:
            raise SimValidationError(
                f"The decoder prompt (length {n}) is longer than the maximum model length of {m}. "
                "Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        if n == m:
            raise SimValidationError(
                f"The decoder prompt (length {n}) plus the number of requested output tokens (at least 1) "
                f"is longer than the maximum model length of {m}. Make sure that `max_model_len` is no "
                "smaller than the number of text tokens (prompt + requested output tokens)."
            )
        if req.max_tokens is None:
            req.max_tokens = m - n
            if sp.min_tokens > req.max_tokens:
                raise SimValidationError(
                    f"min_tokens must be less than or equal to max_tokens={req.max_tokens}, "
                    f"got {sp.min_tokens}."
                )

    async def generate(self, req: SimRequest) -> AsyncGenerator[ChoiceDelta, None]:
        """Run one request; yields deltas in emission order. Cancellation (disconnect) counts as an abort."""
        self.check_request(req)
        self._register(req)
        try:
            if await self._admit(req):
                async for delta in self._run(req):
                    yield delta
            for delta in self._abort_outputs(req):
                yield delta
            self._finish(req)
        except (asyncio.CancelledError, GeneratorExit):
            # The consumer went away; it only aborted the request if some choice was still generating.
            self._finish(req, disconnected=not req.choices or not all(c.finished for c in req.choices))
            raise
        finally:
            # A remote-prefill request that ends before it pulled (aborted while queued) still tells the
            # prefill side to free its blocks (NixlConnector request_finished with do_remote_prefill).
            self._notify_prefill_peer(req)
            if self._is_trigger_prefill(req) and not req.kv_pushed:
                # An aborted or failed prefill leg tells the waiting decode engine its KV is not coming.
                req.kv_pushed = True
                self.layerwise.push_soon(req.kv_transfer_params or {}, req.external_id, ok=False)
            self._release(req)

    async def _run(self, req: SimRequest) -> AsyncIterator[ChoiceDelta]:
        cfg, sp = self.config, req.params
        script = _sim_script(sp)
        req.choices = [
            ChoiceState(
                index=i,
                source=make_source(
                    cfg, req.prompt, seed=sp.seed, index=i, temperature=sp.temperature, script=script
                ),
                want_logprobs=sp.logprobs is not None,
            )
            for i in range(sp.n)
        ]
        # Prefill: cost of the uncached prompt tail (a NIXL remote prefill leaves only the last token).
        if req.lora is not None:  # scheduled: the adapter's weights go into a LoRA slot
            await self.loras.warm(req.lora)
        if self.encode_only:
            async for delta in self._encode_only(req):
                yield delta
            return
        cached = self.prefix_cache.lookup(req.prompt, req.cache_salt, lora=req.lora, media=req.media)
        loaded = self.prefix_cache.last_loaded  # of ``cached``: loaded back from the CPU tier
        req.num_cached_tokens = cached
        uncached = len(req.prompt) - cached
        if self._is_trigger_decode(req):
            loaded_remote = await self._await_remote_kv(req, cached)
            if loaded_remote is None:
                return
            if loaded_remote:  # the whole prompt arrived; as with NIXL only the last token is recomputed
                uncached = min(uncached, 1)
                req.num_cached_tokens = len(req.prompt)
        elif self._is_remote_prefill(req):
            # NixlConnector loads every prompt token it does not have locally (local + external = the
            # whole prompt) and the scheduler recomputes only the last one.
            uncached = min(uncached, 1)
            req.num_cached_tokens = len(req.prompt)
            self._notify_prefill_peer(req)
        remote_cached = (req.kv_transfer_params or {}).get("remote_prefill_cached_tokens")
        if (req.kv_transfer_params or {}).get("do_remote_prefill") and isinstance(remote_cached, int):
            req.num_cached_tokens = remote_cached  # OutputProcessor reports the P side's hits
        # Images are encoded only where tokens are computed here (a decode leg that loaded the prompt's
        # KV computes the last token alone, so it encodes nothing).
        encode_s = self._encode_s(req, len(req.prompt) - uncached)
        load_s = cfg.prefill_s_per_token * cfg.offload_load_share * loaded
        if await self._sleep(req, cfg.ttft_s + cfg.prefill_s_per_token * uncached + load_s + encode_s):
            return
        self.prefix_cache.insert(req.prompt, req.cache_salt,
                                 (req.lora, self.loras.adapter_id(req.lora)) if req.lora else None, req.media)
        self.stats.prompt_tokens += len(req.prompt)

        stop_ids, banned = self._stop_sets(sp)
        interval = sp.stream_interval or cfg.stream_interval
        produced = 0
        while True:
            for choice in req.choices:
                if choice.finished:
                    continue
                tok = choice.source.next_token(banned if len(choice.tokens) < sp.min_tokens else frozenset())
                choice.tokens.append(tok)
                choice.unsent += 1
                produced += 1
                self.stats.generation_tokens += 1
                if sp.logprobs is not None:
                    choice.logprobs.append(self._logprob_entry(tok, sp.logprobs))
                self._check_stop(req, choice, tok, stop_ids)
                if req.error_after_tokens is not None and produced >= req.error_after_tokens:
                    choice.finish_reason, choice.stop_reason = "error", None
                if choice.finished or not choice.sent_any or choice.unsent >= interval:
                    choice.queue.append(self._flush(choice))
            done = all(c.finished for c in req.choices)
            if done:
                self._maybe_kv_transfer_params(req)
                # vLLM's scheduler frees a finished request's slot in the step that finishes it, before
                # its output reaches the API server: a client that sends its next request on reading
                # the last token never finds this one still running.
                self._free_slot(req)
            for delta in self._drain(req):
                yield delta
            if any(c.finish_reason == "error" for c in req.choices):
                for c in req.choices:  # the engine fails the whole request
                    if not c.finished:
                        c.finish_reason = "error"
                        c.queue.append(self._flush(c))
                for delta in self._drain(req):
                    yield delta
                return
            if done:
                if self._is_trigger_prefill(req):
                    # Layer-wise: the KV went out during the forward pass; "done" before the answer.
                    req.kv_pushed = True
                    await self.layerwise.push(req.kv_transfer_params or {}, req.external_id, ok=True)
                return
            if await self._sleep(req, cfg.decode_s_per_token):
                return

    # -- encoder disaggregation (ECExampleConnector's shared store) -------------------------------
    @property
    def encode_only(self) -> bool:
        """vLLM's ``is_encode_only``: a producer that is not also a consumer runs no language model."""
        return self.config.ec_role == "ec_producer"

    def _ec_file(self, mm_hash: str) -> Path:
        assert self.config.ec_storage_path is not None  # SimConfig requires it with ec_role
        return Path(self.config.ec_storage_path) / mm_hash / "encoder_cache.safetensors"

    def _encode_s(self, req: SimRequest, computed: int) -> float:
        """Encoder time of the images this engine must encode: not those whose placeholders all lie in
        the ``computed`` prompt tokens (prefix cache or loaded KV: vLLM skips them), nor, on a consumer,
        those the store holds (it loads them)."""
        consumer = self.config.ec_role in ("ec_consumer", "ec_both")
        tokens = sum(length for h, off, length in req.media
                     if off + length > computed and not (consumer and self._ec_file(h).exists()))
        return tokens * self.config.encode_s_per_image_token

    async def _encode_only(self, req: SimRequest) -> AsyncIterator[ChoiceDelta]:
        """An encode-only engine: encode every image, store it, answer no tokens, and report
        ``ec_transfer_params`` as ECExampleConnector does (media hash -> its item indices)."""
        tokens = sum(length for _, _, length in req.media)
        if await self._sleep(req, tokens * self.config.encode_s_per_image_token):
            return
        params: dict[str, Any] = {}
        for i, (h, _, _) in enumerate(req.media):
            path = self._ec_file(h)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            params.setdefault(h, {"item_indices": [], "metadata": {}})["item_indices"].append(i)
        req.response_ec_transfer_params = params or None
        self.stats.prompt_tokens += len(req.prompt)
        for choice in req.choices:
            choice.finish_reason = "stop"
            choice.queue.append(self._flush(choice))
        for delta in self._drain(req):
            yield delta

    def _stop_sets(self, sp: SamplingParams) -> tuple[frozenset[int], frozenset[int]]:
        """(ids that stop with stop_reason=<id>, ids masked before min_tokens)."""
        eos = self.config.eos_token_id
        stop_ids = set(sp.stop_token_ids or [])
        banned = set(stop_ids)
        if eos is not None:
            banned.add(eos)
            if self.config.eos_as_stop_token_id and not sp.ignore_eos:
                stop_ids.add(eos)
        return frozenset(stop_ids), frozenset(banned)

    def _check_stop(self, req: SimRequest, choice: ChoiceState, tok: int, stop_ids: frozenset[int]) -> None:
        cfg, sp = self.config, req.params
        eos = cfg.eos_token_id
        if not cfg.eos_as_stop_token_id and eos is not None and tok == eos and not sp.ignore_eos:
            choice.finish_reason, choice.stop_reason = "stop", None
        elif tok in stop_ids:
            choice.finish_reason, choice.stop_reason = "stop", tok
        elif len(req.prompt) + len(choice.tokens) >= cfg.max_model_len or (
            req.max_tokens is not None and len(choice.tokens) >= req.max_tokens
        ):
            choice.finish_reason, choice.stop_reason = "length", None

    def _flush(self, choice: ChoiceState) -> ChoiceDelta:
        new = choice.tokens[len(choice.tokens) - choice.unsent :] if choice.unsent else []
        logprobs = None
        if choice.want_logprobs:  # an empty delta (abort) still carries `{"content": []}`
            logprobs = choice.logprobs[len(choice.logprobs) - len(new) :] if new else []
        choice.unsent = 0
        choice.sent_any = True
        return ChoiceDelta(
            index=choice.index,
            token_ids=new,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            weight_versions=self._weight_versions(choice) if choice.finished else None,
            logprobs=logprobs,
        )

    def _weight_versions(self, choice: ChoiceState) -> list[dict[str, Any]]:
        """vLLM reports one span over every output token; an output with no tokens has no spans."""
        n = len(choice.tokens)
        return [{"version": self.config.weight_version, "start": 0, "end": n}] if n else []

    def _drain(self, req: SimRequest) -> list[ChoiceDelta]:
        """Queued deltas in emission order: interleaved, or choice by choice ("sequential")."""
        out: list[ChoiceDelta] = []
        if self.config.n_stream_order == "interleaved":
            for c in req.choices:
                out.extend(c.queue)
                c.queue.clear()
            return out
        for c in req.choices:
            out.extend(c.queue)
            c.queue.clear()
            if not c.finished:
                break
        return out

    def _abort_outputs(self, req: SimRequest) -> list[ChoiceDelta]:
        """Aborted choices end with an empty delta carrying finish_reason "abort" (plus unflushed tokens)."""
        if not req.abort_event.is_set():
            return []
        if not req.choices:  # aborted while waiting: vLLM still answers every choice
            want = req.params.logprobs is not None
            req.choices = [
                ChoiceState(index=i, source=_NullSource(), want_logprobs=want) for i in range(req.params.n)
            ]
        for c in req.choices:
            if not c.finished:
                c.finish_reason, c.stop_reason = "abort", None
                c.queue.append(self._flush(c))
        out: list[ChoiceDelta] = []
        for c in req.choices:
            out.extend(c.queue)
            c.queue.clear()
        return out

    def _logprob_entry(self, tok: int, k: int) -> GenerateLogProbsContent:
        count = self.config.vocab_size if k == -1 else max(k, 1)
        lp = fake_logprob(tok, 1)
        top = [GenerateLogProb(token_id=tok, logprob=lp, rank=1)]
        for j in range(1, count):
            other = (tok + j) % self.config.vocab_size
            top.append(GenerateLogProb(token_id=other, logprob=fake_logprob(other, j + 1), rank=j + 1))
        return GenerateLogProbsContent(token_id=tok, logprob=lp, rank=1, top_logprobs=top)

    # ------------------------------------------------------------------ P/D

    def _is_remote_prefill(self, req: SimRequest) -> bool:
        p = req.kv_transfer_params or {}
        needed = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
        return (
            self.config.kv_role in ("decode", "both")
            and bool(p.get("do_remote_prefill"))
            and all(p.get(k) is not None for k in needed)
        )

    def _is_trigger_decode(self, req: SimRequest) -> bool:
        p = req.kv_transfer_params or {}
        return (self.config.kv_connector == "layerwise" and self.config.kv_role in ("decode", "both")
                and bool(p.get("do_remote_prefill")) and isinstance(p.get("metaserver"), str))

    def _is_trigger_prefill(self, req: SimRequest) -> bool:
        p = req.kv_transfer_params or {}
        return (self.config.kv_connector == "layerwise" and self.config.kv_role in ("prefill", "both")
                and bool(p.get("do_remote_decode")) and p.get("remote_host") is not None)

    async def _await_remote_kv(self, req: SimRequest, cached: int) -> bool | None:
        """Trigger decode side: call the metaserver once, then wait for the prefill's KV. True: it
        arrived; False: the prefill reported a failure (compute locally); None: aborted meanwhile."""
        cfg = self.config
        params = dict(req.kv_transfer_params or {})
        url = str(params.pop("metaserver"))
        params["do_remote_prefill"] = False  # the connector's own guard: one callback per request
        req.kv_transfer_params = params
        nblocks = max(1, math.ceil(len(req.prompt) / cfg.block_size))
        host, port = side_channel(req.peer_url)
        arrival = self.layerwise.expect(req.external_id)
        body = callback_body(
            request_id=req.external_id,
            block_ids=[next(self._block_counter) % cfg.capacity_blocks for _ in range(nblocks)],
            block_size=cfg.block_size, engine_id=cfg.engine_id, host=host, port=port,
            tp_size=cfg.tp_size, cached_tokens=cached)
        self.layerwise.call_metaserver(url, body)
        aborted = asyncio.ensure_future(req.abort_event.wait())
        waiting: set[asyncio.Future[Any]] = {arrival, aborted}
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            aborted.cancel()
            self.layerwise.forget(req.external_id)
        if req.abort_event.is_set() or not arrival.done() or arrival.cancelled():
            return None
        return arrival.result()

    def _notify_prefill_peer(self, req: SimRequest) -> None:
        """Decode side: tell the prefill simulator (if it advertised `sim_peer_url`) to free the blocks."""
        p = req.kv_transfer_params or {}
        peer = p.get("sim_peer_url")
        if req.peer_notified or not isinstance(peer, str) or not self._is_remote_prefill(req):
            return
        req.peer_notified = True
        self.peer_notifier.notify(peer, str(p["remote_request_id"]))

    def _maybe_kv_transfer_params(self, req: SimRequest) -> None:
        """NixlConnector request_finished(): a prefill leg that stopped or hit length hands blocks over.

        The blocks stay pinned (`self.transfers`) until the decode side consumes them or the lease ends.
        """
        p = req.kv_transfer_params or {}
        if self.config.kv_role not in ("prefill", "both") or not p.get("do_remote_decode"):
            return
        if self.config.kv_connector == "layerwise":
            return  # request_finished returns (False, None): no params, nothing pinned (A9)
        if any(c.finish_reason not in ("stop", "length") for c in req.choices):
            return
        generated = max(len(c.tokens) for c in req.choices)
        computed = len(req.prompt) + generated - 1  # the last sampled token has no KV yet
        nblocks = math.ceil(computed / self.config.block_size)
        blocks = [next(self._block_counter) % self.config.capacity_blocks for _ in range(nblocks)]
        cfg = self.config
        req.response_kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": cfg.engine_id,
            "remote_request_id": req.internal_id,
            "remote_host": cfg.side_channel_host,
            "remote_port": cfg.side_channel_port,
            "tp_size": cfg.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": computed,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }
        if generated == 1:
            # The scheduler adds the P side's prefix-cache hits when the request finishes on its first
            # output (its prefill stats are still untaken), so D can report them as cached_tokens.
            req.response_kv_transfer_params["remote_prefill_cached_tokens"] = req.num_cached_tokens
        if cfg.advertise_peer_url and req.peer_url is not None:
            req.response_kv_transfer_params["sim_peer_url"] = req.peer_url
        self.transfers.pin(req.internal_id, req.external_id, nblocks)

    # ------------------------------------------------------------------ bookkeeping

    def _register(self, req: SimRequest) -> None:
        self.stats.requests_total += 1
        self._requests[req.internal_id] = req
        self._by_external.setdefault(req.external_id, set()).add(req.internal_id)

    def _fits(self, req: SimRequest) -> bool:
        """A running slot is free, and a LoRA slot for its adapter (at most ``max_loras`` distinct
        adapters run at once; vLLM defers the others and schedules past them)."""
        if len(self._running) >= self.config.max_concurrency:
            return False
        if req.lora is None:
            return True
        active = {r.lora for r in self._running.values() if r.lora is not None}
        return req.lora in active or len(active) < self.config.max_loras

    def deferred(self) -> list[SimRequest]:
        """Waiting requests held back only by the LoRA slots (vLLM's waiting reason "deferred")."""
        room = len(self._running) < self.config.max_concurrency
        return [r for r in self.waiting if room and not self._fits(r)]

    async def _admit(self, req: SimRequest) -> bool:
        """Wait for a running slot; False if aborted while waiting."""
        if self._fits(req) and not self._waiting:
            self._start(req)
            return True
        loop = asyncio.get_running_loop()
        req._admitted = loop.create_future()
        req.status = "waiting"
        prio = req.priority if self.config.scheduling_policy == "priority" else 0
        heapq.heappush(self._waiting, (prio, req.arrival, next(self._seq), req))
        self._schedule()  # a slot may be free while only deferred adapter requests wait
        abort_wait = asyncio.ensure_future(req.abort_event.wait())
        waiters: set[asyncio.Future[Any]] = {req._admitted, abort_wait}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            abort_wait.cancel()
        if req._admitted.done() and req._admitted.result():
            return not req.abort_event.is_set()
        return False

    def _start(self, req: SimRequest) -> None:
        req.status = "running"
        self._running[req.internal_id] = req

    def _free_slot(self, req: SimRequest) -> None:
        if self._running.pop(req.internal_id, None) is not None:
            self._schedule()

    def _release(self, req: SimRequest) -> None:
        """Free the slot (or the queue entry) and hand the slot to the next waiter."""
        self._running.pop(req.internal_id, None)
        self._waiting = [e for e in self._waiting if e[3] is not req]
        heapq.heapify(self._waiting)
        self._requests.pop(req.internal_id, None)
        ids = self._by_external.get(req.external_id)
        if ids is not None:
            ids.discard(req.internal_id)
            if not ids:
                del self._by_external[req.external_id]
        self._schedule()

    def _schedule(self) -> None:
        """Start waiters in queue order while slots are free, past those whose adapter has no slot."""
        if not self._waiting or len(self._running) >= self.config.max_concurrency:
            return
        kept: list[tuple[int, float, int, SimRequest]] = []
        for entry in sorted(self._waiting):
            nxt = entry[3]
            if nxt._admitted is None or nxt._admitted.done():
                continue
            if self._fits(nxt):
                self._start(nxt)
                nxt._admitted.set_result(True)
            else:
                kept.append(entry)
        self._waiting = kept
        heapq.heapify(self._waiting)

    def _finish(self, req: SimRequest, disconnected: bool = False) -> None:
        if req.status == "finished":
            return
        req.status = "finished"
        if disconnected or req.abort_event.is_set():
            req.outcome = "aborted"
            self.stats.aborted_ids.append(req.external_id)
        elif any(c.finish_reason == "error" for c in req.choices):
            req.outcome = "errored"
            self.stats.errored += 1
        else:
            req.outcome = "completed"
            self.stats.completed += 1
        for c in req.choices:
            reason = c.finish_reason or "abort"
            self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1

    def abort_internal(self, req: SimRequest) -> None:
        """The server gave up on the request (e.g. an injected connection drop)."""
        req.abort_event.set()
        self._finish(req, disconnected=True)

    async def _sleep(self, req: SimRequest, delay: float) -> bool:
        """Sleep `delay` seconds; True (early) if the request was aborted meanwhile."""
        if req.abort_event.is_set():
            return True
        if delay <= 0:
            await asyncio.sleep(0)
            return req.abort_event.is_set()
        waiter = asyncio.ensure_future(req.abort_event.wait())
        try:
            await asyncio.wait({waiter}, timeout=delay)
            # The engine loop was reading an adapter meanwhile (lora.py): this step waits for it too.
            while not req.abort_event.is_set() and (stall := self.loras.stalled_until - time.monotonic()) > 0:
                await asyncio.wait({waiter}, timeout=stall)
        finally:
            waiter.cancel()
        return req.abort_event.is_set()


class _NullSource:
    def next_token(self, banned: frozenset[int]) -> int:
        raise RuntimeError("an aborted choice produces no tokens")


def _sim_script(sp: SamplingParams) -> list[int] | None:
    """`extra_args.sim_script`: a per-request token script (vLLM ignores unknown extra_args)."""
    script = (sp.extra_args or {}).get("sim_script")
    if isinstance(script, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in script):
        return script
    return None
