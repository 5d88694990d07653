"""Hostile neighbours, measured: a victim agent's turns beside a well-behaved and beside a hostile tenant of the same
load, and the coordinators' memory after background runs that fail, sent with padded extra fields.

    python -m jobs.bench.hostile [--seconds 90] [--failing 100] [--out results/hostile.json]

Starts the service on 127.0.0.1 with three tenants' keys. The victim's agent takes short turns (8 tokens) on a
growing history with a second of tool time between them, first beside the neighbour, then beside the hostile
tenant, for --seconds each. Both run the same load: long generations (256 tokens) one after another, and 12
background compactions a minute. The neighbour sends them as they are and spreads its compactions (two every
10 s); the hostile tenant first asks for engine priority -1 on every generation (refused: it sends it again
without) and floods its compactions (12 at once, every 60 s). Printed: the victim's turn p50 and p95 in each
phase and their ratio (target: p95 within 1.5x).

Then --failing chat turns of the hostile tenant, each with about 42 KiB of extra fields nested in its content
parts and a context-management entry whose background run fails in planning (4-token chunks: over max_chunks):
printed, the coordinators' RSS before and after (target: growth within 10 %: a failed run holds nothing).

`hostile_requests()` is also the soak's hostile traffic (`jobs.bench.soak`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import tempfile
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from jobs.bench.common import MODEL, free_port, local_service, replicas, sayer
from jobs.bench.processes import rss_bytes, service_processes

KEYS = {tenant: f"sk-bench-{tenant}-0123456789" for tenant in ("victim", "neighbour", "hostile")}
COMPACT = {"strategy": "parallel", "chunk_tokens": 256, "max_chunk_summary_tokens": 24}

say = sayer("hostile", clock=True)


def hostile_requests() -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, path, httpx request arguments) of requests the service must refuse with a 4xx naming the field."""
    from serving.wire.codec import MAX_DECODED_BYTES, PREFIX

    inflating = b'[{"role": "user", "content": "' + b"a" * (MAX_DECODED_BYTES + 1) + b'"}]'
    bomb = PREFIX + base64.urlsafe_b64encode(zlib.compress(inflating, 9)).decode().rstrip("=")
    short = [{"role": "user", "content": "Say hi."}]
    deep = json.dumps({"model": MODEL, "messages": [{**short[0], "x": "NEST"}]}).replace(
        '"NEST"', "[" * 300 + "]" * 300
    )
    emptied = {"type": "compaction", "content": None, "encrypted_content": None}
    return [
        ("bomb", "/v1/responses",
         {"json": {"model": MODEL, "input": [{"type": "compaction", "encrypted_content": bomb}, *short]}}),
        ("deep-json", "/v1/compact", {"content": deep.encode(), "headers": {"content-type": "application/json"}}),
        ("priority", "/v1/chat/completions", {"json": {"model": MODEL, "messages": short, "priority": -100}}),
        ("request-id", "/v1/chat/completions", {"json": {"model": MODEL, "messages": short, "request_id": "x"}}),
        ("engine-refusal", "/v1/chat/completions",
         {"json": {"model": MODEL, "messages": short, "logprobs": True, "top_logprobs": 50}}),
        ("null-block", "/v1/messages", {"json": {"model": MODEL, "max_tokens": 8, "messages": [
            *short, {"role": "assistant", "content": [emptied]}, {"role": "user", "content": "Go on."}]}}),
    ]  # fmt: skip


def headers(tenant: str, session: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}", **({"x-session-id": session} if session else {})}


def line(i: int, tag: str) -> str:
    return f"[{tag}] step {i}: read src/mod_{i % 37}.py, f_{i} returns {i * 7}, test_{i} passes."


async def victim(client: httpx.AsyncClient, until: float) -> list[float]:
    """The victim's turn latencies (seconds); a new session every 12 turns keeps its prompt short."""
    seconds: list[float] = []
    messages: list[dict[str, str]] = []
    turn = 0
    while time.monotonic() < until:
        if turn % 12 == 0:
            messages = []
        messages.append({"role": "user", "content": line(turn, "victim")})
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        began = time.monotonic()
        response = await client.post("/v1/chat/completions", json=body, headers=headers("victim", f"v{turn // 12}"))
        response.raise_for_status()
        seconds.append(time.monotonic() - began)
        messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"] or "ok"})
        turn += 1
        await asyncio.sleep(1.0)
    return seconds


async def generations(client: httpx.AsyncClient, tenant: str, until: float, hostile: bool) -> int:
    """Long generations one after another; the hostile tenant asks for engine priority -1 first."""
    refused = 0
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 256}
    while time.monotonic() < until:
        if hostile:
            asked = await client.post("/v1/chat/completions", json={**body, "priority": -1}, headers=headers(tenant))
            refused += 400 <= asked.status_code < 500
        (await client.post("/v1/chat/completions", json=body, headers=headers(tenant))).raise_for_status()
    return refused


async def compactions(client: httpx.AsyncClient, tenant: str, until: float, at_once: int, every_s: float) -> None:
    """`at_once` background compactions every `every_s` seconds (shed ones, 429, are not retried)."""
    n = 0
    while time.monotonic() + every_s < until:
        await asyncio.sleep(every_s)
        bodies = []
        for _ in range(at_once):
            n += 1
            history = [{"role": "user", "content": line(i, f"{tenant}{n}")} for i in range(16)]
            bodies.append({"model": MODEL, "messages": history, "priority": "background", **COMPACT})
        await asyncio.gather(*(client.post("/v1/compact", json=b, headers=headers(tenant)) for b in bodies))


async def phase(url: str, neighbour: str, seconds: float) -> tuple[list[float], int]:
    hostile = neighbour == "hostile"
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        until = time.monotonic() + seconds
        flood = (12, 60.0) if hostile else (2, 10.0)
        turns, refused, _ = await asyncio.gather(
            victim(client, until),
            generations(client, neighbour, until, hostile),
            compactions(client, neighbour, until, *flood),
        )
    return turns, refused


def coordinators_rss(node_id: str | None = None) -> int:
    """The coordinators' RSS (bytes), of every service on this machine or of the one on Ray node `node_id`."""
    found = service_processes()
    return sum(rss_bytes(p.pid) or 0 for p in found if p.role == "coordinator" and node_id in (None, p.node_id))


async def failing_runs(
    url: str, count: int, key: str = KEYS["hostile"], tag: str = "fail", parts: int = 40
) -> Counter[str]:
    """Chat turns over background_threshold whose background run fails in planning (more chunks than allowed),
    each of its `parts` messages carrying its share of about 40 KiB of extra fields inside its content part (fewer
    parts: less to prefill, as much to hold); the turns' compaction statuses. Sent again (the same `tag`), the same
    turns say how each run ended: "none" (failed), "running" or "applied" (it did not fail)."""
    pad = {"cache_control": {"type": "ephemeral", "pad": "x" * (40 * 1024 // parts)}}
    entry = {"type": "compaction", "compact_threshold": 4000, "background_threshold": 128, "chunk_tokens": 4}
    statuses: Counter[str] = Counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for n in range(count):
            parted = [[{"type": "text", "text": line(i, f"{tag}{n}"), **pad}] for i in range(parts)]
            messages = [{"role": "user", "content": content} for content in parted]
            body = {"model": MODEL, "messages": messages, "max_tokens": 1, "context_management": [entry]}
            session = {"x-session-id": f"{tag}-{n}", "Authorization": f"Bearer {key}"}
            response = await client.post("/v1/chat/completions", json=body, headers=session)
            response.raise_for_status()
            statuses[response.json()["compaction"]["status"]] += 1
            if (n + 1) % 25 == 0:
                say(f"{n + 1} turns sent: {dict(statuses)}")
    return statuses


def quantiles(seconds: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(seconds, n=20)
    return {"turns": len(seconds), "p50_s": round(statistics.median(seconds), 3), "p95_s": round(cuts[18], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.hostile", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="length of each phase (default 90; 0: none)")
    parser.add_argument("--failing", type=int, default=100, help="failing background runs (default 100)")
    parser.add_argument("--out", type=Path, default=Path("results/hostile.json"))
    args = parser.parse_args(argv)
    keys = Path(tempfile.mkdtemp(prefix="hostile")) / "keys"
    keys.write_text("".join(f"{tenant}: {key}\n" for tenant, key in KEYS.items()))
    service_args = {"models": [MODEL], **replicas(2), "tenancy": {"api_keys_file": str(keys)}}
    figures: dict[str, Any] = {}
    with local_service(free_port(), service_args) as (service, _):
        for neighbour in ("neighbour", "hostile") if args.seconds > 0 else ():
            say(f"the victim beside the {neighbour} tenant for {args.seconds:g} s")
            turns, refused = asyncio.run(phase(service.url, neighbour, args.seconds))
            figures[neighbour] = {**quantiles(turns), "priority_refused": refused}
            say(f"beside the {neighbour}: {figures[neighbour]}")
        before = coordinators_rss()
        started = asyncio.run(failing_runs(service.url, args.failing))
        time.sleep(5)  # the last runs' failures are recorded
        after = coordinators_rss()
        say("the same turns again, to read how each background run ended")
        ended = asyncio.run(failing_runs(service.url, args.failing))
    figures["failing_runs"] = {"started": started.get("running", 0), "failed": ended.get("none", 0)}
    say(f"background runs started {figures['failing_runs']['started']}, failed {figures['failing_runs']['failed']}")
    if args.seconds > 0:
        figures["ratio_p95"] = round(figures["hostile"]["p95_s"] / figures["neighbour"]["p95_s"], 2)
        say(f"victim p95 beside the hostile tenant / beside the neighbour: {figures['ratio_p95']} (target <= 1.5)")
    figures["coordinators_rss_mib"] = {"before": before / 2**20, "after": after / 2**20}
    figures["coordinators_rss_growth_pct"] = round(100 * (after - before) / before, 1)
    say(
        f"coordinators' RSS after {args.failing} failing background runs: {before / 2**20:.0f} -> "
        f"{after / 2**20:.0f} MiB ({figures['coordinators_rss_growth_pct']:+.1f} %, target <= 10 %)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=1))
    all_failed = figures["failing_runs"]["started"] == figures["failing_runs"]["failed"] == args.failing
    return (
        0 if figures.get("ratio_p95", 0) <= 1.5 and figures["coordinators_rss_growth_pct"] <= 10 and all_failed else 1
    )


if __name__ == "__main__":
    sys.exit(main())
