"""Soak benchmark: mixed traffic against the local service for a bounded time, RSS per process over time.

    python -m jobs.bench.soak [--minutes 20] [--agents 4] [--sample-s 10] [--plot docs/soak-rss.png]

Starts the service on 127.0.0.1 (two model replicas, two coordinators, small admission limits so that bursts are
shed) and runs, all at once: agents on /v1/chat/completions with context_management (half background, half
blocking; a second of tool time per turn; a new session every 40 turns), /v1/compact compactions of fresh
histories, bursts beyond capacity (429 expected), client disconnects mid-compaction, oversize (413) and malformed
(4xx) bodies, and hostile requests (4xx expected, never a 5xx or a stall of the others): compaction items that
inflate past the cap, JSON nested past the limit, engine priorities and request ids set by the client, Messages
compaction blocks that lost their encrypted_content, and floods of background compactions.
One coordinator is killed at 35 % of the run and one model replica (with its engine) at 65 %.
Every --sample-s it prints the RSS of each role (ingress, coordinators, replicas, engine processes, Serve's
controller and proxy); at the end: RSS growth after warm-up per process (target <= 10 %), 5xx responses (target 0;
503 with Retry-After is counted apart: the designed answer while a replica is down), lost agent turns (a turn
that got no 200 after honouring Retry-After five times; target 0), and a plot of RSS over time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from jobs.bench.common import MODEL, free_port, replicas, sayer
from jobs.bench.hostile import hostile_requests
from jobs.bench.processes import rss_bytes, service_processes

LIMITS = {"max_running": 2, "max_queued": 4}
MAX_BYTES = 1_000_000
ARGS = {
    "models": [MODEL],
    **replicas(2),
    "coordinator_replicas": 2,
    "max_request_bytes": MAX_BYTES,
    "admission": LIMITS,
}
OPTIONS = {"strategy": "parallel", "chunk_tokens": 256, "max_chunk_summary_tokens": 24}
TURNS_PER_SESSION = 40
RETRIES = 5


say = sayer("soak", clock=True)


@dataclass
class Tally:
    """What the traffic got back, per kind of request."""

    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)  # transport errors by kind of request
    turns: int = 0
    lost_turns: int = 0
    applied: int = 0
    unavailable: int = 0  # 503 with Retry-After
    kills: list[tuple[float, str, int]] = field(default_factory=list)
    failures: list[tuple[float, str, int, str]] = field(default_factory=list)  # 5xx but 503 + Retry-After
    began: float = field(default_factory=time.monotonic)

    def count(self, kind: str, response: httpx.Response) -> None:
        self.statuses.setdefault(kind, Counter())[response.status_code] += 1
        if response.status_code == 503 and response.headers.get("Retry-After"):
            self.unavailable += 1
        elif response.status_code >= 500:  # when and what, to line it up with the kills
            self.failures.append((time.monotonic() - self.began, kind, response.status_code, response.text[:200]))
            say(f"{kind}: {response.status_code} {response.text[:200]!r}")

    def server_errors(self) -> int:
        """5xx answers other than 503 + Retry-After."""
        total = sum(n for c in self.statuses.values() for s, n in c.items() if s >= 500)
        return total - self.unavailable


def line(turn: int, tag: str) -> str:
    return f"[{tag}] step {turn}: read src/mod_{turn % 37}.py, f_{turn} returns {turn * 7}, test_{turn} passes."


def history(turns: int, tag: str) -> list[dict[str, str]]:
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": line(i, tag)}, {"role": "assistant", "content": line(i + 1, tag)}]
    return messages


async def retried(client: httpx.AsyncClient, tally: Tally, kind: str, **request: Any) -> httpx.Response | None:
    """POST, honouring Retry-After on 429/503 up to RETRIES times; None after a transport error."""
    for _ in range(RETRIES + 1):
        try:
            response = await client.post(**request)
        except httpx.HTTPError as exc:
            tally.errors[f"{kind}:{type(exc).__name__}"] += 1
            return None
        tally.count(kind, response)
        if response.status_code not in (429, 503):
            return response
        await asyncio.sleep(min(10.0, float(response.headers.get("Retry-After") or 1)))
    return response


async def agent(client: httpx.AsyncClient, tally: Tally, index: int, background: bool, until: float) -> None:
    entry: dict[str, Any] = {"type": "compaction", "compact_threshold": 1000, **OPTIONS}
    if background:
        entry["background_threshold"] = 700
    session, turn = 0, 0
    messages: list[dict[str, Any]] = []
    while time.monotonic() < until:
        if turn % TURNS_PER_SESSION == 0:
            session, messages = session + 1, []
        messages.append({"role": "user", "content": line(turn, f"agent{index}")})
        body = {"model": MODEL, "messages": messages, "max_tokens": 16, "context_management": [entry]}
        headers = {"x-session-id": f"soak-{index}-{session}"}
        response = await retried(client, tally, "turn", url="/v1/chat/completions", json=body, headers=headers)
        tally.turns += 1
        turn += 1
        if response is None or response.status_code != 200:
            tally.lost_turns += 1
            messages.pop()
            continue
        reply = response.json()
        compaction = reply.get("compaction") or {}
        if compaction.get("status") == "applied":
            tally.applied += 1
            messages = compaction["messages"] + messages[compaction["replaces_through"] :]
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or "ok"})
        await asyncio.sleep(1.0)  # the agent's tools


async def compactions(client: httpx.AsyncClient, tally: Tally, until: float) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1
        body = {"model": MODEL, "messages": history(12 + n % 12, f"compact{n}"), **OPTIONS}
        await retried(client, tally, "compact", url="/v1/compact", json=body)
        await asyncio.sleep(3.0)


async def bursts(client: httpx.AsyncClient, tally: Tally, until: float, every_s: float = 60) -> None:
    """More compactions at once than the coordinators admit and queue: the excess is shed with 429."""
    n = 0
    while time.monotonic() + every_s < until:
        await asyncio.sleep(every_s)
        n += 1
        size = 3 * 2 * (LIMITS["max_running"] + LIMITS["max_queued"])
        bodies = [{"model": MODEL, "messages": history(4, f"burst{n}-{i}"), **OPTIONS} for i in range(size)]
        await at_once(client, tally, "burst", bodies)


async def at_once(client: httpx.AsyncClient, tally: Tally, kind: str, bodies: list[dict[str, Any]]) -> None:
    """Compactions sent all at once, each answer (or transport error) tallied."""
    results = await asyncio.gather(*(client.post("/v1/compact", json=b) for b in bodies), return_exceptions=True)
    for result in results:
        if isinstance(result, httpx.Response):
            tally.count(kind, result)
        else:
            tally.errors[f"{kind}:{type(result).__name__}"] += 1


async def disconnects(client: httpx.AsyncClient, tally: Tally, until: float) -> None:
    """Compactions the client gives up on after 0.3 s (the service must cancel them, not leak them)."""
    n = 0
    while time.monotonic() < until:
        await asyncio.sleep(20)
        n += 1
        body = {"model": MODEL, "messages": history(20, f"gone{n}"), **OPTIONS}
        try:  # an answer within 0.3 s is a shed (429) or a compaction that fits
            tally.count("disconnect", await client.post("/v1/compact", json=body, timeout=0.3))
        except httpx.TimeoutException:
            tally.errors["disconnect:cancelled"] += 1


async def bad_bodies(client: httpx.AsyncClient, tally: Tally, until: float) -> None:
    oversize = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "' + b"x" * MAX_BYTES
    oversize += b'"}]}'
    cases: list[tuple[str, dict[str, Any]]] = [
        ("oversize", {"content": oversize}),
        ("malformed", {"content": b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": '}),
        ("bad-field", {"json": {"model": MODEL, "messages": [], "chunk_tokens": -1}}),
    ]
    while time.monotonic() < until:
        await asyncio.sleep(15)
        for kind, request in cases:
            headers = {"content-type": "application/json"}
            try:
                tally.count(kind, await client.post("/v1/compact", headers=headers, **request))
            except httpx.HTTPError as exc:
                tally.errors[f"{kind}:{type(exc).__name__}"] += 1


async def hostile(client: httpx.AsyncClient, tally: Tally, until: float, every_s: float = 10) -> None:
    """Every `every_s`: each hostile request once, then a flood of background compactions (more than admitted)."""
    cases = hostile_requests()
    n = 0
    while time.monotonic() + every_s < until:
        await asyncio.sleep(every_s)
        n += 1
        for kind, path, request in cases:
            try:
                tally.count(kind, await client.post(path, **request))
            except httpx.HTTPError as exc:
                tally.errors[f"{kind}:{type(exc).__name__}"] += 1
        if n % 3 == 0:
            size = 2 * (LIMITS["max_running"] + LIMITS["max_queued"])
            flood = [{"model": MODEL, "messages": history(6, f"flood{n}-{i}"), "priority": "background", **OPTIONS}
                     for i in range(size)]  # fmt: skip
            await at_once(client, tally, "flood", flood)


def kill(role: str, tally: Tally, began: float) -> None:
    """SIGKILL one process of `role` (a replica with its engine processes): Serve starts a new one."""
    procs = service_processes()
    victim = next((p for p in procs if p.role == role), None)
    if victim is None:
        say(f"no {role} process to kill")
        return
    doomed = [victim.pid]
    if role == "replica":  # its engine processes go with it, as when its node fails
        doomed += [c.pid for c in psutil.Process(victim.pid).children(recursive=True)]
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    tally.kills.append((time.monotonic() - began, role, victim.pid))
    say(f"killed {role} pid {victim.pid} ({len(doomed) - 1} engine processes with it)")


async def chaos(tally: Tally, began: float, duration: float) -> None:
    for share, role in ((0.35, "coordinator"), (0.65, "replica")):
        await asyncio.sleep(max(0.0, began + share * duration - time.monotonic()))
        kill(role, tally, began)


async def sampler(samples: list[dict[str, Any]], began: float, until: float, every_s: float) -> None:
    while True:
        t = time.monotonic() - began
        measured = [(p, rss_bytes(p.pid)) for p in service_processes()]
        by_role: Counter[str] = Counter()
        count: Counter[str] = Counter()
        for proc, rss in measured:
            if rss is not None:
                samples.append({"t": t, "pid": proc.pid, "role": proc.role, "rss": rss})
                by_role[proc.role] += rss
                count[proc.role] += 1
        say(f"t={t:5.0f} s RSS MiB: " + ", ".join(f"{r} x{count[r]} {by_role[r] / 2**20:.0f}" for r in sorted(by_role)))
        if time.monotonic() >= until:
            return
        await asyncio.sleep(min(every_s, max(0.0, until - time.monotonic())))


def growth(samples: list[dict[str, Any]], warmup_s: float) -> list[dict[str, Any]]:
    """Per process alive from the end of warm-up to the end: RSS then and at its last sample, and the growth."""
    last_t = max(s["t"] for s in samples)
    rows = []
    for pid in sorted({s["pid"] for s in samples}):
        mine = sorted((s for s in samples if s["pid"] == pid), key=lambda s: s["t"])
        after = [s for s in mine if s["t"] >= warmup_s]
        if not after:
            continue
        first, final = after[0], after[-1]
        whole = mine[0]["t"] <= warmup_s and final["t"] >= last_t
        rows.append(
            {
                "pid": pid,
                "role": first["role"],
                "rss_after_warmup_mib": round(first["rss"] / 2**20, 1),
                "rss_end_mib": round(final["rss"] / 2**20, 1),
                "growth_pct": round(100 * (final["rss"] - first["rss"]) / first["rss"], 1),
                "whole_run": whole,  # False: started late (a replacement) or died (killed)
            }
        )
    return rows


def plot(samples: list[dict[str, Any]], kills: list[tuple[float, str, int]], warmup_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"ingress": "C0", "coordinator": "C1", "replica": "C2", "engine": "C3", "controller": "C4", "proxy": "C5"}
    fig, ax = plt.subplots(figsize=(9, 5))
    for pid in sorted({s["pid"] for s in samples}):
        mine = sorted((s for s in samples if s["pid"] == pid), key=lambda s: s["t"])
        role = mine[0]["role"]
        ax.plot([s["t"] / 60 for s in mine], [s["rss"] / 2**20 for s in mine], color=colours.get(role, "k"), lw=1)
    for role, colour in colours.items():
        ax.plot([], [], color=colour, label=role)
    for t, role, _ in kills:
        ax.axvline(t / 60, color="grey", ls="--", lw=0.8)
        ax.text(t / 60, ax.get_ylim()[1] * 0.95, f" {role} killed", fontsize=8, color="grey")
    ax.axvspan(0, warmup_s / 60, color="0.92", label="warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("RSS per process (MiB)")
    ax.set_yscale("log")
    ax.set_title("Soak: RSS of every service process under mixed traffic")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


async def traffic(url: str, duration: float, agents: int, sample_s: float) -> tuple[Tally, list[dict[str, Any]], float]:
    tally = Tally()
    samples: list[dict[str, Any]] = []
    began = tally.began
    until = began + duration
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        tasks = [agent(client, tally, i, background=i % 2 == 0, until=until) for i in range(agents)]
        tasks += [compactions(client, tally, until), bursts(client, tally, until), disconnects(client, tally, until)]
        tasks += [bad_bodies(client, tally, until), hostile(client, tally, until), chaos(tally, began, duration)]
        tasks += [sampler(samples, began, until, sample_s)]
        await asyncio.gather(*tasks)
    return tally, samples, began


def report(tally: Tally, rows: list[dict[str, Any]]) -> dict[str, Any]:
    whole = [r for r in rows if r["whole_run"]]
    worst = max((r["growth_pct"] for r in whole), default=0.0)
    for row in rows:
        mark = "" if row["whole_run"] else "  (replacement or killed: not judged)"
        say(
            f"{row['role']:<12} pid {row['pid']:>7}: {row['rss_after_warmup_mib']:8.1f} -> "
            f"{row['rss_end_mib']:8.1f} MiB ({row['growth_pct']:+.1f} %){mark}"
        )
    summary = {
        "statuses": {kind: dict(sorted(c.items())) for kind, c in tally.statuses.items()},
        "transport": dict(tally.errors),
        "turns": tally.turns,
        "turns_with_compaction_applied": tally.applied,
        "lost_turns": tally.lost_turns,
        "server_errors_5xx": tally.server_errors(),
        "unavailable_503_with_retry_after": tally.unavailable,
        "worst_rss_growth_pct": worst,
        "hostile_accepted": sum(
            n
            for kind, _, _ in hostile_requests()
            for status, n in tally.statuses.get(kind, Counter()).items()
            if status < 400
        ),
        "kills": tally.kills,
        "failures": tally.failures,
    }
    for key in ("statuses", "transport"):
        say(f"{key}: {json.dumps(summary[key])}")
    say(f"turns {tally.turns}, applied compactions {tally.applied}, lost turns {tally.lost_turns} (target 0)")
    say(f"5xx {summary['server_errors_5xx']} (target 0), 503 + Retry-After {tally.unavailable}")
    say(f"hostile requests answered as if legal: {summary['hostile_accepted']} (target 0)")
    say(f"worst RSS growth after warm-up over the processes of the whole run: {worst:+.1f} % (target <= 10 %)")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="length of the traffic (default 20)")
    parser.add_argument("--warmup-minutes", type=float, default=None, help="default: a quarter, at most 5")
    parser.add_argument("--agents", type=int, default=4, help="concurrent agents (half background)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--plot", type=Path, default=Path("docs/soak-rss.png"))
    parser.add_argument("--out", type=Path, default=Path("results/soak.json"), help="samples and summary (JSON)")
    args = parser.parse_args(argv)
    if not 0 < args.minutes <= 240:
        parser.error("--minutes must be in (0, 240]")
    from serving.local import LocalService

    duration = args.minutes * 60
    warmup_s = 60 * (args.warmup_minutes if args.warmup_minutes is not None else min(5.0, args.minutes / 4))
    with LocalService(free_port(), ARGS) as service:  # 127.0.0.1 only
        say(f"traffic for {args.minutes:g} min against {service.url}; warm-up {warmup_s / 60:g} min")
        tally, samples, _ = asyncio.run(traffic(service.url, duration, args.agents, args.sample_s))
    rows = growth(samples, warmup_s)
    summary = report(tally, rows)
    plot(samples, tally.kills, warmup_s, args.plot)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "processes": rows, "samples": samples}, indent=1))
    say(f"plot {args.plot}, data {args.out}")
    ok = summary["lost_turns"] == 0 and summary["server_errors_5xx"] == 0 and summary["hostile_accepted"] == 0
    ok = ok and summary["worst_rss_growth_pct"] <= 10
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
