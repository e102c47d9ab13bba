"""Images of a chat request, checked before render fetches or decodes them.

Render (vLLM) downloads an http(s) image from wherever its URL points and decodes whatever a data URL
holds. A front door open to clients must not let a request make the pod fetch from its own network
(the cloud metadata address, the cluster's services) or hand render a 100 MB payload, so the checks a
client's mistake or abuse would hit are made here, each a 400 naming the field:

* more than ``media.max_images`` images;
* a scheme outside ``media.url_schemes`` (``file:``, ``ftp:``, or http(s) where downloads are off);
* a data URL that is not an image, or holds more than ``media.max_image_bytes``;
* an http(s) URL whose host is or resolves to a loopback, private, link-local, multicast or reserved
  address, unless ``media.allow_private_urls``.

What only decoding can tell (a corrupt image, a download that times out or is too large) is render's
answer, passed on as a 400 by the render stage. The address check resolves the name once here and
render resolves it again when it downloads: a name that changes its answer in between (DNS
rebinding) is not stopped; an operator who must stop it turns downloads off (``url_schemes:
[data]``) or puts an egress policy on the pod (docs/multimodal.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from coordinator.config import MediaSettings
from coordinator.pipeline.errors import BadRequest

Resolve = Callable[[str], Awaitable[list[str]]]


@dataclass(frozen=True)
class ImagePart:
    param: str   # where it is in the body, for the error's ``param``
    url: str


def image_parts(body: dict[str, Any]) -> Iterator[ImagePart]:
    """The chat body's ``image_url`` parts (``{"url": ...}`` or a bare string, as vLLM accepts)."""
    messages = body.get("messages")
    for i, msg in enumerate(messages if isinstance(messages, list) else ()):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            where = f"messages[{i}].content[{j}].image_url"
            if not isinstance(url, str) or not url:
                raise BadRequest("An image_url part needs a non-empty string url", param=f"{where}.url")
            yield ImagePart(f"{where}.url", url)


async def resolve_host(host: str) -> list[str]:
    """Every address ``host`` resolves to (the event loop's resolver, off the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


class MediaPolicy:
    """The checks above for one configuration; ``check`` returns how many images the body has."""

    def __init__(self, settings: MediaSettings, resolve: Resolve = resolve_host) -> None:
        self.settings = settings
        self._resolve = resolve

    async def check(self, body: dict[str, Any]) -> int:
        parts = list(image_parts(body))
        limit = self.settings.max_images
        if len(parts) > limit:
            raise BadRequest(f"At most {limit} images are allowed per request; this one has {len(parts)}"
                             if limit else "This server does not accept images", param=parts[limit].param)
        for part in parts:
            await self._check_url(part)
        return len(parts)

    async def _check_url(self, part: ImagePart) -> None:
        scheme = part.url.split(":", 1)[0].lower() if ":" in part.url else ""
        if scheme not in self.settings.url_schemes:
            allowed = ", ".join(f"{s}:" for s in self.settings.url_schemes) or "none"
            raise BadRequest(f"Image URLs with scheme {scheme + ':' if scheme else '(none)'} are not "
                             f"accepted here (allowed: {allowed})", param=part.param)
        if scheme == "data":
            self._check_data_url(part)
        elif not self.settings.allow_private_urls:
            await self._check_host(part)

    def _check_data_url(self, part: ImagePart) -> None:
        header, sep, payload = part.url[5:].partition(",")
        media_type = header.split(";", 1)[0].strip().lower()
        if not sep or not media_type.startswith("image/"):
            raise BadRequest(f"A data URL image must be data:image/<type>;base64,<data>; this one is "
                             f"{media_type or 'untyped'}", param=part.param)
        size = len(payload) * 3 // 4 if header.endswith(";base64") else len(payload)
        if size > self.settings.max_image_bytes:
            raise BadRequest(f"Image of about {size} bytes exceeds the limit of "
                             f"{self.settings.max_image_bytes} bytes", param=part.param)

    async def _check_host(self, part: ImagePart) -> None:
        host = urlsplit(part.url).hostname
        if not host:
            raise BadRequest("Image URL has no host", param=part.param)
        try:
            addresses = [host] if _is_ip(host) else await self._resolve(host)
        except OSError as exc:
            raise BadRequest(f"Image URL host {host!r} does not resolve: {exc}", param=part.param) from exc
        if not addresses or not all(_is_public(a) for a in addresses):
            raise BadRequest(f"Image URL host {host!r} is a private, loopback or reserved address; "
                             "this server does not fetch from those", param=part.param)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
