"""Tenants: API keys mapped to tenants, checked in constant time, with per-tenant concurrency and rate limits.

Where the keys come from (read in the ingress's own process, never shipped in a runtime_env):

    COMPACTION_API_KEY   (tenancy.api_key_env)    one key: the tenant "default"
    COMPACTION_API_KEYS  (tenancy.api_keys_env)   tenant:key entries, separated by commas or newlines
    tenancy.api_keys_file                         a file of tenant:key lines ('#' after a space: a comment)

Whitespace around a key, an entry or the whole value is dropped (a trailing newline from a Secret or
`echo` never breaks matching); a variable that is set but holds no key is an error, never "auth off".
No key anywhere: the one tenant "default", unauthenticated, which the ingress allows only on loopback
(or with `allow_unauthenticated`).

A presented key is compared with every configured key (`hmac.compare_digest` of their SHA-256
digests, so neither the position of a match nor the key's length shows in the time taken).

With two or more tenants, each gets a `cache_salt` for the engines' prefix cache, derived from its
keys (an HMAC, so no one without a tenant's key can compute it): one tenant's prompts never hit
another's cached blocks, and cached-token counts tell nothing about other tenants. One tenant: no salt.

`TenantGate` is the ASGI middleware: it authenticates (401), admits under the tenant's limits (429 +
Retry-After: `max_concurrent_requests` running at once, `requests_per_minute` as a token bucket of
`burst` requests) and puts the `Tenant` in `request.state.tenant` for the handlers. Limits are per
ingress replica.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_TENANT = "default"
TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
OPEN_PATHS = frozenset({"/healthz", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc"})
LOOPBACK_HOSTS = frozenset({"localhost", "::1", "ip6-localhost"})


class TenantLimits(BaseModel):
    """What one tenant may run through one ingress replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_concurrent_requests: int | None = Field(
        256, ge=1, le=1_000_000, description="Requests of the tenant in flight at once; more get 429. None: no cap."
    )
    requests_per_minute: float | None = Field(
        None, gt=0, le=1e7, description="Sustained request rate; beyond it (and its burst) 429. None: no cap."
    )
    burst: int | None = Field(
        None, ge=1, le=1_000_000, description="Requests allowed at once above the rate; None: 10 s of the rate."
    )


class TenancyConfig(BaseModel):
    """Where the keys are and the tenants' limits (names and paths only: no secret travels in this)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    api_key_env: str = Field(
        "COMPACTION_API_KEY",
        min_length=1,
        max_length=256,
        description="Env var of the ingress's process holding one API key (the tenant 'default'); when any key "
        "is set, every endpoint but /healthz and /docs needs Authorization: Bearer <key> (or x-api-key).",
    )
    api_keys_env: str = Field(
        "COMPACTION_API_KEYS",
        min_length=1,
        max_length=256,
        description="Env var of the ingress's process holding tenant:key entries, separated by commas or newlines.",
    )
    api_keys_file: str | None = Field(
        None,
        min_length=1,
        max_length=4096,
        description="Path, on the ingress's node, of a file of tenant:key lines ('#' comments), e.g. a mounted "
        "Kubernetes Secret.",
    )
    limits: TenantLimits = Field(
        default_factory=TenantLimits, description="Every tenant's limits, per ingress replica (429 + Retry-After)."
    )
    overrides: dict[str, TenantLimits] = Field(
        default_factory=dict, description="Limits of particular tenants (by tenant id), replacing `limits`."
    )

    def limits_of(self, tenant: str) -> TenantLimits:
        return self.overrides.get(tenant, self.limits)


@dataclass(frozen=True)
class Tenant:
    """Who sent a request, as the handlers and the coordinator see it."""

    id: str  # namespaces sessions, background runs, dedup, the chunk-summary cache and prompt counters
    cache_salt: str | None = None  # the engines' prefix-cache salt of this tenant; None: a single tenant

    def salted(self, own: str | None) -> str | None:
        """The cache_salt to send the engine for a request that asked for `own` (None: not asked)."""
        if self.cache_salt is None or own is None:
            return self.cache_salt or own
        return hmac.new(self.cache_salt.encode(), own.encode(), hashlib.sha256).hexdigest()


ANONYMOUS = Tenant(DEFAULT_TENANT)


MIN_KEY_CHARS = 16  # a shorter API key is refused at start-up: it could be guessed
_COMMENT = re.compile(r"(^|\s)#.*$")  # a comment starts at a '#' that opens the line or follows a space


def _check_length(key: str, what: str) -> None:
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(
            f"{what} has {len(key)} characters, fewer than {MIN_KEY_CHARS}; use a random key, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )


def _entries(text: str, source: str, sep: str) -> list[tuple[str, str]]:
    """tenant:key entries of `text` (split on `sep` and newlines; blanks and # comments skipped)."""
    out = []
    for raw in re.split(f"[{re.escape(sep)}\\n]", text):
        line = _COMMENT.sub("", raw).strip() if sep == "\n" else raw.strip()
        if not line:
            continue
        tenant, colon, key = line.partition(":")
        tenant, key = tenant.strip(), key.strip()
        if not colon or not key:
            raise ValueError(f"{source}: an entry is tenant:key, got one without a key")
        if not TENANT_ID.match(tenant):
            raise ValueError(f"{source}: tenant id {tenant!r} must match {TENANT_ID.pattern}")
        _check_length(key, f"{source}: tenant {tenant}'s key")
        out.append((tenant, key))
    return out


def read_keys(config: TenancyConfig, environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """Every configured (tenant, key). Raises ValueError for a source that is set but unusable."""
    env = os.environ if environ is None else environ
    keys: list[tuple[str, str]] = []
    single = env.get(config.api_key_env)
    if single is not None:
        if not single.strip():
            raise ValueError(f"{config.api_key_env} is set but empty; set it to the API key, or unset it")
        _check_length(single.strip(), config.api_key_env)
        keys.append((DEFAULT_TENANT, single.strip()))
    many = env.get(config.api_keys_env)
    if many is not None:
        found = _entries(many, config.api_keys_env, ",")
        if not found:
            raise ValueError(f"{config.api_keys_env} is set but holds no tenant:key entry")
        keys += found
    if config.api_keys_file is not None:
        path = Path(config.api_keys_file)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ValueError(f"api_keys_file {path}: cannot be read ({exc.strerror})") from exc
        found = _entries(text, f"api_keys_file {path}", "\n")
        if not found:
            raise ValueError(f"api_keys_file {path} holds no tenant:key line")
        keys += found
    if len({key for _, key in keys}) != len(keys):
        raise ValueError("the same API key is configured twice; every key names one tenant")
    return keys


class KeyTable:
    """Configured keys -> tenants. Empty: no auth (the anonymous tenant)."""

    def __init__(self, keys: Iterable[tuple[str, str]]) -> None:
        pairs = list(keys)
        self._digests = [(_sha(key), tenant) for tenant, key in pairs]
        ids = sorted({tenant for tenant, _ in pairs})
        salts = {t: _salt(t, [k for tenant, k in pairs if tenant == t]) for t in ids} if len(ids) > 1 else {}
        self.tenants = {t: Tenant(t, salts.get(t)) for t in ids}

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def match(self, token: str) -> Tenant | None:
        """The tenant of `token`, comparing it with every key (no early exit: the time does not say which)."""
        presented = _sha(token.strip())
        found: str | None = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return self.tenants[found] if found is not None else None


def _sha(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _salt(tenant: str, keys: list[str]) -> str:
    return hmac.new(min(keys).encode(), f"cache_salt:{tenant}".encode(), hashlib.sha256).hexdigest()


def is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def check_exposure(table: KeyTable, host: str | None, allow_unauthenticated: bool, config: TenancyConfig) -> None:
    """Refuse to serve beyond loopback without a key (fail closed), unless explicitly allowed."""
    if table.required or allow_unauthenticated or is_loopback(host):
        return
    raise ValueError(
        f"the service listens on {host or 'an unknown host'} but no API key reached the ingress: set "
        f"{config.api_key_env} (one key) or {config.api_keys_env} / api_keys_file (tenant:key entries) in the "
        "ingress's environment, or set the AppArg allow_unauthenticated: true to serve without auth"
    )


@dataclass
class _Usage:
    running: int = 0
    tokens: float = 0.0
    at: float | None = None


@dataclass
class Limiter:
    """Per-tenant admission: concurrency and a token bucket. `admit` says how long to wait, or None to go."""

    config: TenancyConfig
    clock: Callable[[], float] = time.monotonic
    _usage: dict[str, _Usage] = field(default_factory=dict)

    def limits(self, tenant: str) -> TenantLimits:
        return self.config.limits_of(tenant)

    def admit(self, tenant: str) -> tuple[float, str] | None:
        """None: admitted (call `release` when done); else (Retry-After seconds, the reason)."""
        limits = self.limits(tenant)
        usage = self._usage.setdefault(tenant, _Usage())
        if limits.max_concurrent_requests is not None and usage.running >= limits.max_concurrent_requests:
            return 1.0, f"{limits.max_concurrent_requests} requests of this tenant are running (its limit)"
        if limits.requests_per_minute is not None:
            rate = limits.requests_per_minute / 60.0
            capacity = float(limits.burst or max(1, math.floor(rate * 10)))
            now = self.clock()
            usage.tokens = capacity if usage.at is None else min(capacity, usage.tokens + (now - usage.at) * rate)
            usage.at = now
            if usage.tokens < 1.0:
                return (1.0 - usage.tokens) / rate, f"over this tenant's {limits.requests_per_minute:g} requests/min"
            usage.tokens -= 1.0
        usage.running += 1
        return None

    def release(self, tenant: str) -> None:
        self._usage[tenant].running -= 1


def _refusal(status: int, kind: str, message: str, retry: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(retry)))} if retry is not None else {}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def client_key(environ: Mapping[str, str] | None = None) -> str | None:
    """The key our own clients (jobs, benchmarks) send a service: COMPACTION_API_KEY, when set."""
    return (os.environ if environ is None else environ).get("COMPACTION_API_KEY", "").strip() or None


def client_headers(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    key = client_key(environ)
    return {"Authorization": f"Bearer {key}"} if key else {}


def tenant_of(request: Request) -> Tenant:
    """The request's tenant, named by `TenantGate` (the anonymous one where no keys are configured)."""
    tenant = getattr(request.state, "tenant", ANONYMOUS)
    return tenant if isinstance(tenant, Tenant) else ANONYMOUS


def allow_origins(app: FastAPI, origins: Sequence[str]) -> None:
    """CORS for exactly `origins` (none: no CORS headers at all). Add it last: a preflight carries no key."""
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "x-api-key", "content-type", "x-session-id", "x-request-id"],
        )


def presented_key(headers: Headers) -> str:
    """`Authorization: Bearer <key>`, else `x-api-key: <key>` (as the anthropic client sends it)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "").strip()


class TenantGate:
    """Authenticates every path but health and docs, admits under the tenant's limits, names the tenant.

    Built where the app runs (the ingress replica), so the keys are read from that process's environment.
    """

    def __init__(self, app: ASGIApp, config: TenancyConfig, table: KeyTable | None = None) -> None:
        self.app = app
        self.table = table if table is not None else KeyTable(read_keys(config))
        self.limiter = Limiter(config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        tenant = ANONYMOUS
        if self.table.required:
            found = self.table.match(presented_key(Headers(scope=scope)))
            if found is None:
                refusal = _refusal(401, "authentication_error", "send Authorization: Bearer <API key>")
                return await refusal(scope, receive, send)
            tenant = found
        refused = self.limiter.admit(tenant.id)
        if refused is not None:
            wait, why = refused
            message = f"rate limited: {why}; retry after the Retry-After seconds"
            return await _refusal(429, "rate_limit_error", message, wait)(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        held = True

        async def sending(message: Message) -> None:
            nonlocal held
            if held and message["type"] == "http.response.body" and not message.get("more_body", False):
                held = False  # freed before the last byte goes: a client that has it may send its next request
                self.limiter.release(tenant.id)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if held:
                self.limiter.release(tenant.id)
