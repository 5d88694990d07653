"""A coding-agent history beyond the model window, compacted over HTTP with the default options.

    python -m jobs.bench.history [--seed 0] [--tokens 20000] [--replicas 1] [--port N] [--timeout-s 3600] [--json PATH]

Starts the service on the CPU default (SmolLM2-135M, 8k window), generates a coding-agent session
of about `--tokens` tokens (`jobs.data.traces`: tool calls, tool results, five planted facts),
and sends `POST /v1/compact` with nothing but the model and the messages, on emptied prefix
caches. Prints the status, the layout `auto` chose, its windows and chunks, history vs compacted
tokens, the prefill the engines computed against the layout's floor, the latency, whether the
compacted history is a valid chat history, whether `/v1/chat/completions` accepts it as it is,
and which planted facts occur in it verbatim; then what a sequential compaction answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import httpx

from compaction.checks.validity import problems
from compaction.history import parse_messages, template_view
from jobs.bench.common import MODEL, free_port, local_service, replicas, sayer, table
from jobs.data.traces import CodingTrace, coding_trace
from serving.local import quiet_http_clients

say = sayer("bench-history")


def recalled(trace: CodingTrace, messages: list[dict[str, Any]]) -> list[str]:
    """Kinds of the planted facts that occur verbatim in the compacted history."""
    text = "\n".join(template_view(m)["content"] for m in parse_messages(messages))
    return [fact.kind for fact in trace.facts if fact.text in text]


def compaction_row(trace: CodingTrace, status: int, body: dict[str, Any], chat_status: int) -> dict[str, Any]:
    stats = body["stats"]
    return {
        "status": status,
        "layout": stats["layout"],
        "windows": stats["windows"],
        "chunks": stats["chunks"],
        "messages": f"{len(trace.messages)}->{len(body['messages'])}",
        "history_tok": stats["history_tokens"],
        "compacted_tok": stats["compacted_tokens"],
        "prefill_computed": stats["computed_prefill_tokens"],
        "prefill_floor": stats["prefill_floor_tokens"],
        "prefill/floor": round(stats["computed_prefill_tokens"] / stats["prefill_floor_tokens"], 3),
        "retries": stats["retries"],
        "latency_s": float(stats["latency_s"]),
        "valid": not problems(parse_messages(body["messages"])),
        "chat_status": chat_status,
        "facts_verbatim": f"{len(recalled(trace, body['messages']))}/{len(trace.facts)}",
    }


def waiting(request: Callable[[], httpx.Response], every_s: float = 60) -> httpx.Response:
    """Run one long request, saying every minute that it is still running."""
    began = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(request)
        while True:
            try:
                response = future.result(timeout=every_s)
                break
            except FutureTimeout:
                say(f"still compacting after {time.perf_counter() - began:.0f} s")
    say(f"answered {response.status_code} after {time.perf_counter() - began:.0f} s")
    return response


def run(args: argparse.Namespace) -> int:
    from compaction.tokenizer import HFChatTokenizer
    from serving.weights import fetch

    trace = coding_trace(args.seed, args.tokens, HFChatTokenizer.from_path(fetch()))
    say(f"coding-agent session: seed {args.seed}, {len(trace.messages)} messages, about {args.tokens} tokens")
    service_args = {**replicas(args.replicas), "admission": {"timeout_s": args.timeout_s}}
    port, wait_s = args.port or free_port(), args.timeout_s + 60
    with (
        local_service(port, service_args) as (service, reset),
        httpx.Client(base_url=service.url, timeout=wait_s) as client,
    ):
        reset()
        say("POST /v1/compact with the default options (fresh prefix caches; about 10 min on 2 quiet cores)")
        response = waiting(lambda: client.post("/v1/compact", json={"model": MODEL, "messages": trace.messages}))
        if response.status_code != 200:
            print(f"POST /v1/compact answered {response.status_code}: {response.text[:1000]}")
            return 1
        body = response.json()
        chat = client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": body["messages"], "max_tokens": 16, "temperature": 0},
        )
        sequential = client.post(
            "/v1/compact", json={"model": MODEL, "messages": trace.messages, "strategy": "sequential"}
        )
    row = compaction_row(trace, response.status_code, body, chat.status_code)
    print(table([row], list(row)))
    print(f"\nfacts kept verbatim: {recalled(trace, body['messages'])}")
    print(f"sequential: {sequential.status_code} {sequential.json().get('error', {}).get('message', '')}")
    print("summary begins:\n    " + "\n    ".join(body["summary"].splitlines()[:4]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"row": row, "stats": body["stats"]}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.bench.history", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="Which generated session")
    parser.add_argument("--tokens", type=int, default=20_000, help="About this many tokens of history")
    parser.add_argument("--replicas", type=int, default=1, choices=range(1, 9), metavar="1..8")
    parser.add_argument("--port", type=int, default=None, help="HTTP port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--timeout-s", type=float, default=3600, help="The service's compaction time limit")
    parser.add_argument("--json", type=Path, default=None, help="Also write the row and the stats here")
    args = parser.parse_args(argv)
    quiet_http_clients()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
