"""Token budgets: what each engine, and the coordinator as a whole, has admitted and not yet released.

A request's cost is the most KV it can occupy (prompt + every output token). Counting it against a
budget *before* sending keeps engines out of preemption/recompute, which costs more than waiting here.
The ledger is plain synchronous bookkeeping: the scheduler asks it for room while it picks engines,
the admission controller reserves with it, and a ``Reservation`` gives the tokens back. What other
coordinator processes hold on the same engines comes from the ``Fleet`` (``fleet.py``): room checks
add it, and the controller claims each reservation there before the request goes out.

Tenants with a ``concurrent_tokens`` limit are one more budget: the tokens their admitted requests
hold (each request counted once, like the global budget), checked and claimed the same way, so the
limit holds over the fleet too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from coordinator.pipeline.admission.fleet import GLOBAL, Fleet, LocalFleet, Slot
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.scheduling.request import Placement
from coordinator.pipeline.scheduling.types import EngineView


class TokenLedger:
    """Per-engine and global in-flight token counts, and the room rules on top of them.

    The per-engine counts live on the ``Engine`` objects (the ``load`` scorer reads them); the global
    total lives here. ``global_limit=None`` means no global limit. ``enforce=False`` keeps the
    accounting but makes every room check say yes: admission switched off still measures load.
    """

    def __init__(self, global_limit: int | None, *, enforce: bool = True, fleet: Fleet | None = None,
                 tenant_limit: Callable[[str], int | None] = lambda tenant: None,
                 kv_usage_limit: float | None = None) -> None:
        self.global_limit = global_limit
        self.kv_usage_limit = kv_usage_limit
        self.enforce = enforce
        self.fleet: Fleet = fleet or LocalFleet()
        self.tenant_limit = tenant_limit  # a tenant's concurrent_tokens (None = unlimited), read each time
        self._global_inflight = 0
        self._tenants: dict[str, int] = {}
        self._holdback = 0  # tokens the request being placed must leave free (a tenant over its share)

    @property
    def global_inflight(self) -> int:
        """Tokens reserved over all engines and not yet released (each request counted once)."""
        return self._global_inflight

    def engine_room(self, engine: EngineView, tokens: int) -> bool:
        """Can ``engine`` take ``tokens`` more (what other processes hold there counted too)?

        The engine's own report bounds what the counts may get wrong (processes the fleet does not
        know of, clients that bypass the coordinator, a degraded fleet with more replicas than
        expected): an engine whose scraped KV-cache usage is at ``kv_usage_limit`` takes nothing more
        until it reports less (unless nothing of ours is on it, so the fleet never stalls on it)."""
        held = engine.inflight_tokens + self.fleet.others(engine.url)
        kv = engine.telemetry.kv_usage
        if self.enforce and self.kv_usage_limit is not None and held and kv is not None \
                and kv >= self.kv_usage_limit:
            return False
        return self._fits(held, tokens + self._holdback, self._scaled(engine.token_budget))

    @contextlib.contextmanager
    def holding_back(self, tokens: int) -> Iterator[None]:
        """Room checks inside leave ``tokens`` of every engine's budget free (the controller's
        headroom for tenants under their share, applied while it places one request)."""
        self._holdback = tokens
        try:
            yield
        finally:
            self._holdback = 0

    def global_room(self, tokens: int) -> bool:
        """The same rule against the global limit (None = unlimited)."""
        return self._fits(self._global_inflight + self.fleet.others(GLOBAL), tokens,
                          self._scaled(self.global_limit))

    def tenant_inflight(self, tenant: str) -> int:
        """Tokens ``tenant``'s admitted requests hold in this process."""
        return self._tenants.get(tenant, 0)

    def tenant_names(self) -> list[str]:
        """The tenants that have held tokens here."""
        return list(self._tenants)

    def tenant_room(self, tenant: str, tokens: int) -> bool:
        """The same rule against the tenant's ``concurrent_tokens`` (what other processes hold for it
        counted too)."""
        limit = self.tenant_limit(tenant)
        if limit is None:
            return True
        return self._fits(self._tenants.get(tenant, 0) + self.fleet.others(tenant_slot(tenant)), tokens,
                          self._scaled(limit))

    def totals(self, engines: list[Engine]) -> dict[str, int]:
        """Every slot this process counts, zeros included (what the fleet's lease renewal writes)."""
        out = {e.url: e.inflight_tokens for e in engines}
        out[GLOBAL] = self._global_inflight
        for tenant, held in self._tenants.items():
            if self.tenant_limit(tenant) is not None:
                out[tenant_slot(tenant)] = held
        return out

    def _scaled(self, limit: int | None) -> int | None:
        """This process's share of a budget: all of it unless the fleet is degraded (fleet.py)."""
        scale = self.fleet.scale
        return limit if limit is None or scale >= 1.0 else max(1, int(limit * scale))

    def slots(self, reservation: Reservation) -> list[Slot]:
        """What a fleet claim of ``reservation`` checks and writes: each engine share and the global
        share, with this process's totals after it (the reservation is already counted here)."""
        out = [Slot(e.url, e.inflight_tokens, share, e.token_budget if self.enforce else None)
               for e, share in reservation.shares.items()]
        out.append(Slot(GLOBAL, self._global_inflight, reservation.global_tokens,
                        self.global_limit if self.enforce else None))
        tenant = reservation.tenant
        limit = self.tenant_limit(tenant)
        if limit is not None:
            out.append(Slot(tenant_slot(tenant), self._tenants.get(tenant, 0), reservation.global_tokens,
                            limit if self.enforce else None))
        return out

    def publish(self, engines: list[Engine], tenant: str | None = None) -> None:
        """Tell the fleet this process's new totals on ``engines``, globally and for ``tenant`` when it
        has a limit (after a release)."""
        if self.fleet.shared:
            totals = {**{e.url: e.inflight_tokens for e in engines}, GLOBAL: self._global_inflight}
            if tenant is not None and self.tenant_limit(tenant) is not None:
                totals[tenant_slot(tenant)] = self._tenants.get(tenant, 0)
            self.fleet.publish(totals)

    def _fits(self, inflight: int, tokens: int, limit: int | None) -> bool:
        """An idle budget always fits: a request larger than the whole budget then runs alone instead
        of waiting for room that can never appear."""
        return not self.enforce or limit is None or inflight == 0 or inflight + tokens <= limit

    def reserve(self, placement: Placement, tokens: int, prefill_tokens: int = 0, *,
                tenant: str = "default") -> Reservation:
        """Count ``tokens`` on the decoding engine, globally and for ``tenant``, ``prefill_tokens`` on a
        P/D prefill engine; each engine gets one more in-flight request. No room check: the caller
        did it."""
        shares: dict[Engine, int] = {placement.engine: tokens}
        if placement.prefill is not None:
            shares[placement.prefill] = shares.get(placement.prefill, 0) + prefill_tokens
        for engine, share in shares.items():
            engine.inflight_tokens += share
            engine.inflight_requests += 1
        self._global_inflight += tokens
        self._tenants[tenant] = self._tenants.get(tenant, 0) + tokens
        return Reservation(self, shares, tokens, tenant)

    def _give_back(self, tokens: int, tenant: str) -> None:
        self._global_inflight = max(0, self._global_inflight - tokens)
        # A tenant that held tokens keeps its (zero) entry: the fleet's lease renewal rewrites it, which
        # repairs a release that Redis missed.
        self._tenants[tenant] = max(0, self._tenants.get(tenant, 0) - tokens)


def tenant_slot(tenant: str) -> str:
    """A tenant's fleet slot, beside the engines' urls and the global ``""`` (a url never starts so)."""
    return f"tenant:{tenant}"


def waiting_slot(tenant: str) -> str:
    """Where a process publishes the tokens its waiters of ``tenant`` ask for (fleet shares)."""
    return f"waiting:{tenant}"


class Reservation:
    """The tokens one admitted request holds. Every release is idempotent and never goes below zero,
    so error paths may release again without corrupting the counts."""

    def __init__(self, ledger: TokenLedger, shares: dict[Engine, int], global_tokens: int,
                 tenant: str = "default") -> None:
        self._ledger = ledger
        self._shares = shares
        self._global = global_tokens
        self.tenant = tenant

    @property
    def released(self) -> bool:
        return not self._shares and self._global == 0

    @property
    def shares(self) -> dict[Engine, int]:
        return dict(self._shares)

    @property
    def global_tokens(self) -> int:
        return self._global

    def held(self, engine: Engine) -> int:
        """Tokens still held on ``engine`` (0 once released, or if it is not part of this request)."""
        return self._shares.get(engine, 0)

    def add_engine(self, engine: Engine, tokens: int) -> None:
        """A share on one more engine, after admission: a trigger pair's prefill engine is chosen only
        when its decode engine calls back. The global share is unchanged (one request, counted once);
        nothing is added once the reservation was released."""
        if self.released or engine in self._shares:
            return
        self._shares[engine] = tokens
        engine.inflight_tokens += tokens
        engine.inflight_requests += 1
        self._ledger.publish([engine])

    def release_engine(self, engine: Engine) -> bool:
        """Give ``engine``'s share back early (e.g. the prefill leg finished); True if anything was
        held there. Releasing the last engine share also returns the global share."""
        share = self._shares.pop(engine, None)
        if share is None:
            return False
        engine.inflight_tokens = max(0, engine.inflight_tokens - share)
        engine.inflight_requests = max(0, engine.inflight_requests - 1)
        if not self._shares and self._release_global(publish=False):
            self._ledger.publish([engine], self.tenant)
        else:
            self._ledger.publish([engine])
        return True

    def release(self) -> bool:
        """Give back everything still held; True if anything was."""
        changed = False
        for engine in list(self._shares):
            changed = self.release_engine(engine) or changed
        return self._release_global() or changed

    def _release_global(self, *, publish: bool = True) -> bool:
        if self._global == 0:
            return False
        self._ledger._give_back(self._global, self.tenant)
        self._global = 0
        if publish:
            self._ledger.publish([], self.tenant)
        return True
