"""Tenants through the real service (the shared `service` fixture, keys in tests.support): auth, per-tenant limits,
and a tenant that knows another's session id and first messages getting nothing of it."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from typing import Any

import httpx
import pytest

from serving.ray_adapter import http_host
from serving.tenants import KeyTable, TenancyConfig, check_exposure
from tests.support import SERVED_MODEL, SERVICE_KEY, TENANT_KEYS, auth, scrape_sum
from tests.test_chat_service import coding_history
from tests.test_production import cheap, engine_generated, engine_running, held_still, long_compaction, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.engine]

A, B = auth(TENANT_KEYS["tenant-a"]), auth(TENANT_KEYS["tenant-b"])
# Extractive: the engine only answers the turns (4 tokens), the compactions cost it nothing.
ENTRY = {"type": "compaction", "compact_threshold": 1400, "background_threshold": 900, "strategy": "extractive"}


def turn(
    client: httpx.Client, headers: dict[str, str], history: list[dict[str, Any]], session: str, **entry: Any
) -> Any:
    body = {"model": SERVED_MODEL, "messages": history, "max_tokens": 4, "temperature": 0}
    body["context_management"] = [{**ENTRY, "apply_background": "threshold", **entry}]
    response = client.post("/v1/chat/completions", json=body, headers={**headers, "x-session-id": session})
    assert response.status_code == 200, response.text
    return response.json()["compaction"]


def test_every_request_needs_a_tenants_key_and_whitespace_never_breaks_one(client: httpx.Client) -> None:
    bare = httpx.get(client.base_url.join("/v1/models"), headers={"x-request-id": "req-tenancy-1"})
    assert bare.status_code == 401 and bare.json()["error"]["type"] == "authentication_error"
    assert bare.headers["x-request-id"] == "req-tenancy-1"  # every answer names the request, errors too
    assert httpx.get(client.base_url.join("/healthz")).status_code == 200
    # The default tenant's key reached the ingress as "key\n" (COMPACTION_API_KEY, conftest); a header with spaces.
    assert client.get("/v1/models").status_code == 200
    spaced = {"Authorization": f"Bearer   {TENANT_KEYS['tenant-a']}"}  # (HTTP itself drops trailing spaces)
    assert httpx.get(client.base_url.join("/v1/models"), headers=spaced).status_code == 200
    assert httpx.get(client.base_url.join("/v1/models"), headers=auth(SERVICE_KEY[:-1])).status_code == 401


def test_no_cors_unless_configured(client: httpx.Client) -> None:
    origin = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    preflight = client.options("/v1/compact", headers=origin)
    assert "access-control-allow-origin" not in preflight.headers
    assert (
        "access-control-allow-origin"
        not in client.get("/v1/models", headers={"Origin": "https://evil.example"}).headers
    )


def test_the_service_knows_it_listens_on_loopback_only(service: Any) -> None:
    """What the ingress checked before it started: Serve's host (from its controller), with no key it would pass
    only there."""
    host = http_host()
    assert host == "127.0.0.1"
    check_exposure(KeyTable([]), host, False, TenancyConfig())
    with pytest.raises(ValueError, match="allow_unauthenticated"):
        check_exposure(KeyTable([]), "0.0.0.0", False, TenancyConfig())


def test_a_tenant_past_its_rate_gets_429_with_retry_after_and_others_do_not(client: httpx.Client) -> None:
    limited = auth(TENANT_KEYS["limited"])
    statuses = [client.get("/v1/models", headers=limited) for _ in range(5)]
    assert [r.status_code for r in statuses[:2]] == [200, 200]  # its burst
    refused = [r for r in statuses if r.status_code == 429]
    assert refused, [r.status_code for r in statuses]
    assert int(refused[0].headers["retry-after"]) >= 1 and refused[0].json()["error"]["type"] == "rate_limit_error"
    assert client.get("/v1/models", headers=B).status_code == 200  # tenant-b's quota is its own
    assert client.get("/v1/models").status_code == 200


def test_a_tenant_knowing_anothers_session_gets_nothing_of_its_background_run(client: httpx.Client) -> None:
    session, steps = f"shared-{uuid.uuid4().hex[:8]}", coding_history(16)
    snapshot = [*steps[:41], {"role": "user", "content": "Keep going."}]  # ~1,010 tokens: past the soft threshold
    grown = [*snapshot, {"role": "assistant", "content": "Yes."}, *steps[41:], {"role": "user", "content": "Done?"}]
    assert turn(client, B, snapshot, session)["status"] == "running"  # B's background run of its snapshot
    intruder = turn(client, A, grown, session)  # A: B's session id, B's messages, past the hard threshold
    assert intruder["status"] == "applied" and intruder["source"] == "blocking", intruder
    owner = turn(client, B, grown, session)
    assert owner["status"] == "applied" and owner["source"] == "background", owner  # neither taken nor cancelled


def test_a_turn_with_other_options_gets_no_spliced_result_and_stops_the_sessions_run(
    client: httpx.Client, metrics_url: str
) -> None:
    """The session's background run would decode for minutes (every summary forced to 2,000 tokens); its next turn
    comes with other options: it compacts afresh, and the run it can never use stops on the engines."""
    session, steps = f"options-{uuid.uuid4().hex[:8]}", coding_history(16)
    snapshot = [*steps[:41], {"role": "user", "content": "Keep going."}]
    grown = [*snapshot, {"role": "assistant", "content": "Yes."}, *steps[41:], {"role": "user", "content": "Done?"}]
    long = {"strategy": "parallel", "chunk_tokens": 256, "max_chunk_summary_tokens": 2000, "pinned_share": 0.0}
    wait_for(lambda: engine_running(metrics_url) == 0, 120)
    assert (
        turn(client, B, snapshot, session, **long, fixed_output_tokens=True, reuse_chunks=False)["status"] == "running"
    )
    wait_for(lambda: engine_running(metrics_url) > 0, 120)  # the run is on the engines
    other = turn(client, B, grown, session, keep_recent_tokens=64)
    assert other["status"] == "applied" and other["source"] == "blocking", other
    took = wait_for(lambda: engine_running(metrics_url) == 0, 30, 0.1)
    settled = held_still(lambda: engine_generated(metrics_url), 2.0, 30.0)  # decoding moves it within 1 s
    assert took <= 2.0 + 2.0 and settled <= 4.0, (took, settled)  # as an abandoned compaction (tests.test_production)


def test_a_tenants_background_runs_never_pass_its_own_cap_on_requests_at_once(client: httpx.Client) -> None:
    """The tenant "narrow" may have one request at once: a coordinator replica running one of its background runs
    starts no other (that session compacts blocking at its threshold). Sessions hash to the service's two
    coordinators, so of three sessions two share one: at most one run per coordinator, and a turn says why."""
    narrow, steps = auth(TENANT_KEYS["narrow"]), coding_history(16)
    # Model summaries of a fixed length: on the CPU they cannot decode beside the agent's turns, so the first runs
    # are still going when the later turns arrive.
    long = {"strategy": "parallel", "chunk_tokens": 256, "max_chunk_summary_tokens": 256, "fixed_output_tokens": True}
    snapshot = [*steps[:41], {"role": "user", "content": "Keep going."}]  # ~1,010 tokens: past the soft threshold
    sessions = [f"narrow-{uuid.uuid4().hex[:8]}" for _ in "abc"]
    turns = [turn(client, narrow, snapshot, session, **long, reuse_chunks=False) for session in sessions]
    statuses = [t["status"] for t in turns]
    assert turns[0]["status"] == "running" and statuses.count("running") <= 2, turns
    refused = [t for t in turns if t["status"] == "none"]
    assert refused and all("has 1 running already" in t["note"] for t in refused), turns
    for session in sessions:  # the sessions go on with other options (extractive: no engine work): their runs stop
        turn(client, narrow, snapshot, session)


def completion(client: httpx.Client, headers: dict[str, str], prompt: list[int], session: str) -> int:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = client.post("/v1/completions", json=body, headers={**headers, "x-session-id": session})
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def test_the_engines_prefix_cache_tells_nothing_across_tenants(client: httpx.Client) -> None:
    """Same prompt, same replica (one session id): A's second request reads A's blocks; B and the default tenant,
    who may guess A's prompt, read none (their prompts carry other cache salts)."""
    rng = random.Random(uuid.uuid4().int)
    prompt, session = [rng.randrange(1000, 40000) for _ in range(320)], f"salt-{uuid.uuid4().hex[:8]}"
    assert completion(client, A, prompt, session) == 0
    assert completion(client, A, prompt, session) >= 256  # its two whole 128-token blocks
    assert completion(client, B, prompt, session) == 0
    assert completion(client, auth(), prompt, session) == 0


def test_the_chunk_cache_reuses_only_a_tenants_own_summaries(client: httpx.Client) -> None:
    words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(24))
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {words}"} for i in range(8)]
    body = {"model": SERVED_MODEL, "messages": history, "chunk_tokens": 256, "max_chunk_summary_tokens": 8}
    body |= {"keep_recent_tokens": 0, "retry_bad_summaries": False}  # random words: summaries fail their checks
    body["session_id"] = f"cache-{uuid.uuid4().hex[:8]}"  # one coordinator, its cache
    first = client.post("/v1/compact", json=body, headers=A).json()["stats"]
    again = client.post("/v1/compact", json=body, headers=A).json()["stats"]
    # A reuses its own summaries (a chunk whose summary failed its checks is not cached, so not every chunk)
    assert first["reused_chunks"] == 0 and again["chunks"] >= 2 and again["reused_chunks"] >= 1
    guess = client.post("/v1/compact", json=body, headers=B).json()["stats"]
    assert guess["reused_chunks"] == 0 and guess["chunks"] == first["chunks"]


def test_the_key_never_travels_with_the_application(service: Any) -> None:
    """build_app runs where Serve builds the app, not where the ingress runs: it ships no key (its env, set here
    by conftest, stays here), only where the ingress finds them."""
    from serving.app import build_app

    app = build_app({"tenancy": {"api_keys_file": "/etc/compaction/keys"}})
    ingress = app._bound_deployment
    shipped = repr(ingress.ray_actor_options) + repr(ingress.init_args) + repr(ingress.init_kwargs)
    assert SERVICE_KEY in os.environ["COMPACTION_API_KEY"]
    assert SERVICE_KEY not in shipped and "COMPACTION_API_KEY'" not in repr(ingress.ray_actor_options)
    assert ingress.init_kwargs["tenancy"].api_keys_file == "/etc/compaction/keys"


async def test_an_agents_compaction_goes_before_queued_background_runs(service: Any, metrics_url: str) -> None:
    """The admission gate's lanes on the real service. One coordinator (one session id) runs four of tenant A's
    background compactions (its `max_running`), long by construction, with four more of A's background runs
    queued behind them; then tenant B's agent compaction (blocking: the caller waits) arrives last. When the four
    running ones end (their callers leave), B's compaction takes the first free slot and the last of A's queued
    runs starts only after one of those admitted ends. A FIFO gate would admit A's four queued runs first."""
    session = f"lanes-{uuid.uuid4().hex[:8]}"

    def gate(name: str) -> float:
        return scrape_sum(metrics_url, name, model=SERVED_MODEL)

    def body(tag: str, **options: Any) -> dict[str, Any]:
        return {**cheap(f"[{tag}] The crew logged the position.", session_id=session), **options}

    async def sent(http: httpx.AsyncClient, payload: dict[str, Any], headers: dict[str, str]) -> tuple[float, Any]:
        """(when the request was sent, its response)."""
        return time.monotonic(), await http.post("/v1/compact", json=payload, headers=headers)

    await asyncio.to_thread(
        wait_for, lambda: gate("ray_compaction_running") + gate("ray_compaction_queue_depth") == 0, 120
    )
    async with httpx.AsyncClient(base_url=service.url, timeout=600) as http:
        running = [
            asyncio.create_task(http.post("/v1/compact", json={**long_compaction(2000, lines=12, session_id=session),
                                "priority": "background", "messages": body(f"long {i}")["messages"],
                                "keep_recent_tokens": 0}, headers=A))
            for i in range(4)
        ]  # fmt: skip
        await asyncio.to_thread(wait_for, lambda: gate("ray_compaction_running") == 4, 120)
        queued = [asyncio.create_task(sent(http, body(f"queued {i}", priority="background"), A)) for i in range(4)]
        await asyncio.to_thread(wait_for, lambda: gate("ray_compaction_queue_depth") == 4, 120)
        agent = asyncio.create_task(sent(http, body("agent"), B))
        await asyncio.to_thread(wait_for, lambda: gate("ray_compaction_queue_depth") == 5, 120)
        for task in running:
            task.cancel()  # their callers leave: the four slots free at once
        answers = [await task for task in [*queued, agent]]
    assert all(response.status_code == 200 for _, response in answers), [r.text for _, r in answers]
    admitted = [when + response.json()["stats"]["queue_wait_s"] for when, response in answers]
    assert admitted[-1] < max(admitted[:-1]), admitted  # B before the last of A's queued runs
