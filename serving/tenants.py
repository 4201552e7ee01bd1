"""Tenants: API keys (constant-time lookup), per-tenant limits on concurrent requests and queued tokens.

A tenant's name is also its prefix-cache salt, so two tenants never share KV pages unless they
are configured with the same `cache_group`.
"""

from __future__ import annotations

import hmac
import threading
from dataclasses import dataclass
from typing import Any

from jaxinfer.errors import ConfigError


@dataclass(frozen=True)
class Tenant:
    name: str
    api_key: str = ""
    max_concurrent: int = 0  # 0: no limit
    max_queued_tokens: int = 0  # prompt + max_tokens of the tenant's unfinished requests; 0: no limit
    cache_group: str = ""  # tenants with the same group share prefix-cache pages; "": the tenant alone
    admin: bool = False  # may load and unload LoRA adapters (with authentication off, everyone may)

    @property
    def cache_salt(self) -> str:
        return self.cache_group or f"tenant:{self.name}"


LOCAL = Tenant("local", admin=True)  # everyone, when authentication is off


class LimitExceeded(Exception):
    """A tenant limit would be exceeded; the message names the tenant, the limit and its value."""


def parse_tenants(entries: list[dict[str, Any]]) -> list[Tenant]:
    tenants = []
    for i, entry in enumerate(entries):
        try:
            tenant = Tenant(**entry)
        except TypeError as exc:
            raise ConfigError(f"serve.tenants[{i}]: {exc}") from None
        if not tenant.name or not tenant.api_key:
            raise ConfigError(f"serve.tenants[{i}]: name and api_key are required")
        tenants.append(tenant)
    if len({t.api_key for t in tenants}) != len(tenants):
        raise ConfigError("serve.tenants: two tenants share an api_key")
    return tenants


class TenantBook:
    """Who is calling (from the `authorization: Bearer KEY` metadata) and what they have in flight."""

    def __init__(self, tenants: list[Tenant], auth: bool):
        self.tenants, self.auth = tenants, auth
        self._lock = threading.Lock()
        self._concurrent: dict[str, int] = {}
        self._queued_tokens: dict[str, int] = {}

    def identify(self, metadata: tuple[tuple[str, str], ...] | None) -> Tenant | None:
        """The caller's tenant; None for a missing or unknown key. Every key is compared, in constant time."""
        if not self.auth:
            return LOCAL
        header = dict(metadata or ()).get("authorization", "")
        presented = header[7:] if header.startswith("Bearer ") else ""
        found = None
        for tenant in self.tenants:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(presented.encode(), tenant.api_key.encode()) and presented:
                found = tenant
        return found

    def admit(self, tenant: Tenant) -> None:
        """Counts a call in (before its prompt is tokenized), or raises LimitExceeded (max_concurrent)."""
        with self._lock:
            running = self._concurrent.get(tenant.name, 0)
            if tenant.max_concurrent and running >= tenant.max_concurrent:
                raise LimitExceeded(f"tenant {tenant.name}: {running} concurrent requests, the limit "
                                    f"(max_concurrent) is {tenant.max_concurrent}")
            self._concurrent[tenant.name] = running + 1

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Adds an admitted call's tokens (prompt and max_tokens), or raises LimitExceeded (max_queued_tokens)."""
        with self._lock:
            queued = self._queued_tokens.get(tenant.name, 0)
            if tenant.max_queued_tokens and queued + tokens > tenant.max_queued_tokens:
                raise LimitExceeded(f"tenant {tenant.name}: {queued} tokens queued plus {tokens} exceeds the limit "
                                    f"(max_queued_tokens) of {tenant.max_queued_tokens}")
            self._queued_tokens[tenant.name] = queued + tokens

    def refund(self, tenant: Tenant, tokens: int) -> None:
        """Takes back what `charge` added (the call has ended)."""
        with self._lock:
            self._queued_tokens[tenant.name] -= tokens

    def held(self) -> dict[str, int]:
        """Calls counted in and tokens charged over every tenant (both 0 once every call has ended)."""
        with self._lock:
            return {"held_tenant_calls": sum(self._concurrent.values()),
                    "held_tenant_tokens": sum(self._queued_tokens.values())}

    def release(self, tenant: Tenant) -> None:
        """Counts out a call that `admit` counted in."""
        with self._lock:
            self._concurrent[tenant.name] -= 1
