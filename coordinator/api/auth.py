"""Optional client API keys (Bearer). Client credentials are checked here and never forwarded."""

from __future__ import annotations

import hmac

from pydantic import SecretStr

from coordinator.pipeline.errors import Unauthorized


class ApiKeyCheck:
    def __init__(self, keys: list[SecretStr]) -> None:
        self._keys = [k.get_secret_value().encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __call__(self, authorization: str | None) -> None:
        if not self._keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        # Compare against every key so timing does not reveal which (or whether one) matched early.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(given, key)
        if scheme.lower() != "bearer" or not ok:
            raise Unauthorized("Invalid or missing API key. Send 'Authorization: Bearer <key>'.")
