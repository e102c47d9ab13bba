"""What the render sidecars derender with: parsers, the parser-session cache, and the chunking rule.

Why the coordinator asks instead of trusting its config: a sidecar started with
``--tool-call-parser hermes`` under a coordinator that does not know it answers every streamed parser
call with 400 ("prompt_token_ids is required ..."), after the client already got 200 and a few chunks.
So the coordinator learns it from the sidecars themselves, at start-up and whenever a sidecar comes
back: our sidecar (``render_sidecar.server``) says it on ``GET /derender/capabilities``; a plain vLLM
render server has no such route and is probed with a streaming derender call that carries no prompt
ids, which only a parser-configured server refuses. Sidecars of one pool must agree (they derender
the same streams); ``render.parsers`` in the config overrides what was learned.

**Coalescing with parsers.** Whether merging engine chunks into one derender call changes what a
parser emits was measured per parser on vLLM 0.32 (``perf.parser_chunking``, docs/parsers.md):
``EXACT_UNDER_COALESCING`` lists those whose assembled content, reasoning and tool calls are
identical for calls of 1, 3, 7 and 32 tokens. Any other parser, or a sidecar whose parser names are
unknown (plain vLLM), gets one token per call.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, cast

from coordinator.contracts.sidecar import CAPABILITIES_PATH, Capabilities
from coordinator.pipeline.sidecar import Sidecar, SidecarClient

log = logging.getLogger(__name__)

PROBE_BODY: dict[str, Any] = {
    "stream": True,
    "generate_chunk": {"request_id": "coordinator-parser-probe", "choices": []},
    "chat_request": {"messages": [{"role": "user", "content": "probe"}]},
}
_PARSER_REFUSAL = "prompt_token_ids is required"

# Measured on vLLM 0.32 (perf.parser_chunking, docs/parsers.md): assembled output identical at 1, 3, 7
# and 32 tokens per call for hermes, qwen3 and the two together; olmo3 drops content that shares a
# call with </think>, deepseek_r1 leaks "<think>" into the reasoning. ``None``: no parser of that kind.
EXACT_UNDER_COALESCING: frozenset[str | None] = frozenset({None, "hermes", "qwen3"})


@dataclass(frozen=True)
class SidecarFeatures:
    """One sidecar's derender configuration as far as the coordinator's calls depend on it."""

    parsers: bool
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    names_known: bool = True       # False for a plain vLLM sidecar: only "parsers or not" can be told
    session_cache: bool = False    # the sidecar keeps parser sessions (prompt ids only on a miss)

    @classmethod
    def from_capabilities(cls, body: Capabilities) -> SidecarFeatures:
        return cls(parsers=bool(body.get("parsers")), tool_call_parser=body.get("tool_call_parser"),
                   reasoning_parser=body.get("reasoning_parser"),
                   session_cache=body.get("session_cache") is not None)

    @property
    def coalesce_exact(self) -> bool:
        """Merged calls give the same output as one token per call for these parsers."""
        if not self.parsers:
            return True
        return (self.names_known and self.tool_call_parser in EXACT_UNDER_COALESCING
                and self.reasoning_parser in EXACT_UNDER_COALESCING)

    def describe(self) -> str:
        if not self.parsers:
            return "no parsers"
        if not self.names_known:
            return "parsers (names not reported: plain vLLM render server)"
        return f"tool-call parser {self.tool_call_parser}, reasoning parser {self.reasoning_parser}"

    def same_parsers(self, other: SidecarFeatures) -> bool:
        if self.parsers != other.parsers:
            return False
        if not (self.names_known and other.names_known):
            return True  # a plain vLLM sidecar only tells "parsers or not"
        return (self.tool_call_parser, self.reasoning_parser) == (other.tool_call_parser,
                                                                   other.reasoning_parser)


class SidecarsDisagree(RuntimeError):
    """The sidecars of one pool derender with different parsers (a start-up error)."""


def agree(features: dict[str, SidecarFeatures]) -> SidecarFeatures:
    """The pool's features; raises ``SidecarsDisagree`` naming each sidecar and what it runs."""
    values = list(features.values())
    first = values[0]
    if any(not first.same_parsers(f) for f in values[1:]):
        listing = "; ".join(f"{url}: {f.describe()}" for url, f in features.items())
        raise SidecarsDisagree(
            f"the render sidecars of render.urls derender with different parsers ({listing}); start "
            "them with the same --tool-call-parser / --reasoning-parser / --enable-auto-tool-choice flags")
    # The cache is used only when every sidecar has it (a stream may move between sidecars).
    return SidecarFeatures(parsers=first.parsers, tool_call_parser=first.tool_call_parser,
                           reasoning_parser=first.reasoning_parser,
                           names_known=all(f.names_known for f in values),
                           session_cache=all(f.session_cache for f in values))


def from_probe(status: int, body: Any) -> SidecarFeatures | None:
    """A plain vLLM sidecar's answer to ``PROBE_BODY``; None when the answer says nothing."""
    if status == 200:
        return SidecarFeatures(parsers=False, names_known=False)
    message = body.get("error", {}).get("message", "") if isinstance(body, dict) else ""
    if status == 400 and _PARSER_REFUSAL in str(message):
        return SidecarFeatures(parsers=True, names_known=False)
    return None


class FeatureBook:
    """The pool's derender features, learned from the sidecars and asked again for a sidecar that
    was gone (it may have come back with other flags).

    ``override`` (``render.parsers``) fixes "parsers or not"; the session cache is still asked for.
    """

    def __init__(self, client: SidecarClient, override: bool | None = None) -> None:
        self._client = client
        self._override = override
        self._known: dict[str, SidecarFeatures] = {}
        self._lock = asyncio.Lock()
        self.current: SidecarFeatures | None = (
            None if override is None else SidecarFeatures(parsers=override, names_known=False))

    @property
    def stale(self) -> bool:
        return any(s.relearn for s in self._client.sidecars)

    async def ensure(self) -> SidecarFeatures:
        """The pool's features, asking the sidecars that need it first (cheap when none does)."""
        if self.current is not None and not self.stale:
            return self.current
        async with self._lock:
            if self.stale:
                await self.learn(strict=False)
        return self.pool

    @property
    def pool(self) -> SidecarFeatures:
        """What is known now; before any sidecar answered, "no parsers" (or the config's word), and
        the call that needs a sidecar fails on its own."""
        return self.current or SidecarFeatures(parsers=bool(self._override), names_known=False)

    async def learn(self, *, strict: bool) -> SidecarFeatures | None:
        """Ask every sidecar whose features are unknown. ``strict`` (start-up): disagreement raises
        ``SidecarsDisagree``; later, a sidecar that disagrees with the pool is excluded from it."""
        stale = [s for s in self._client.sidecars if s.relearn]
        answers = await asyncio.gather(*(self._ask(s) for s in stale))
        for sidecar, features in zip(stale, answers, strict=True):
            if features is None:
                continue
            sidecar.relearn = False
            self._known[sidecar.url] = features
        if not self._known:
            return None
        try:
            pool = agree(self._known)
        except SidecarsDisagree:
            if strict:
                raise
            pool = self._exclude_odd_ones()
        if self._override is not None and pool.parsers != self._override:
            log.warning("render.parsers is %s but the sidecars report %s; using the config",
                        self._override, pool.describe())
            pool = SidecarFeatures(parsers=self._override, names_known=False,
                                   session_cache=pool.session_cache and pool.parsers == self._override)
        if pool != self.current:
            log.info("render sidecars: %s%s", pool.describe(),
                     ", parser-session cache" if pool.session_cache else "")
        self.current = pool
        return pool

    def _exclude_odd_ones(self) -> SidecarFeatures:
        """Keep the features most sidecars have (the earlier ones win a tie); exclude the others."""
        groups: list[list[str]] = []
        for url, f in self._known.items():
            for group in groups:
                if self._known[group[0]].same_parsers(f):
                    group.append(url)
                    break
            else:
                groups.append([url])
        keep = max(groups, key=len)
        for sidecar in self._client.sidecars:
            if sidecar.url in self._known and sidecar.url not in keep:
                sidecar.excluded = f"derenders with {self._known[sidecar.url].describe()}"
                log.error("render sidecar %s %s, unlike the rest of the pool: it gets no calls until it "
                          "is restarted with the pool's flags", sidecar.url, sidecar.excluded)
            elif sidecar.url in keep:
                sidecar.excluded = None
        return agree({url: self._known[url] for url in keep})

    async def _ask(self, sidecar: Sidecar) -> SidecarFeatures | None:
        answer = await self._client.call(sidecar, "GET", CAPABILITIES_PATH)
        if answer is None:
            return None
        status, body = answer
        if status == 200 and isinstance(body, dict) and "parsers" in body:
            return SidecarFeatures.from_capabilities(cast(Capabilities, body))
        probed = await self._client.call(sidecar, "POST", "/v1/chat/completions/derender", PROBE_BODY)
        if probed is None:
            return None
        features = from_probe(*probed)
        if features is None:  # it answers, but not like a vLLM render server: take the config's word
            log.warning("render sidecar %s did not say whether it runs parsers (capabilities: HTTP %s, "
                        "probe: HTTP %s); assuming %s", sidecar.url, status, probed[0],
                        "parsers" if self._override else "none")
            features = SidecarFeatures(parsers=bool(self._override), names_known=False)
        return features
