"""Admission: let a request through when its tokens fit, make it wait in priority order when they do
not, and refuse it (429 / 503 with ``Retry-After``) when waiting is pointless.

One job in one file, though a long one: the rules below share one queue, one set of budgets and one
event-loop state without locks, and together keep a single invariant (who may take which tokens,
when). The pieces that stand alone live beside it: the token ledger (``budget.py``), the tenants'
shares (``shares.py``), rate limits (``rate_limits.py``), the fleet ledger (``fleet.py``).

Why here and not only in the engines: vLLM admits whatever it is sent and then preempts under KV
pressure, which wastes the work already done. Waiting in the coordinator costs nothing and lets a
freed engine go to the most urgent request, whichever model or engine it needs.

Rules, in one place:

* **Fast path.** Nobody waits ahead (no waiter of another tenant, none of ours with priority <=
  ours), the global and tenant budgets have room and the scheduler's ``place`` finds an engine with
  room: reserve and return, no await.
* **Refuse.** Otherwise, with ``max_queue`` waiters already queued: ``QueueFull`` (429) at once --
  unless the tenant waits less than its weight's share of the queue; then the newest waiter of the
  tenant furthest over its share gets the 429 and the newcomer its place (``tenants.max_queue_share``).
* **Wait.** Otherwise queue for up to ``queue_timeout_s`` (then ``QueueTimeout``, 503). Each tenant
  has its own line, ordered by (priority, arrival); ``wake()`` takes from the lines by weighted fair
  queuing on tokens: each grant advances its tenant's virtual time by ``cost / weight``, the line
  with the lowest virtual time goes next, and a tenant that was idle starts at the current virtual
  time (no credit saved up while idle). So busy tenants' admitted tokens grow in proportion to their
  weights, and a light tenant's request goes ahead of a heavy tenant's backlog. With one tenant
  (the default) this is plain (priority, arrival) order. ``wake()`` stops at the first waiter that
  does not fit the *global* budget (shared by everyone, so the fair order is kept) but only skips
  one whose own engines are full (another model's engines may be free) or whose tenant is at its
  ``concurrent_tokens`` (its later waiters are skipped too, keeping its own order).
* **Headroom.** Fair order alone still makes a light tenant wait for the next release, which with
  few, long requests in flight is a long wait. So while two or more tenants have sent requests in
  the last ``headroom_window_s``, a tenant holding more than its weighted share of the budget may
  take the room one request of a tenant under its share needs (the largest that tenant sent while
  active) from the last ``HEADROOM_ENGINES`` of the model's engines that still have it: the light
  tenant's next requests start at once, and the heavy tenant's releases refill the room. It costs
  the heavy tenant two light requests' tokens over the whole pool (one room kept a light tenant's
  second request of a burst waiting: B's TTFT p90 1.8x alone in perf.fairness against 1.1-1.3x
  with two), and only while a light tenant is active.
* **Fleet shares.** With a shared fleet each process also publishes its tenants' waiting tokens;
  while another tenant waits anywhere in the fleet, a tenant holding more than its weighted max-min
  share of the fleet's budget (``shares.py``) is held back like one at its ``concurrent_tokens``, so
  shares hold however the load balancer spread the tenants over the replicas.
* **Fleet.** With a shared fleet (``admission.fleet.backend: redis``) a grant, fast or woken, is
  then claimed over every coordinator process on the same engines (``fleet.py``); a claim another
  process won first gives the grant back and the request waits again in its place in the queue.
* **Disabled** (``settings.enabled = False``). The ledger is switched to accounting-only
  (``ledger.enforce = False``): every room check, the scheduler's included, says yes, so nothing
  waits for budget, yet reservations still count load for the ``load`` scorer. If ``place`` still
  finds no engine (e.g. the engines' own queues are too long), the request cannot wait: 429.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType

from coordinator.config import AdmissionSettings
from coordinator.observability.metrics import Metrics
from coordinator.pipeline.admission.budget import Reservation, TokenLedger, tenant_slot, waiting_slot
from coordinator.pipeline.admission.shares import fair_allocation
from coordinator.pipeline.engines.engine import Engine
from coordinator.pipeline.errors import NoHealthyEngine, QueueFull, QueueTimeout
from coordinator.pipeline.scheduling.request import Placement, SchedRequest

log = logging.getLogger(__name__)

Place = Callable[[SchedRequest], Placement | None]
HEADROOM_ENGINES = 2  # engines that keep a light tenant's request of room (see "Headroom")
PrefillTokens = Callable[[Placement], int]


def no_prefill(placement: Placement) -> int:
    return 0


class Grant:
    """An admitted request: where it goes, the tokens it holds, how long it waited.

    Release it when the engine request ends (``with grant:`` does it on exit, exceptions included);
    releasing again is harmless. Every release that frees tokens wakes the waiters.
    """

    def __init__(self, placement: Placement, reservation: Reservation, waited_s: float,
                 on_release: Callable[[], None]) -> None:
        self.placement = placement
        self.reservation = reservation
        self.waited_s = waited_s
        self._on_release = on_release
        self._hooks: list[Callable[[], None]] = []

    @property
    def released(self) -> bool:
        return self.reservation.released

    def add_engine(self, engine: Engine, tokens: int) -> None:
        """Hold ``tokens`` on one more engine (a trigger pair's prefill engine, see Reservation)."""
        self.reservation.add_engine(engine, tokens)

    def release_engine(self, engine: Engine) -> None:
        """Give one engine's share back early (the prefill leg of a P/D handoff finished)."""
        if self.reservation.release_engine(engine):
            self._on_release()

    def when_released(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` once, when the grant is released (what the caller counted on its engines)."""
        self._hooks.append(hook)

    def release(self) -> None:
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()
        if self.reservation.release():
            self._on_release()

    def __enter__(self) -> Grant:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


@dataclass(eq=False)
class _Waiter:
    key: tuple[int, int]                 # (priority, arrival seq): the order within its tenant's line
    req: SchedRequest
    place: Place
    prefill_tokens: PrefillTokens
    arrived: float
    future: asyncio.Future[Grant] = field(repr=False)


class AdmissionController:
    """Token-based flow control in front of the scheduler. One per coordinator; event-loop bound."""

    def __init__(self, settings: AdmissionSettings, ledger: TokenLedger, metrics: Metrics | None = None,
                 *, tick_s: float = 0.25, weight: Callable[[str], float] = lambda tenant: 1.0,
                 queue_share: bool = True, fleet_shares: bool = False,
                 capacity: Callable[[], int] = lambda: 0,
                 tenant_names: Callable[[], Iterable[str]] = tuple,
                 headroom_window_s: float | None = None,
                 engines: Callable[[], Iterable[Engine]] = tuple) -> None:
        self._settings = settings
        self.ledger = ledger
        if not settings.enabled:
            ledger.enforce = False
        self._metrics = metrics
        self._tick_s = tick_s
        self._weight = weight              # a tenant's weight, read at each grant (tenants may reload)
        self._queue_share = queue_share
        self._fleet_shares = fleet_shares
        self.fleet_share_holds = 0  # times a tenant over its fleet share was held back (tests read it)
        self._capacity = capacity          # the budget shares split: global limit, else the engines'
        self._tenant_names = tenant_names  # the configured tenants (each process publishes them all)
        self._waiting: dict[str, int] = {}  # tenant → tokens of its waiters
        self._headroom_window = headroom_window_s  # None: no headroom for light tenants
        self._engines = engines  # where headroom may already be free
        self._recent: dict[str, tuple[float, int]] = {}  # tenant → (latest arrival, largest cost since)
        self._lines: dict[str, list[_Waiter]] = {}  # tenant → its waiters sorted by key (none empty)
        self._count = 0
        self._vtime: dict[str, float] = {}  # tenant → virtual time after its last grant
        self._vnow = 0.0                    # the latest grant's virtual start: where idle tenants resume
        self._seq = 0
        self._waking = False
        self._wake_again = False
        self._wake_scheduled = False
        self._ticker: asyncio.Task[None] | None = None
        if metrics is not None:
            metrics.global_inflight_tokens.set_function(lambda: float(ledger.global_inflight))

    @property
    def queue_length(self) -> int:
        return self._count

    def tenant_queue_length(self, tenant: str) -> int:
        return len(self._lines.get(tenant, ()))

    # -- admission --------------------------------------------------------------------------------
    async def admit(self, req: SchedRequest, place: Place, *,
                    prefill_tokens: PrefillTokens = no_prefill) -> Grant:
        """Reserve engines for ``req``, waiting for room if need be.

        ``place`` is the scheduler: a Placement among engines with room, None when eligible engines
        exist but none has room, ``NoHealthyEngine`` when none could take it now (propagated).
        ``prefill_tokens`` says what a P/D placement reserves on its prefill engine.
        Raises ``QueueFull`` (429), ``QueueTimeout`` (503), or ``CancelledError`` if the caller is
        cancelled while waiting (the waiter is removed and nothing stays reserved).
        """
        arrived = time.monotonic()
        if self._headroom_window is not None:
            seen, largest = self._recent.get(req.tenant, (0.0, 0))
            if arrived - seen > self._headroom_window:
                largest = 0  # idle for a window: start over
            self._recent[req.tenant] = (arrived, max(largest, req.cost_tokens))
        waiters_ahead = self._ahead(req.tenant, req.priority)
        if (not waiters_ahead and self.ledger.global_room(req.cost_tokens)
                and self.ledger.tenant_room(req.tenant, req.cost_tokens)
                and self._within_share(req.tenant, req.cost_tokens)):
            placement = self._place_now(req, place)
            if placement is not None:
                grant = self._grant(req, placement, prefill_tokens, arrived)
                if not self.ledger.fleet.shared or await self._claimed(grant):  # no await for one process
                    return grant
        if not self._settings.enabled or not self._make_room(req.tenant):
            self._refuse(req.tenant)
        return await self._wait(req, place, prefill_tokens, arrived, try_now=waiters_ahead)

    def check_early(self, priority: int, tenant: str = "default") -> None:
        """Refuse now, before the request is even rendered, when ``admit`` would certainly refuse it:
        the queue is full, the tenant may not push anyone out, and someone waits ahead (so the fast
        path is closed too). At 3x overload this saves the render sidecar most of its work and cuts a
        429 to ~1 ms."""
        if (self._settings.enabled and self._count >= self._settings.max_queue
                and self._ahead(tenant, priority) and self._victim(tenant) is None):
            self._refuse(tenant)

    def _refuse(self, tenant: str) -> None:
        self._reject("queue_full", tenant)
        raise QueueFull(f"Too many requests are waiting for capacity ({self._count}); retry later",
                        self._settings.retry_after_s)

    def _ahead(self, tenant: str, priority: int) -> bool:
        """Someone waits who would go first: another tenant (fair order decides, at the next wake) or
        one of this tenant's at least as urgent."""
        if not self._count:
            return False
        line = self._lines.get(tenant)
        return len(self._lines) > (1 if line else 0) or (line is not None and line[0].key[0] <= priority)

    # -- fleet shares ------------------------------------------------------------------------------
    def _within_share(self, tenant: str, tokens: int) -> bool:
        """With a shared fleet: may ``tenant`` take ``tokens`` more while others wait (see the
        module's rules)? Always yes for one process (the fair order does it there), while degraded,
        with nobody else waiting, and for a tenant holding nothing in the fleet."""
        fleet = self.ledger.fleet
        if not self._fleet_shares or not fleet.shared or fleet.degraded:
            return True
        held = self.ledger.tenant_inflight(tenant) + fleet.others(tenant_slot(tenant))
        if held == 0:
            return True
        names = {*self._tenant_names(), *self._lines, tenant}
        waiting = {n: self._waiting.get(n, 0) + fleet.others(waiting_slot(n)) for n in names}
        if not any(w > 0 for n, w in waiting.items() if n != tenant):
            return True
        demand = {n: self.ledger.tenant_inflight(n) + fleet.others(tenant_slot(n)) + waiting[n]
                  for n in names}
        demand[tenant] = max(demand[tenant], held + tokens)
        alloc = fair_allocation(demand, self._weight, self._capacity())
        if held + tokens <= alloc.get(tenant, 0.0):
            return True
        self.fleet_share_holds += 1
        return False

    def fleet_totals(self, engines: list[Engine]) -> dict[str, int]:
        """What this process writes to the fleet at each lease renewal: the ledger's totals, and for
        fleet shares every tenant's held and waiting tokens (zeros included, so others' mirrors see
        them drop)."""
        out = self.ledger.totals(engines)
        if self._fleet_shares:
            for name in {*self._tenant_names(), *self._waiting, *self.ledger.tenant_names()}:
                out.setdefault(tenant_slot(name), self.ledger.tenant_inflight(name))
                out[waiting_slot(name)] = self._waiting.get(name, 0)
        return out

    # -- queue shares ------------------------------------------------------------------------------
    def _victim(self, tenant: str) -> str | None:
        """With a full queue: the tenant whose newest waiter gives its place to ``tenant`` (the one
        furthest over its share), or None when ``tenant`` holds its own share already. Shares are
        ``max_queue`` split by weight among the tenants waiting, ``tenant`` included."""
        if not self._queue_share:
            return None
        total = sum(self._weight(n) for n in set(self._lines) | {tenant})

        def over(name: str) -> float:
            return len(self._lines.get(name, ())) - self._settings.max_queue * self._weight(name) / total

        if over(tenant) + 1 > 0:
            return None
        victim = max((n for n in self._lines if n != tenant), key=over, default=None)
        return victim if victim is not None and over(victim) > 0 else None

    def _make_room(self, tenant: str) -> bool:
        """A place in the queue for ``tenant``: free, or taken from a tenant over its share."""
        if self._count < self._settings.max_queue:
            return True
        victim = self._victim(tenant)
        if victim is None:
            return False
        waiter = self._lines[victim][-1]  # its least urgent, newest
        self._remove(waiter)
        if not waiter.future.done():
            self._reject("queue_full", victim)
            waiter.future.set_exception(QueueFull(
                f"Too many requests are waiting for capacity ({self._count}); this tenant holds more "
                f"than its share of the queue; retry later", self._settings.retry_after_s))
        return True

    def _place_now(self, req: SchedRequest, place: Place) -> Placement | None:
        try:
            return self._place(req, place)
        except NoHealthyEngine:
            self._reject("no_engine")
            raise

    def _place(self, req: SchedRequest, place: Place, headroom: int | None = None) -> Placement | None:
        """``place(req)`` with the room a tenant over its share must leave for lighter ones."""
        if headroom is None:
            headroom = self._headroom(req.tenant, req.model)
        if not headroom:
            return place(req)
        with self.ledger.holding_back(headroom):
            return place(req)

    def _headroom(self, tenant: str, model: str) -> int:
        """Tokens ``tenant`` must leave free on each engine (see the module's rules): the largest
        request a tenant under its share sent while active, when ``tenant`` is over its own share."""
        if self._headroom_window is None or len(self._recent) < 2:
            return 0
        now = time.monotonic()
        active = {n: cost for n, (seen, cost) in self._recent.items() if now - seen <= self._headroom_window}
        for name in [n for n in self._recent if n not in active]:
            del self._recent[name]  # forgotten after the window: the dict stays as small as the tenants
        if tenant not in active or len(active) < 2:
            return 0
        total = sum(self._weight(n) for n in active)
        capacity = self._capacity()

        def under(name: str) -> bool:
            return self.ledger.tenant_inflight(name) < capacity * self._weight(name) / total

        if under(tenant):
            return 0
        need = max((cost for n, cost in active.items() if n != tenant and under(n)), default=0)
        # The room is kept on HEADROOM_ENGINES engines, not on every one: while more of the model's
        # engines could each take the light request, one more heavy request leaves enough of them.
        free = 0
        for engine in self._engines():
            if engine.available and engine.serves(model) and self.ledger.engine_room(engine, need):
                free += 1
                if free > HEADROOM_ENGINES:
                    return 0
        return need

    async def _claimed(self, grant: Grant) -> bool:
        """Claim a local grant in the fleet (other coordinator processes on the same engines); a
        refusal (another process took the room first) gives it back."""
        if await self.ledger.fleet.claim(self.ledger.slots(grant.reservation)):
            return True
        grant.release()
        return False

    async def _wait(self, req: SchedRequest, place: Place, prefill_tokens: PrefillTokens,
                    arrived: float, *, try_now: bool) -> Grant:
        self._seq += 1
        key = (req.priority, self._seq)
        waiter = self._queue_up(key, req, place, prefill_tokens, arrived)
        future = waiter.future
        if try_now:
            # We queued only because others wait ahead; those that fit and this one may go now.
            self.wake()
        try:
            async with asyncio.timeout(self._settings.queue_timeout_s):
                while True:
                    grant = await future
                    if not self.ledger.fleet.shared or await self._claimed(grant):
                        return grant
                    # Another process took the room: wait again in the same place in the queue.
                    waiter = self._queue_up(key, req, place, prefill_tokens, arrived)
                    future = waiter.future
        except TimeoutError:
            self._remove(waiter)
            if future.done() and not future.cancelled():
                error = future.exception()
                if error is None:
                    return future.result()        # admitted just as the timeout fired: keep it
                raise error from None             # failed (NoHealthyEngine) just as it fired
            future.cancel()
            self._reject("queue_timeout", req.tenant)
            raise QueueTimeout(f"No capacity freed up within {self._settings.queue_timeout_s:g} s; "
                               f"retry later", self._settings.retry_after_s) from None
        except asyncio.CancelledError:
            self._remove(waiter)
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()         # admitted just as the client left: give it back
            elif future.done() and not future.cancelled():
                future.exception()                # mark retrieved; the cancellation wins
            future.cancel()
            self._reject("cancelled", req.tenant)
            raise

    def _queue_up(self, key: tuple[int, int], req: SchedRequest, place: Place, prefill_tokens: PrefillTokens,
                  arrived: float) -> _Waiter:
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(key, req, place, prefill_tokens, arrived, future)
        self._enqueue(waiter)
        return waiter

    def _grant(self, req: SchedRequest, placement: Placement, prefill_tokens: PrefillTokens,
               arrived: float) -> Grant:
        prefill = prefill_tokens(placement) if placement.prefill is not None else 0
        reservation = self.ledger.reserve(placement, req.cost_tokens, prefill, tenant=req.tenant)
        # Weighted fair queuing: the grant starts at the tenant's virtual time (or now, if it was idle)
        # and advances it by cost / weight.
        start = max(self._vtime.get(req.tenant, 0.0), self._vnow)
        self._vnow = start
        self._vtime[req.tenant] = start + req.cost_tokens / self._weight(req.tenant)
        waited = time.monotonic() - arrived
        if self._metrics is not None:
            self._metrics.admitted.inc()
            self._metrics.queue_wait.observe(waited)
            self._metrics.tenant_admitted_tokens.labels(req.tenant).inc(req.cost_tokens)
        return Grant(placement, reservation, waited, self._released)

    # -- waking -----------------------------------------------------------------------------------
    def wake(self) -> None:
        """Admit the waiters that fit now, in fair order (see the module's rules).

        Stops at the first waiter whose cost does not fit the global budget (everyone shares it, so a
        smaller, later request must not overtake); skips, leaving it waiting, one whose engines are
        full (``place`` returns None), since a later waiter may need other engines. Re-entrant calls
        (from ``place`` or a release inside it) are folded into one more pass.
        """
        if self._waking:
            self._wake_again = True
            return
        self._waking = True
        try:
            self._wake_again = True
            while self._wake_again:
                self._wake_again = False
                self._wake_pass()
        finally:
            self._waking = False

    def _order(self) -> list[_Waiter]:
        """Every waiter in the order a wake tries them: the lines merged by virtual time, as if each
        were granted in turn (one line: its own order)."""
        if len(self._lines) == 1:
            return list(next(iter(self._lines.values())))
        # Ties go to the tenant holding fewer tokens (a light tenant's second request is not put
        # behind a heavy tenant's next one because both tags are equal).
        heap = [(max(self._vtime.get(name, 0.0), self._vnow), self.ledger.tenant_inflight(name), i, name, 0)
                for i, name in enumerate(self._lines)]
        heapq.heapify(heap)
        out: list[_Waiter] = []
        while heap:
            vtime, held, i, name, j = heapq.heappop(heap)
            line = self._lines[name]
            out.append(line[j])
            if j + 1 < len(line):
                cost = line[j].req.cost_tokens
                heapq.heappush(heap, (vtime + cost / self._weight(name), held + cost, i, name, j + 1))
        return out

    def _wake_pass(self) -> None:
        full: set[str] = set()  # tenants at their concurrent_tokens (or fleet share) this pass
        # Models whose engines had no room for a waiter: later waiters of the same model are not
        # tried, so a smaller request cannot take the room a larger one ahead of it waits for (it
        # would starve large requests, and a light tenant's behind a heavy tenant's small ones).
        # ``held``: no room once a tenant over its share leaves its headroom (tenants under theirs
        # may still fit).
        no_room: set[str] = set()
        held: set[str] = set()
        for waiter in self._order():
            if waiter.future.done():        # cancelled or timed out; its task removes it too
                self._remove(waiter)
                continue
            tenant, model = waiter.req.tenant, waiter.req.model
            if tenant in full or model in no_room:
                continue
            headroom = self._headroom(tenant, model)
            if headroom and model in held:
                continue
            if not self.ledger.global_room(waiter.req.cost_tokens):
                break
            if not (self.ledger.tenant_room(tenant, waiter.req.cost_tokens)
                    and self._within_share(tenant, waiter.req.cost_tokens)):
                full.add(tenant)
                continue
            try:
                placement = self._place(waiter.req, waiter.place, headroom)
            except Exception as exc:
                self._remove(waiter)
                if isinstance(exc, NoHealthyEngine):
                    self._reject("no_engine")
                else:
                    log.exception("place() failed for waiting request %s", waiter.req.request_id)
                waiter.future.set_exception(exc)
                continue
            if placement is None:
                (held if headroom else no_room).add(model)
                continue
            self._remove(waiter)
            waiter.future.set_result(self._grant(waiter.req, placement, waiter.prefill_tokens,
                                                 waiter.arrived))

    def _released(self) -> None:
        """Tokens came back: wake the waiters soon, not from inside the releaser's call stack."""
        if not self._count or self._wake_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.wake()
            return
        self._wake_scheduled = True
        loop.call_soon(self._scheduled_wake)

    def _scheduled_wake(self) -> None:
        self._wake_scheduled = False
        self.wake()

    async def _tick(self) -> None:
        """Breakers close and engines come back without any release: retry waiters periodically."""
        while self._count:
            await asyncio.sleep(self._tick_s)
            self.wake()

    # -- queue ------------------------------------------------------------------------------------
    def _enqueue(self, waiter: _Waiter) -> None:
        line = self._lines.get(waiter.req.tenant)
        if line is None:
            line = self._lines[waiter.req.tenant] = []
        bisect.insort(line, waiter, key=lambda w: w.key)
        self._count += 1
        self._waiting[waiter.req.tenant] = self._waiting.get(waiter.req.tenant, 0) + waiter.req.cost_tokens
        self._queue_changed()
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="admission-wake")

    def _remove(self, waiter: _Waiter) -> None:
        line = self._lines.get(waiter.req.tenant)
        if line is not None:
            i = bisect.bisect_left(line, waiter.key, key=lambda w: w.key)
            if i < len(line) and line[i] is waiter:
                del line[i]
                self._count -= 1
                self._waiting[waiter.req.tenant] = max(0, self._waiting.get(waiter.req.tenant, 0)
                                                       - waiter.req.cost_tokens)
                if not line:
                    del self._lines[waiter.req.tenant]
                self._queue_changed()
        if not self._count and self._ticker is not None:
            if self._ticker is not asyncio.current_task():
                self._ticker.cancel()
            self._ticker = None

    def _queue_changed(self) -> None:
        if self._metrics is not None:
            self._metrics.queue_length.set(self._count)

    def _reject(self, reason: str, tenant: str | None = None) -> None:
        if self._metrics is not None:
            self._metrics.rejected.labels(reason).inc()
            if tenant is not None:
                self._metrics.tenant_rejected.labels(tenant, reason).inc()

    def export_metrics(self) -> None:
        """Per-tenant queue lengths and held tokens (called at scrape time)."""
        if self._metrics is None:
            return
        for tenant in {*self.ledger.tenant_names(), *self._lines, *self._vtime}:
            self._metrics.tenant_queue_length.labels(tenant).set(len(self._lines.get(tenant, ())))
            self._metrics.tenant_inflight_tokens.labels(tenant).set(self.ledger.tenant_inflight(tenant))

    async def close(self) -> None:
        """Stop the periodic wake (shutdown); waiters still queued time out or are cancelled."""
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
