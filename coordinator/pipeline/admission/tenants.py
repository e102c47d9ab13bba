"""Tenants: whose request this is (its API key), what it may use, and its share of busy engines.

A tenant is a name, its keys, a weight and three optional limits (requests and tokens per minute,
concurrent tokens). Keys come from the config (``tenants.members``; ``server.api_keys`` belong to the
``default`` tenant) and from an optional YAML file re-read when it changes, so keys can be added or
revoked without a restart. Without any key configured every request is the ``default`` tenant.

Keys are looked up by their SHA-256 digest: the lookup's timing depends on the digest of what the
client sent, never on how many leading characters of a real key it guessed, and a thousand tenants
cost one dict lookup instead of a thousand constant-time comparisons.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from coordinator.config import TenantLimits, TenantSettings, TenantsSettings
from coordinator.pipeline.errors import Unauthorized

log = logging.getLogger(__name__)

DEFAULT = "default"


@dataclass(frozen=True)
class Tenant:
    """What admission and the rate limits need to know of one tenant."""

    name: str
    weight: float = 1.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_tokens: int | None = None
    adapters: frozenset[str] | None = None   # the LoRA adapters it may name; None: every one

    @classmethod
    def of(cls, name: str, limits: TenantLimits) -> Tenant:
        return cls(name, limits.weight, limits.requests_per_minute, limits.tokens_per_minute,
                   limits.concurrent_tokens, None if limits.adapters is None else frozenset(limits.adapters))

    def may_use(self, adapter: str | None) -> bool:
        return adapter is None or self.adapters is None or adapter in self.adapters


ANONYMOUS = Tenant(DEFAULT)


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")
    members: list[TenantSettings] = Field(default_factory=list)


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class TenantDirectory:
    """API keys → tenants, and each tenant's limits. Read on every request; replaced whole on reload."""

    def __init__(self, settings: TenantsSettings, server_keys: Iterable[SecretStr] = ()) -> None:
        self._settings = settings
        self._server_keys = [k.get_secret_value() for k in server_keys]
        self._file_mtime: float | None = None
        self._keys: dict[bytes, Tenant] = {}
        self._tenants: dict[str, Tenant] = {}
        self._install(settings.members, [])
        self.reload()  # the file's keys are valid from the first request

    def _install(self, members: list[TenantSettings], from_file: list[TenantSettings]) -> None:
        default = Tenant.of(DEFAULT, self._settings.default)
        tenants = {DEFAULT: default}
        keys = {_digest(k): default for k in self._server_keys}
        for t in [*members, *from_file]:
            if t.name in tenants:
                raise ValueError(f"tenant {t.name!r} is defined twice")
            tenant = tenants[t.name] = Tenant.of(t.name, t)
            for key in t.api_keys:
                digest = _digest(key.get_secret_value())
                if digest in keys:
                    raise ValueError(f"tenant {t.name!r}: an API key that belongs to {keys[digest].name!r}")
                keys[digest] = tenant
        self._tenants, self._keys = tenants, keys

    @property
    def auth_enabled(self) -> bool:
        """Whether requests must carry a key (any key configured, server-wide or a tenant's)."""
        return bool(self._keys)

    @property
    def tenants(self) -> dict[str, Tenant]:
        return dict(self._tenants)

    def get(self, name: str) -> Tenant:
        """The tenant named ``name`` now; one removed by a reload keeps default limits for its last
        requests (they were admitted under the old rules)."""
        return self._tenants.get(name) or Tenant(name)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an ``Authorization: Bearer <key>`` header; ``Unauthorized`` when keys are
        configured and this is none of them."""
        if not self._keys:
            return self._tenants[DEFAULT]
        scheme, _, token = (authorization or "").partition(" ")
        tenant = self._keys.get(_digest(token.strip()))
        if scheme.lower() != "bearer" or tenant is None:
            raise Unauthorized("Invalid or missing API key. Send 'Authorization: Bearer <key>'.")
        return tenant

    # -- the tenants file ---------------------------------------------------------------------------
    def reload(self) -> bool:
        """Re-read ``tenants.file`` if it changed; True when new tenants are in force. A file that is
        missing or does not parse keeps the tenants in force (and says why in the log)."""
        path = self._settings.file
        if path is None:
            return False
        try:
            mtime = os.stat(path).st_mtime
        except OSError as exc:
            if self._file_mtime is not None:
                log.warning("tenants file %s unreadable (%s); keeping the tenants in force", path, exc)
                self._file_mtime = None
            return False
        if mtime == self._file_mtime:
            return False
        self._file_mtime = mtime
        try:
            with open(path, encoding="utf-8") as f:
                loaded = _File.model_validate(yaml.safe_load(f) or {})
            self._install(self._settings.members, loaded.members)
        except (OSError, yaml.YAMLError, ValidationError, ValueError) as exc:
            log.error("tenants file %s rejected, keeping the tenants in force: %s", path, exc)
            return False
        log.info("tenants file %s loaded: %d tenants", path, len(loaded.members))
        return True

    async def watch(self) -> None:
        """Re-read the tenants file every ``reload_interval_s`` (a task for the coordinator's life)."""
        while True:
            await asyncio.sleep(self._settings.reload_interval_s)
            await asyncio.to_thread(self.reload)
