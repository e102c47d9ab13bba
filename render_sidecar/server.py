"""Our render sidecar process: vLLM's own render server, plus the parser-session cache and a route
that says how the sidecar is configured.

``python -m render_sidecar.server --model DIR [every vllm serve flag] [--session-cache-entries N ...]``

It runs vLLM's render entry point (``vllm.entrypoints.launchers.render.entry``) in this process and
changes one thing in it: the FastAPI app vLLM builds gets routes placed before its own,

* ``POST /v1/chat/completions/derender``, which answers streaming calls of a parser-configured
  sidecar from live parser sessions (``stream_cache.py``) and hands every other call to vLLM's route
  for that path, untouched;
* ``GET /derender/capabilities``: the tool-call / reasoning parsers, whether the session cache is
  on and its bounds, and the vLLM version, which the coordinator reads at start-up;
* ``POST /v1/chat/completions/render`` and ``/v1/completions/render`` in front of vLLM's, adding
  the prompts' block hashes to the answer when the coordinator asks (``prefix_hashes.py``);
* ``POST /v1/messages/chat`` and ``/v1/messages/count_tokens/chat``: an Anthropic Messages request
  converted to chat by vLLM's converter, for the coordinator's ``/v1/messages`` (``messages.py``);
* ``POST /v1/responses/chat``: an OpenAI Responses request as the chat request vLLM's Responses
  render renders, plus vLLM's response object for it, for the coordinator's ``/v1/responses``
  (``responses.py``);

and the cache's counters on the existing ``/metrics``. Image placeholders in render's answers name
only the positions the image's embeddings fill (``mm_placeholders.py``: vLLM 0.32 drops the mask
that says which, and its ``/generate`` then kills the engine for many vision models); an image URL
that cannot be downloaded is a 422 naming it, not vLLM's empty 500 (``media_fetch.py``).

Routes rather than a middleware: vLLM's app
has already built its middleware stack (request metrics, error handling) when we get it, and a route
runs inside that stack like any of vLLM's.

The hook is vLLM's ``entry.build_app`` (the render entry looks it up when it builds the app), so
start-up, argument parsing and serving stay vLLM's code.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any

import vllm
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from coordinator.contracts.sidecar import (
    CAPABILITIES_PATH,
    COUNT_TOKENS_CHAT_PATH,
    MESSAGES_CHAT_PATH,
    RESPONSES_CHAT_PATH,
    Capabilities,
)
from render_sidecar.media_fetch import install as install_media_fetch
from render_sidecar.messages import count_tokens_chat, messages_chat
from render_sidecar.mm_placeholders import install as install_narrowing
from render_sidecar.prefix_hashes import RENDER_PATHS, HashingRenderRoute
from render_sidecar.responses import responses_chat
from render_sidecar.sessions import SessionCache

DERENDER_CHAT_PATH = "/v1/chat/completions/derender"
DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
DEFAULT_IDLE_TTL_S = 120.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parser-session cache (render_sidecar)")
    group.add_argument("--session-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="keep live parser sessions of streaming chat derender calls (default: on where "
                       "this vLLM's derender internals are the ones the cache drives, off with a warning "
                       "elsewhere; --session-cache makes a mismatch a start-up error)")
    group.add_argument("--session-cache-entries", type=int, default=DEFAULT_MAX_ENTRIES,
                       help="most streams held at once (LRU beyond it)")
    group.add_argument("--session-cache-bytes", type=int, default=DEFAULT_MAX_BYTES,
                       help="most estimated bytes held by all sessions (LRU beyond it)")
    group.add_argument("--session-cache-ttl", type=float, default=DEFAULT_IDLE_TTL_S,
                       help="seconds a session may sit unused before it is dropped")


class CacheCollector(Collector):
    """The cache's counters as Prometheus metrics, read at scrape time (no second bookkeeping)."""

    def __init__(self, cache: SessionCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Any]:
        c = self._cache
        hits = CounterMetricFamily("render_sidecar_session_hits", "streaming derender calls served from a "
                                   "live parser session (no replay)")
        hits.add_metric([], c.hits)
        misses = CounterMetricFamily("render_sidecar_session_misses", "streaming derender calls that had "
                                     "to replay the stream", labels=["reason"])
        for reason, n in c.misses.items():
            misses.add_metric([reason], n)
        evictions = CounterMetricFamily("render_sidecar_session_evictions", "parser sessions dropped before "
                                        "their stream finished", labels=["reason"])
        for reason, n in c.evictions.items():
            evictions.add_metric([reason], n)
        finished = CounterMetricFamily("render_sidecar_session_finished", "parser sessions freed by the "
                                       "stream's finishing chunk")
        finished.add_metric([], c.finished)
        resident = GaugeMetricFamily("render_sidecar_session_resident_bytes", "estimated bytes held by "
                                     "parser sessions")
        resident.add_metric([], c.resident_bytes)
        sessions = GaugeMetricFamily("render_sidecar_sessions", "parser sessions held")
        sessions.add_metric([], len(c))
        yield from (hits, misses, evictions, finished, resident, sessions)


class CachedDerenderRoute:
    """The ASGI app of our ``POST /v1/chat/completions/derender``: buffers the body and lets
    ``CachedChatStream`` answer the calls it can; every other call reaches vLLM's route (``app``)
    exactly as sent."""

    def __init__(self, app: ASGIApp, state: Any, cache: SessionCache | None) -> None:
        self.app = app
        self._state = state
        self._cache = cache
        self._handler: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._cached_stream()
        if handler is None:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        answer = await handler.handle(body)
        if answer is not None:
            await self._send(send, answer.status, answer.body)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _cached_stream(self) -> Any:
        if self._cache is None:
            return None
        if self._handler is None:
            serving = getattr(self._state, "serving_derender", None)
            if serving is None or serving.online_derenderer.parser is None:
                return None
            from render_sidecar.stream_cache import CachedChatStream

            self._handler = CachedChatStream(serving, self._cache)
        return self._handler

    @staticmethod
    async def _send(send: Send, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def capabilities(state: Any, cache: SessionCache | None) -> Capabilities:
    """What a coordinator must mirror: the parsers this sidecar derenders with, and the cache."""
    args = state.args
    config = getattr(state, "vllm_config", None)
    reasoning = args.reasoning_parser or (
        config.structured_outputs_config.reasoning_parser if config is not None else None) or None
    derenderer = getattr(state, "online_derenderer", None)
    return {
        "tool_call_parser": args.tool_call_parser,
        "reasoning_parser": reasoning,
        "enable_auto_tool_choice": bool(args.enable_auto_tool_choice),
        "parsers": derenderer is not None and derenderer.parser is not None,
        "session_cache": None if cache is None else {
            "max_entries": cache.max_entries, "max_bytes": cache.max_bytes, "idle_ttl_s": cache.idle_ttl_s},
        "vllm_version": vllm.__version__,
    }


def install_routes(app: Any, cache: SessionCache | None) -> None:
    """Put our routes in front of vLLM's (the router tries routes in order at each request)."""
    routes = app.router.routes
    vllm_route = next((r for r in routes if getattr(r, "path", None) == DERENDER_CHAT_PATH
                       and "POST" in (getattr(r, "methods", None) or ())), None)
    if vllm_route is None:
        raise RuntimeError(f"vLLM's render app has no POST {DERENDER_CHAT_PATH} route to put the cache "
                           "in front of")

    async def capabilities_route(request: Request) -> JSONResponse:
        return JSONResponse(capabilities(app.state, cache))

    routes.insert(0, Route(CAPABILITIES_PATH, capabilities_route, methods=["GET"]))
    routes.insert(0, Route(MESSAGES_CHAT_PATH, messages_chat, methods=["POST"]))
    routes.insert(0, Route(COUNT_TOKENS_CHAT_PATH, count_tokens_chat, methods=["POST"]))
    routes.insert(0, Route(RESPONSES_CHAT_PATH, responses_chat, methods=["POST"]))
    routes.insert(0, Route(DERENDER_CHAT_PATH, CachedDerenderRoute(vllm_route.handle, app.state, cache),
                           methods=["POST"]))
    for path in RENDER_PATHS:
        render = next((r for r in routes if getattr(r, "path", None) == path
                       and "POST" in (getattr(r, "methods", None) or ())), None)
        if render is not None:
            routes.insert(0, Route(path, HashingRenderRoute(render.handle), methods=["POST"]))


def install(entry: Any, args: argparse.Namespace) -> SessionCache | None:
    """Wrap ``entry.build_app`` so the app it builds gets our routes and the cache's metrics."""
    if not install_narrowing():
        print("render_sidecar: this vLLM's render has no _extract_mm_features; image placeholders are "
              "sent as vLLM writes them", flush=True)
    if not install_media_fetch():
        print("render_sidecar: this vLLM has no MediaConnector.load_from_url_async; a failed image "
              "download stays vLLM's 500", flush=True)
    cache = None
    if args.session_cache is not False:
        from render_sidecar.stream_cache import check_vllm_shape

        try:
            check_vllm_shape()
        except RuntimeError as exc:
            if args.session_cache:  # asked for by name: refuse to start rather than run without it
                raise
            # Never a cache over internals it was not written for: it could serve wrong text.
            print(f"render_sidecar: WARNING: parser-session cache off on vLLM {vllm.__version__}: {exc}; "
                  "streaming derender replays every call (vLLM's own path)", flush=True)
            args.session_cache = False
    if args.session_cache is not False:
        cache = SessionCache(args.session_cache_entries, args.session_cache_bytes, args.session_cache_ttl)
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        get_prometheus_registry().register(CacheCollector(cache))
    original = entry.build_app

    def build_app(*a: Any, **kw: Any) -> Any:
        app = original(*a, **kw)
        install_routes(app, cache)
        return app

    entry.build_app = build_app
    return cache


def _cli_parts() -> tuple[Any, Callable[[], None]]:
    """vLLM's serve argument module and its CLI environment set-up: 0.33 moved both into
    ``vllm.entrypoints.common`` (same names, same behaviour)."""
    homes = (("vllm.entrypoints.common.cli_args", "vllm.entrypoints.common.startup"),         # 0.33
             ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.serve.utils.api_utils"))  # 0.32
    for args_module, setup_module in homes:
        try:
            return importlib.import_module(args_module), importlib.import_module(setup_module).cli_env_setup
        except ImportError:
            continue
    raise ImportError("this vLLM has neither home of cli_args / cli_env_setup (0.32, 0.33)")


def main(argv: list[str] | None = None) -> None:
    """vLLM's render entry ``__main__``, with our flags added to its parser."""
    import uvloop
    from vllm.entrypoints.launchers.render import entry
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_args, cli_env_setup = _cli_parts()
    cli_env_setup()
    parser = FlexibleArgumentParser(  # type: ignore[no-untyped-call]
        description="vLLM render server with a parser-session cache")
    parser = cli_args.make_arg_parser(parser)
    add_cache_args(parser)
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    cli_args.validate_parsed_serve_args(args)
    install(entry, args)
    uvloop.run(entry.run_launch_fastapi(args))


if __name__ == "__main__":
    main()
