"""An ingress that never freezes, measured: the worst /healthz and small-compaction latency while each route
processes the largest body it accepts.

    python -m jobs.bench.ingress [--messages 99000] [--idle-seconds 10] [--out results/ingress.json]

Starts the service on 127.0.0.1 (or uses --url). First the probes alone for --idle-seconds: every 0.1 s a
`GET /healthz`, and one small compaction (sequential, 6 summary tokens) after another. Then, per route, one
maximal body (--messages short turns: 99,000 are about 13 MiB, just under the 100,000-message cap), which
the service must parse, render and count before it can answer (most are refused as over the history cap),
with the same probes running until it is answered. Printed per route: the body's size, its answer and time,
and the worst probe latencies, beside idle's (targets: /healthz under 1 s, small compactions within 1.5x idle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from jobs.bench.common import MODEL, free_port, local_service, sayer, table
from serving.tenants import client_headers

say = sayer("ingress", clock=True)
SMALL = {
    "model": MODEL,
    "messages": [  # a history the summary shortens (a shorter one is answered "nothing to compact")
        {"role": "user", "content": "Fix the parser."},
        {
            "role": "assistant",
            "content": "I read src/parser.py, found the off-by-one in split_fields at line 42, "
            "fixed it, and ran the tests: all 31 pass, including test_split_fields_on_trailing_commas.",
        },
        {"role": "user", "content": "Thanks."},
    ],
    "strategy": "sequential",
    "max_chunk_summary_tokens": 6,
    "keep_recent_tokens": 0,
    "reuse_chunks": False,
}


def turns(count: int) -> list[dict[str, str]]:
    """Alternating user and assistant turns of about 150 characters, ending on the user's."""
    text = "step {i}: read src/module_{m}.py, the parser splits on commas at index {i}; tests pass after the fix."
    roles = ("user", "assistant")
    return [{"role": roles[(count - 1 - i) % 2], "content": text.format(i=i, m=i % 97)} for i in range(count)]


def bodies(count: int) -> dict[str, dict[str, Any]]:
    """The largest body of each route: `count` turns (and, where a turn decides, a compaction entry)."""
    messages = turns(count)
    entry = [{"type": "compaction", "compact_threshold": 6000}]
    return {
        "/v1/compact": {"model": MODEL, "messages": messages},
        "/v1/chat/completions": {"model": MODEL, "messages": messages, "max_tokens": 1, "context_management": entry},
        "/v1/responses": {"model": MODEL, "input": messages, "max_output_tokens": 16, "context_management": entry},
        "/v1/messages": {"model": MODEL, "messages": messages, "max_tokens": 1, "context_management": entry},
        "/v1/messages/count_tokens": {"model": MODEL, "messages": messages},
    }


async def probes(client: httpx.AsyncClient, done: asyncio.Event) -> dict[str, float]:
    """The worst latency of /healthz (every 0.1 s) and of small compactions (one after another) until `done`."""
    worst = {"healthz_s": 0.0, "small_compaction_s": 0.0}
    failed: list[str] = []  # probes not answered 200: "<probe> <status>: <message>"

    async def probe(name: str, call: Any) -> None:
        began = time.monotonic()
        answer = await call()
        worst[f"{name}_s"] = max(worst[f"{name}_s"], time.monotonic() - began)
        if answer.status_code != 200:
            failed.append(f"{name} {answer.status_code}: {answer.text[:200]}")

    async def health() -> None:
        while not done.is_set():
            await probe("healthz", lambda: client.get("/healthz"))
            await asyncio.sleep(0.1)

    async def small() -> None:
        while not done.is_set():
            await probe("small_compaction", lambda: client.post("/v1/compact", json=SMALL))

    await asyncio.gather(health(), small())
    for line in sorted(set(failed)):
        say(f"probe failed: {line}")
    return {**{k: round(v, 3) for k, v in worst.items()}, "probes_failed": len(failed)}


async def measure(url: str, count: int, idle_s: float) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=900, headers=client_headers()) as client:
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(idle_s, done.set)
        rows = [{"route": "(idle)", "body_mib": 0.0, "status": "", "seconds": idle_s, **await probes(client, done)}]
        say(f"idle: {rows[0]}")
        for route, body in bodies(count).items():
            raw = json.dumps(body).encode()
            done = asyncio.Event()
            watching = asyncio.create_task(probes(client, done))
            began = time.monotonic()
            answer = await client.post(route, content=raw, headers={"content-type": "application/json"})
            seconds = time.monotonic() - began
            await asyncio.sleep(1.0)  # a probe that started late in the body's work is still counted
            done.set()
            row = {"route": route, "body_mib": round(len(raw) / 2**20, 2), "status": str(answer.status_code)}
            rows.append({**row, "seconds": round(seconds, 2), **await watching})
            say(f"{rows[-1]}")
        return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.ingress", description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=99_000, help="turns in each maximal body (default 99,000)")
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--url", help="a running service (default: start one here)")
    parser.add_argument("--out", type=Path, default=Path("results/ingress.json"))
    args = parser.parse_args(argv)
    if args.url:
        rows = asyncio.run(measure(args.url, args.messages, args.idle_seconds))
    else:
        with local_service(free_port(), {"models": [MODEL]}) as (service, _):
            rows = asyncio.run(measure(service.url, args.messages, args.idle_seconds))
    print(table(rows, list(rows[0])))
    idle = rows[0]["small_compaction_s"]
    worst = max(rows[1:], key=lambda r: r["small_compaction_s"])
    ratio = worst["small_compaction_s"] / idle if idle else float("inf")
    healthz = max(r["healthz_s"] for r in rows[1:])
    say(f"worst /healthz {healthz:.2f} s (target < 1 s); worst small compaction {ratio:.2f}x idle (target <= 1.5x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "worst_healthz_s": healthz, "small_ratio": round(ratio, 2)}))
    answered = all(r["status"] != "500" and not r["probes_failed"] for r in rows)
    return 0 if healthz < 1.0 and ratio <= 1.5 and answered else 1


if __name__ == "__main__":
    sys.exit(main())
