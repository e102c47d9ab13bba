"""Weighted max-min fair shares of one budget: what each tenant may hold when tenants compete.

Used for the fleet (``tenants.fleet_shares``): each coordinator process orders its own queue by
weighted fair queuing, but a process that only ever sees tenant A would otherwise take every token
another process's tenant B waits for (it learns of freed room first). With the fleet's in-flight
and waiting tokens per tenant (from Redis), every process computes the same allocation and holds
its tenants to it while another tenant waits anywhere in the fleet.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


def fair_allocation(demand: Mapping[str, int], weight: Callable[[str], float],
                    capacity: float) -> dict[str, float]:
    """Water-filling: tenants that want less than their weighted share get what they want, the rest
    split what is left by weight. ``demand``: tokens held + waiting per tenant."""
    alloc: dict[str, float] = {}
    active = {t for t, d in demand.items() if d > 0}
    left = float(capacity)
    while active:
        total = sum(weight(t) for t in active)
        share = {t: left * weight(t) / total for t in active}
        satisfied = {t for t in active if demand[t] <= share[t]}
        if not satisfied:
            alloc.update(share)
            break
        for t in satisfied:
            alloc[t] = float(demand[t])
            left -= demand[t]
        active -= satisfied
    return alloc
