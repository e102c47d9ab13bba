"""Client API keys (Bearer): the key names the tenant. Client credentials are checked here and never
forwarded."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import SecretStr

from coordinator.config import TenantsSettings
from coordinator.pipeline.admission.tenants import Tenant, TenantDirectory


class ApiKeyCheck:
    """What every door calls with the request's ``Authorization`` header: the tenant it is, or
    ``Unauthorized`` (401). ``keys``: server-wide keys of the ``default`` tenant (when no directory is
    given, e.g. in tests)."""

    def __init__(self, keys: Iterable[SecretStr] = (), directory: TenantDirectory | None = None) -> None:
        self.directory = directory if directory is not None else TenantDirectory(TenantsSettings(), keys)

    @property
    def enabled(self) -> bool:
        return self.directory.auth_enabled

    def __call__(self, authorization: str | None) -> Tenant:
        return self.directory.authenticate(authorization)
