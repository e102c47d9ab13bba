"""Which vLLM lines work together behind the coordinator (docs/versions.md, "Mixing lines").

Why the coordinator asks instead of trusting a deployment: the render sidecar ships in the
coordinator's pod while the engines are upgraded by whoever runs the GPUs, so the two drift apart one
rollout at a time. Every vLLM server answers ``GET /version``; the coordinator reads it from each
render sidecar at start-up and from each engine when it first answers a probe.

* A line before ``OLDEST`` lacks what the coordinator's streams rely on (``stop_reason`` in generate
  choices, ``/inference/v1/abort_requests``, working ``n>1`` streams: docs/versions.md, "What lines
  before 0.32 lack"). Such an engine is refused (no requests, ``/ready`` names it) and such a sidecar
  stops the start.
* A pair of lines ``make test`` / ``make compat-vllm`` proved (``TESTED``) runs quietly; any other pair
  of lines from ``OLDEST`` on runs with one warning naming it untested: refusing a newer engine
  nobody has tested yet would turn every upstream release into an outage.
* A server that does not say (the simulator, a proxy) is taken as the current line.
"""

from __future__ import annotations

import re

import httpx

Line = tuple[int, int]

OLDEST: Line = (0, 32)
"""The oldest line the coordinator runs against, render side and engine side."""

TESTED: frozenset[tuple[Line, Line]] = frozenset({
    ((0, 32), (0, 32)),   # make test: the whole suite
    ((0, 33), (0, 32)),   # make compat-vllm VLLM=0.33.0 (upstream wheel, render side only)
})
"""(render sidecar line, engine line) pairs a suite proved end to end."""


class IncompatibleVllm(RuntimeError):
    """A render sidecar runs a vLLM line the coordinator cannot work with (a start-up error)."""


def line_of(version: str | None) -> Line | None:
    """``"0.33.0"`` → (0, 33); ``"0.34.0rc1.dev12+g…"`` → (0, 34); None when it cannot be told."""
    if not version:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def refusal(role: str, url: str, version: str | None) -> str | None:
    """Why a server of that version cannot be used, or None when it can (or does not say)."""
    found = line_of(version)
    if found is None or found >= OLDEST:
        return None
    return (f"{role} {url} runs vLLM {version}; the coordinator needs {OLDEST[0]}.{OLDEST[1]} or later "
            "(older lines have no stop_reason in generate choices, no /inference/v1/abort_requests and "
            "broken n>1 streams: docs/versions.md)")


def untested(sidecar: str | None, engine: str | None) -> bool:
    """Both lines are known, usable, and no suite proved them together."""
    pair = (line_of(sidecar), line_of(engine))
    if pair[0] is None or pair[1] is None or min(pair[0], pair[1]) < OLDEST:
        return False
    return (pair[0], pair[1]) not in TESTED


async def read_version(http: httpx.AsyncClient, url: str, timeout_s: float,
                       headers: dict[str, str] | None = None) -> tuple[bool, str | None]:
    """``GET {url}/version``: (answered, version). Answered without a version (404: the simulator)
    counts as answered, so the question is not asked again; no answer at all asks again later."""
    try:
        resp = await http.get(f"{url}/version", timeout=timeout_s, headers=headers)
    except httpx.HTTPError:
        return False, None
    try:
        body = resp.json() if resp.status_code == 200 else None
    except ValueError:
        body = None
    version = body.get("version") if isinstance(body, dict) else None
    return True, version if isinstance(version, str) else None
