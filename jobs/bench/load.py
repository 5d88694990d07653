"""Load benchmark: N concurrent agent sessions against the service (a Ray job, like jobs/sweep.py).

    python -m jobs.bench.load --sessions 1,8,32,64 --fleet 1,32          # starts a local service (two replicas)
    python -m jobs.bench.load --url http://127.0.0.1:8000 --sessions '' --fleet 1,32
    ray job submit --working-dir . -- python -m jobs.bench.load --url http://127.0.0.1:8000 \\
        --json $PWD/results/load.json

Per level N of `--sessions`, every session at once: its agent turns on /v1/chat/completions, then
one compaction of its history; per level of `--fleet`, just the compactions, all sent at the same
moment (a fleet of agents compacting at once). Printed
per level: compactions by status (429 = shed by admission), goodput (successful calls per second),
client-side compaction latency p50/p95 with the queue wait and the compute time reported apart,
agent-turn latency, cache-hit share (prompt tokens served from the prefix cache), and compaction
throughput (input tokens compacted per second of the compaction phase). `--plot` draws throughput
and latency against N. Figures on a shared machine are indicative; levels run one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from jobs.bench.common import MODEL, replicas, sayer

if __package__ in (None, ""):  # run by path (`python -m jobs.bench.load`): make the checkout importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jobs.agent.tools import ToolTime
from jobs.bench.traffic import make_sessions, run_level
from jobs.data.conversations import LOCOMO_PATH

COLUMNS = (
    "sessions", "compactions", "goodput_per_s", "compaction_p50_s", "compaction_p95_s", "queue_wait_p50_s",
    "queue_wait_p95_s", "compute_p50_s", "turn_p50_s", "cache_hit_share", "compaction_throughput_tok_s",
)  # fmt: skip


say = sayer("load", clock=True)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fleet = [r for r in rows if r["mode"] == "fleet"]
    rows = [r for r in rows if r["mode"] == "agent"] or fleet
    n = [r["sessions"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(n, [r["compaction_throughput_tok_s"] for r in rows], marker="o", label="agent sessions")
    if fleet and rows is not fleet:
        fleet_n = [r["sessions"] for r in fleet]
        left.plot(fleet_n, [r["compaction_throughput_tok_s"] for r in fleet], "s--", label="fleet (compactions only)")
    left.legend()
    left.set(xlabel="concurrent sessions", ylabel="input tokens compacted / s", title="Compaction throughput")
    left.set_xscale("log", base=2)
    left.set_ylim(bottom=0)
    for key, style in (("compaction_p50_s", "o-"), ("compaction_p95_s", "s--"), ("queue_wait_p95_s", "^:")):
        right.plot(n, [r[key] for r in rows], style, label=key.removeprefix("compaction_").replace("_s", " (s)"))
    for r in rows:
        if r["rejected_429"]:
            right.annotate(f"{r['rejected_429']} x 429", (r["sessions"], r["compaction_p95_s"]))
    right.set(xlabel="concurrent sessions", ylabel="seconds", title="Compaction latency (client side)")
    right.set_xscale("log", base=2)
    right.set_ylim(bottom=0)
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def measure(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from compaction.tokenizer import HFChatTokenizer
    from serving.weights import fetch

    tokenizer = HFChatTokenizer.from_path(fetch())
    samples = json.loads(Path(args.data).read_text())
    compaction = {"chunk_tokens": args.chunk_tokens, "max_chunk_summary_tokens": args.summary_tokens}
    rows = []
    levels = [("agent", n, 2) for n in args.sessions] + [("fleet", n, 0) for n in args.fleet]
    for mode, level, turns in levels:
        sessions = make_sessions(samples, tokenizer, level, args.history_tokens, turns)
        say(f"{mode}: {level} concurrent sessions")
        row = {"mode": mode, **asyncio.run(run_level(url, sessions, args.model, compaction, tool_time=args.tool_time))}
        rows.append(row)
        say(" ".join(f"{k}={row[k]}" for k in COLUMNS))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running service; default: start one locally (two replicas, defaults)")
    parser.add_argument("--sessions", default="1,8,32,64", help="agent sessions at once, per level (comma-separated)")
    parser.add_argument("--fleet", default="", help="compactions sent at the same moment, per level (comma-separated)")
    parser.add_argument("--history-tokens", type=int, default=1024, help="history size of each session")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--summary-tokens", type=int, default=32, help="output budget per chunk summary")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument(
        "--tool-time", default="codex", help="agent sessions' tool time after each turn: codex (the default) or seconds"
    )
    parser.add_argument("--data", default=str(LOCOMO_PATH), help="LoCoMo locomo10.json")
    parser.add_argument("--port", type=int, default=8000, help="port of the local service (without --url)")
    parser.add_argument("--catalogue", help="the local service's model catalogue YAML (default: the packaged one)")
    parser.add_argument(
        "--replicas", type=int, choices=range(1, 9), metavar="1..8", help="the local service's replicas"
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--plot", type=Path, help="write the figure (PNG) here")
    parser.add_argument("--verbose", action="store_true", help="show Ray's and vLLM's logs (or VERBOSE=1)")
    args = parser.parse_args(argv)
    args.sessions = [int(n) for n in args.sessions.split(",") if n.strip()]
    args.fleet = [int(n) for n in args.fleet.split(",") if n.strip()]
    try:
        args.tool_time = ToolTime.parse(args.tool_time)
    except ValueError as exc:
        parser.error(f"--tool-time: {exc}")
    if args.url:
        rows = measure(args.url, args)
    else:
        from serving.local import LocalService, hush, verbose_requested

        quiet = not verbose_requested(args.verbose)
        if quiet:
            hush()
        service_args: dict[str, Any] = {"catalogue": args.catalogue} if args.catalogue else {}
        if args.replicas:
            service_args |= replicas(args.replicas, args.model)
        with LocalService(args.port, service_args, quiet=quiet) as service:
            rows = measure(service.url, args)
    print(json.dumps(rows, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
        say(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
