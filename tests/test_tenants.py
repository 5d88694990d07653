"""Tenants: keys read whitespace-safe and fail closed, compared in constant time, limits answered with 429."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from compaction.chunk_cache import scope_of
from compaction.options import CompactionOptions
from serving import tenants
from serving.coordinator import CompactJob
from serving.tenants import (
    DEFAULT_TENANT,
    KeyTable,
    Limiter,
    TenancyConfig,
    TenantGate,
    TenantLimits,
    check_exposure,
    read_keys,
)

CONFIG = TenancyConfig(api_key_env="K", api_keys_env="KS")


def test_keys_survive_whitespace_and_newlines(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\n  team-a : alpha-key-0123456789  \n\nteam-b:beta#key-0123456789 # rotated monthly\n")
    config = CONFIG.model_copy(update={"api_keys_file": str(keys)})
    found = read_keys(
        config, {"K": "solo-key-0123456789\n", "KS": " team-c:gamma-0123456789\n, team-d:delta-0123456789 ,"}
    )
    assert found == [
        (DEFAULT_TENANT, "solo-key-0123456789"),
        ("team-c", "gamma-0123456789"),
        ("team-d", "delta-0123456789"),
        ("team-a", "alpha-key-0123456789"),
        ("team-b", "beta#key-0123456789"),  # a '#' inside a key is part of it
    ]
    table = KeyTable(found)
    solo = table.match("solo-key-0123456789")
    assert solo is not None and solo.id == DEFAULT_TENANT
    assert table.match(" alpha-key-0123456789\n").id == "team-a"  # type: ignore[union-attr]
    assert table.match("alpha-key-012345678") is None and table.match("") is None


@pytest.mark.parametrize(
    ("environ", "file_text", "says"),
    [
        ({"K": "  \n"}, None, "K is set but empty"),
        ({"KS": " , \n"}, None, "KS is set but holds no tenant:key"),
        ({"KS": "just-a-key"}, None, "tenant:key"),
        ({"KS": "bad tenant!:k"}, None, "tenant id"),
        ({"K": "same-0123456789ab", "KS": "b:same-0123456789ab"}, None, "the same API key is configured twice"),
        ({"K": "short"}, None, "K has 5 characters, fewer than 16; use a random key"),
        ({}, "a: short-key\n", "tenant a's key has 9 characters"),
        ({}, "# nothing here\n\n", "holds no tenant:key line"),
    ],
)
def test_an_unusable_key_source_never_means_no_auth(
    tmp_path: Path, environ: dict[str, str], file_text: str | None, says: str
) -> None:
    config = CONFIG
    if file_text is not None:
        (tmp_path / "keys").write_text(file_text)
        config = CONFIG.model_copy(update={"api_keys_file": str(tmp_path / "keys")})
    with pytest.raises(ValueError, match=says):
        read_keys(config, environ)


def test_a_missing_keys_file_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        read_keys(CONFIG.model_copy(update={"api_keys_file": str(tmp_path / "absent")}), {})


def test_every_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """compare_digest on equal-length digests for every configured key, whichever matches (or none)."""
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    table = KeyTable([("a", "first-key"), ("b", "a-much-longer-second-key"), ("c", "k3")])
    monkeypatch.setattr(tenants.hmac, "compare_digest", counting)
    for token, tenant in (("first-key", "a"), ("k3", "c"), ("wrong", None)):
        calls.clear()
        found = table.match(token)
        assert (found.id if found else None) == tenant
        assert len(calls) == 3 and {len(a) for a, _ in calls} | {len(b) for _, b in calls} == {32}
        assert calls[0][0] == hashlib.sha256(token.encode()).digest()


def test_salts_only_with_several_tenants_and_not_guessable_from_the_id() -> None:
    assert KeyTable([(DEFAULT_TENANT, "only")]).tenants[DEFAULT_TENANT].cache_salt is None
    table = KeyTable([("a", "ka"), ("b", "kb"), ("b", "kb2")])
    salt_a, salt_b = table.tenants["a"].cache_salt, table.tenants["b"].cache_salt
    assert salt_a and salt_b and salt_a != salt_b and len(salt_a) == 64
    assert salt_a == KeyTable([("b", "kb2"), ("a", "ka"), ("b", "kb")]).tenants["a"].cache_salt  # every replica agrees
    assert salt_a not in {hashlib.sha256(b"a").hexdigest(), hashlib.blake2b(b"a", digest_size=32).hexdigest()}
    assert table.tenants["a"].salted("mine") not in {salt_a, "mine", table.tenants["b"].salted("mine")}


def test_the_ingress_refuses_an_exposed_host_without_a_key() -> None:
    none = KeyTable([])
    with pytest.raises(ValueError, match=r"0\.0\.0\.0.*set K .*KS.*allow_unauthenticated: true"):
        check_exposure(none, "0.0.0.0", False, CONFIG)
    with pytest.raises(ValueError, match="an unknown host"):
        check_exposure(none, None, False, CONFIG)  # the host could not be read: treated as exposed
    for host in ("127.0.0.1", "localhost", "::1"):
        check_exposure(none, host, False, CONFIG)
    check_exposure(none, "0.0.0.0", True, CONFIG)
    check_exposure(KeyTable([("a", "k")]), "0.0.0.0", False, CONFIG)


def test_the_limiter_caps_concurrency_and_rate_per_tenant() -> None:
    now = [0.0]
    limits = TenantLimits(max_concurrent_requests=2, requests_per_minute=60, burst=3)
    limiter = Limiter(CONFIG.model_copy(update={"overrides": {"slow": limits}}), clock=lambda: now[0])
    assert limiter.admit("slow") is None and limiter.admit("slow") is None
    refused = limiter.admit("slow")
    assert refused is not None and refused[0] == 1.0 and "2 requests" in refused[1]
    limiter.release("slow")
    limiter.release("slow")
    assert limiter.admit("slow") is None  # the third of the burst
    limiter.release("slow")
    wait = limiter.admit("slow")
    assert wait is not None and wait[0] == pytest.approx(1.0) and "60 requests/min" in wait[1]
    now[0] = 1.0
    assert limiter.admit("slow") is None  # one token back after a second
    assert all(limiter.admit("other") is None for _ in range(50))  # the default limits: another tenant is free


def gate_app(table: KeyTable, config: TenancyConfig) -> FastAPI:
    api = FastAPI()
    api.add_middleware(TenantGate, config=config, table=table)

    @api.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        tenant = request.state.tenant
        return {"tenant": tenant.id, "salted": tenant.cache_salt is not None}

    @api.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return api


def test_the_gate_names_the_tenant_and_limits_each_alone() -> None:
    table = KeyTable([("a", "key-a"), ("b", "key-b")])
    config = CONFIG.model_copy(update={"overrides": {"a": TenantLimits(requests_per_minute=6, burst=1)}})
    client = TestClient(gate_app(table, config))
    assert client.get("/healthz").status_code == 200
    refused = client.get("/v1/models", headers={"authorization": "Bearer key-c"})
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["type"] == "authentication_error"
    first = client.get("/v1/models", headers={"authorization": "Bearer key-a"})
    assert first.json() == {"tenant": "a", "salted": True}
    limited = client.get("/v1/models", headers={"authorization": "Bearer key-a"})
    assert limited.status_code == 429 and limited.headers["retry-after"] == "10"
    error = limited.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == 429 and "Retry-After" in error["message"]
    other = client.get("/v1/models", headers={"x-api-key": "key-b"})
    assert other.status_code == 200 and other.json()["tenant"] == "b"


def test_without_keys_everyone_is_the_one_unsalted_tenant() -> None:
    client = TestClient(gate_app(KeyTable([]), CONFIG))
    assert client.get("/v1/models").json() == {"tenant": DEFAULT_TENANT, "salted": False}


def test_dedup_and_the_chunk_cache_are_per_tenant() -> None:
    options = CompactionOptions()
    job = CompactJob(model="m", messages=[], options=options, session_id="s")
    assert job.key() != job.model_copy(update={"tenant": "other"}).key()
    assert scope_of(options, "a") != scope_of(options, "b") and scope_of(options, "a") == scope_of(options, "a")


async def test_a_tenants_slot_is_free_once_the_last_byte_of_its_answer_is_sent() -> None:
    """Through Serve's proxy a client can hold a whole answer before the app returns: its next request must fit."""
    seen: list[tuple[float, str] | None] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        seen.append(gate.limiter.admit("a"))  # the client's next request, while the app still runs

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(message: Any) -> None:
        return None

    config = CONFIG.model_copy(update={"overrides": {"a": TenantLimits(max_concurrent_requests=1)}})
    gate = TenantGate(app, config, KeyTable([("a", "key-a")]))
    scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", b"Bearer key-a")]}
    await gate(scope, receive, send)
    assert seen == [None]
