"""Run conformance recipes against an NNRP session URL and print a table of results.

``python -m coordinator.nnrp.conformance --url ws://HOST:PORT/nnrp/v1 [--api-key K] [--model M]``

The runner opens one session to read the capability manifest (or reads ``--manifest FILE``),
selects the recipes the manifest supports (seed 000 §10.3), runs each in a session of its own with
the client library, so one broken operation cannot spoil the next, and ends its table with exactly
``N passed, M failed``. The exit status is 1 when a recipe failed or none ran, 2 when the run could
not start (bad arguments, no session).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from coordinator.nnrp.client import NnrpClient, NnrpError
from coordinator.nnrp.conformance.recipes import (
    Observed,
    Recipe,
    RecipeError,
    completed_text,
    delta_text,
    judge,
    load_recipes,
    match_value,
    why_not_selected,
)
from coordinator.nnrp.profile import (
    PROFILE,
    SCHEMA_VERSION,
    TERMINAL_EVENT_TYPES,
    ExtensionSelection,
    Manifest,
    ManifestError,
    parse_manifest,
)

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
DEFAULT_QUIET_S = 0.3  # how long the runner listens after a terminal event for anything late


@dataclass(frozen=True)
class Outcome:
    recipe_id: str
    status: str
    detail: str = ""
    seconds: float = 0.0


class RecordingClient(NnrpClient):
    """The client library, also keeping every result frame by operation id, including any that
    arrives after the operation's terminal event (the library drops those; conformance must see them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.observed: dict[str, Observed] = {}

    async def _dispatch(self, frame: dict[str, Any]) -> None:
        if frame.get("type") == "result" and isinstance(frame.get("op"), str):
            self.observed.setdefault(frame["op"], Observed()).frames.append(frame)
        await super()._dispatch(frame)


def http_base(ws_url: str) -> str:
    """``ws://h:p/nnrp/v1`` → ``http://h:p`` (the coordinator serves both on one port)."""
    base = ws_url.replace("wss://", "https://", 1).replace("ws://", "http://", 1)
    return base.split("/nnrp/", 1)[0].rstrip("/")


def fetch_capabilities(ws_url: str, api_key: str | None) -> dict[str, Any] | None:
    """``GET /nnrp/v1/capabilities`` when the server serves it; None otherwise (the session's copy rules)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{http_base(ws_url)}/nnrp/v1/capabilities", headers=headers, timeout=30)
    except httpx.HTTPError:
        return None
    return dict(r.json()) if r.status_code == 200 else None


def default_model(ws_url: str, api_key: str | None) -> str:
    """The first model ``GET /v1/models`` lists, for a run without ``--model``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{http_base(ws_url)}/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


def envelope_of(recipe: Mapping[str, Any], *, stream: bool | None = None) -> dict[str, Any]:
    """The request envelope a recipe submits (``stream`` overrides ``body.stream``)."""
    request = recipe["request"]
    body = dict(request["body"])
    if stream is not None:
        body["stream"] = stream
        if not stream:
            body.pop("stream_options", None)
    env: dict[str, Any] = {"profile": recipe.get("profile", PROFILE),
                           "schema_version": recipe.get("schema_version", SCHEMA_VERSION),
                           "operation": recipe["operation"], "body": body}
    for member in ("policy", "extensions", "include_openai_chunk"):
        if member in request:
            env[member] = request[member]
    return env


async def _operation(client: RecordingClient, recipe: Mapping[str, Any], op_id: str,
                     envelope: dict[str, Any]) -> Observed:
    """Submit, carry out the recipe's actions as events arrive, then listen a while for stragglers."""
    actions = sorted(recipe.get("actions") or [], key=lambda a: int(a.get("after_events", 0)))
    op = await client.submit(envelope, op_id=op_id)
    seen = 0

    async def act() -> None:
        while actions and int(actions[0].get("after_events", 0)) <= seen:
            action = actions.pop(0)
            if action.get("do") != "cancel":
                raise RecipeError(f"unknown action {action.get('do')!r}")
            await op.cancel(str(action.get("reason", "cancelled by conformance")))

    await act()
    async for event in op:
        seen += 1
        if event.get("type") not in TERMINAL_EVENT_TYPES:
            await act()
    await asyncio.sleep(float(recipe["expect"].get("quiet_ms", DEFAULT_QUIET_S * 1000)) / 1000)
    return client.observed.get(op_id, Observed())


async def run_operation(url: str, api_key: str | None, recipe: Mapping[str, Any],
                        manifest: Manifest) -> list[str]:
    """Run one operation recipe in its own session; the problems found (empty: it passed)."""
    client = await RecordingClient.connect(url, api_key=api_key)
    assert isinstance(client, RecordingClient)  # ``connect`` builds the class it is called on
    try:
        observed = await _operation(client, recipe, "conformance-1", envelope_of(recipe))
        # What the operation's envelope selected decides which critical extensions may show up.
        chosen = frozenset(recipe["request"].get("extensions") or [])
        selection = ExtensionSelection(manifest.extensions, chosen)
        problems = judge(recipe, observed, selection)
        if recipe["expect"].get("deltas_equal_non_streaming") and not problems:
            whole = await _operation(client, {"expect": {"quiet_ms": 0}}, "conformance-2",
                                     envelope_of(recipe, stream=False))
            last = whole.events[-1] if whole.events else {}
            if last.get("type") != "response.completed":
                problems.append(f"the non-streaming twin ended with {json.dumps(last)[:300]}")
            else:
                text = completed_text(last)
                streamed = delta_text(observed.events)
                if streamed != text:
                    problems.append(f"deltas {streamed!r} != non-streaming text {text!r}")
        return problems
    finally:
        await client.close("conformance recipe done")


def check_manifest(recipe: Mapping[str, Any], doc: Mapping[str, Any],
                   served: Mapping[str, Any] | None) -> list[str]:
    """Level-1 case 10: the session's manifest parses by the profile's rules and matches the recipe;
    ``GET /nnrp/v1/capabilities``, when served, is the same document."""
    problems = []
    try:
        parse_manifest(doc)
    except ManifestError as exc:
        problems.append(f"invalid manifest: {exc}")
    pattern = recipe["expect"].get("manifest")
    if pattern is not None:
        problem = match_value(pattern, doc, "manifest")
        if problem:
            problems.append(problem)
    if served is not None and dict(served) != dict(doc):
        problems.append("GET /nnrp/v1/capabilities differs from the session's manifest")
    return problems


async def run_all(url: str, *, api_key: str | None, model: str, recipes: Sequence[Recipe],
                  manifest_doc: dict[str, Any] | None = None, extensions: Sequence[str] = (),
                  only: Sequence[str] = (), params: Mapping[str, str] | None = None) -> list[Outcome]:
    """Select and run ``recipes``; one ``Outcome`` per recipe, in order."""
    served = await asyncio.to_thread(fetch_capabilities, url, api_key)
    if manifest_doc is None:
        probe = await NnrpClient.connect(url, api_key=api_key)
        manifest_doc = probe.manifest
        await probe.close("manifest read")
    manifest = parse_manifest(manifest_doc)
    values = {"MODEL_ID": model, **(params or {})}
    outcomes = []
    for recipe in recipes:
        if only and recipe.id not in only:
            continue
        started = time.monotonic()
        try:
            filled = recipe.render(values)
        except RecipeError as exc:
            outcomes.append(Outcome(recipe.id, FAIL, str(exc)))
            continue
        reason = why_not_selected(filled, manifest, extensions)
        if reason is not None:
            outcomes.append(Outcome(recipe.id, SKIP, reason))
            continue
        try:
            if recipe.kind == "manifest":
                problems = check_manifest(filled, manifest_doc, served)
            else:
                problems = await asyncio.wait_for(
                    run_operation(url, api_key, filled, manifest),
                    float(filled.get("timeout_s", 120)))
        except (NnrpError, ConnectionError, OSError, RecipeError, TimeoutError) as exc:
            problems = [f"{type(exc).__name__}: {exc}"]
        outcomes.append(Outcome(recipe.id, FAIL if problems else PASS, "; ".join(problems),
                                time.monotonic() - started))
    return outcomes


def print_table(outcomes: Sequence[Outcome], out: TextIO = sys.stdout) -> None:
    """The results table; its last line is exactly ``N passed, M failed``."""
    width = max([len(o.recipe_id) for o in outcomes] + [6])
    out.write(f"{'recipe':<{width}}  result  seconds  detail\n")
    for o in outcomes:
        detail = o.detail if len(o.detail) <= 400 else o.detail[:400] + "…"
        out.write(f"{o.recipe_id:<{width}}  {o.status:<6}  {o.seconds:7.2f}  {detail}\n")
    passed = sum(o.status == PASS for o in outcomes)
    failed = sum(o.status == FAIL for o in outcomes)
    out.write(f"{passed} passed, {failed} failed\n")
    out.flush()


def exit_code(outcomes: Sequence[Outcome]) -> int:
    failed = any(o.status == FAIL for o in outcomes)
    return 1 if failed or not any(o.status == PASS for o in outcomes) else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m coordinator.nnrp.conformance",
                                description="Run openai-compatible/1 conformance recipes over NNRP.")
    p.add_argument("--url", required=True, help="session URL, e.g. ws://127.0.0.1:8000/nnrp/v1")
    p.add_argument("--api-key", default=None, help="API key for the session and GET /nnrp/v1/capabilities")
    p.add_argument("--model", default=None, help="${MODEL_ID}; default: the first of GET /v1/models")
    p.add_argument("--recipes", type=Path, action="append", default=None,
                   help="recipe file or folder (repeatable); default: the packaged recipes (Levels 1 to 3)")
    p.add_argument("--manifest", type=Path, default=None,
                   help="select by this manifest file instead of the session's")
    p.add_argument("--extension", action="append", default=[],
                   help="run recipes that exercise this critical extension (repeatable)")
    p.add_argument("--only", action="append", default=[], help="run only this recipe id (repeatable)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="another ${NAME} recipe parameter (repeatable)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recipes = load_recipes(args.recipes)
        params = dict(item.split("=", 1) for item in args.param)
        model = args.model or default_model(args.url, args.api_key)
        manifest_doc = json.loads(args.manifest.read_text()) if args.manifest else None
        outcomes = asyncio.run(run_all(args.url, api_key=args.api_key, model=model, recipes=recipes,
                                       manifest_doc=manifest_doc, extensions=args.extension,
                                       only=args.only, params=params))
    except (RecipeError, ManifestError, NnrpError, OSError, ValueError, httpx.HTTPError) as exc:
        print(f"conformance run could not start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print_table(outcomes)
    return exit_code(outcomes)
