"""HTTP client for the localhost vLLM render sidecar (render, derender, models, health).

One pooled ``httpx.AsyncClient``; every call has the per-call ``render.timeout_s`` (a streaming
derender applies it per chunk, not per stream). Failures are mapped to pipeline errors here so
render and derender callers only see typed errors.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from coordinator.config import RenderSettings
from coordinator.pipeline.errors import UpstreamClientError, UpstreamTimeout, UpstreamUnavailable

log = logging.getLogger(__name__)


class SidecarClient:
    """Typed calls to the render sidecar; knows nothing of the client-facing HTTP layer."""

    def __init__(self, settings: RenderSettings, http: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self._http = http or httpx.AsyncClient(
            base_url=settings.url,
            timeout=httpx.Timeout(settings.timeout_s),
            limits=httpx.Limits(max_connections=settings.max_connections,
                                max_keepalive_connections=settings.max_connections),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def post(self, path: str, body: dict[str, Any], *, request_id: str | None = None,
                   stage: str = "render") -> Any:
        """POST JSON and return the decoded JSON reply; 4xx pass through, the rest become 502/504."""
        headers = {"X-Request-Id": request_id} if request_id else None
        try:
            resp = await self._http.post(path, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"{stage} sidecar timed out after {self.settings.timeout_s}s") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"{stage} sidecar unreachable: {exc.__class__.__name__}") from exc
        if resp.status_code >= 400:
            data = _json_or_none(resp)
            if 400 <= resp.status_code < 500 and (resp.status_code not in (404, 405) or _is_model_404(data)):
                raise UpstreamClientError(resp.status_code, data, f"{stage} rejected the request")
            log.warning("%s sidecar answered %s on %s: %s", stage, resp.status_code, path, resp.text[:300])
            raise UpstreamUnavailable(f"{stage} sidecar failed with HTTP {resp.status_code}")
        try:
            return resp.json()
        except ValueError as exc:
            raise UpstreamUnavailable(f"{stage} sidecar returned invalid JSON") from exc

    async def models(self) -> list[dict[str, Any]]:
        resp = await self._http.get("/v1/models")
        resp.raise_for_status()
        data = resp.json().get("data", [])
        return [m for m in data if isinstance(m, dict)]

    async def healthy(self) -> bool:
        try:
            resp = await self._http.get("/health", timeout=2.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200


def _json_or_none(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


def _is_model_404(data: Any) -> bool:
    """A 404 with an OpenAI error body is 'unknown model' (client error); a bare 404 is a missing route."""
    return isinstance(data, dict) and isinstance(data.get("error"), dict)
