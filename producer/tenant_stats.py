"""Reuse statistics per tenant (shared.tenants), for Describe: a tenant sees only its own calls'
store hits, shared flights, partial hits and tokens reused or computed, never whether another
tenant's context was reused. Bounded: the least recently active tenants are forgotten first (their
counts start again from zero). The process-wide totals stay in the metrics (operators' port)."""

from __future__ import annotations

import collections
from dataclasses import dataclass

MAX_TENANTS = 4096


@dataclass
class Reuse:
    store_hits: int = 0  # calls replayed from the store (no forward)
    shared: int = 0  # calls that joined a running flight
    partial_hits: int = 0  # calls that continued a stored prefix
    tokens_reused: int = 0
    tokens_computed: int = 0


class TenantStats:
    def __init__(self, limit: int = MAX_TENANTS):
        self.limit = limit
        self._by_tenant: collections.OrderedDict[str, Reuse] = collections.OrderedDict()

    def of(self, tenant: str) -> Reuse:
        """The tenant's counters (created, and made the most recent, on first use)."""
        reuse = self._by_tenant.get(tenant)
        if reuse is None:
            reuse = self._by_tenant[tenant] = Reuse()
            while len(self._by_tenant) > self.limit:
                self._by_tenant.popitem(last=False)
        self._by_tenant.move_to_end(tenant)
        return reuse

    def peek(self, tenant: str) -> Reuse:
        """The tenant's counters as they are (zeros for a tenant not seen), changing nothing."""
        return self._by_tenant.get(tenant) or Reuse()
