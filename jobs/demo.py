"""The main job on the CPU default: compact a real long conversation sequentially and in parallel, over HTTP.

    python -m jobs.demo [--conversation PATH] [--history-tokens 3072] [--chunk-tokens 512] [--port 8000] [--verbose]

Starts the service (a local Ray cluster, two vLLM-CPU replicas, the compaction endpoint), sends
the same history to `POST /v1/compact` once per strategy, each on empty prefix caches, prints a
side-by-side table (input tokens, chunks, summary tokens, prefill computed vs served from cache,
latency) and the first lines of both compacted histories, and shuts everything down. Quiet by
default: our lines, the table and the summaries; `--verbose` (or `VERBOSE=1`) adds Ray's and vLLM's logs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from compaction.errors import CompactionError
from compaction.options import VARIANTS
from jobs.data.conversations import LOCOMO_PATH, load_conversation, truncate_history

MODEL = "smollm2-135m-instruct"


def say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain fixed-width text table."""
    cells = [[f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


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


def run(args: argparse.Namespace, quiet: bool) -> int:
    from ray import serve

    from compaction.tokenizer import HFChatTokenizer
    from serving.local import APP_NAME, LocalService
    from serving.weights import fetch

    tokenizer = HFChatTokenizer.from_path(fetch())
    messages = truncate_history(load_conversation(args.conversation, args.sample_id), tokenizer, args.history_tokens)
    say(f"{len(messages)} messages (up to {args.history_tokens} tokens) from {args.conversation}")
    per_chunk = max(16, args.summary_tokens // -(-args.history_tokens // args.chunk_tokens))
    runs = {
        "sequential": {"strategy": "sequential", "max_chunk_summary_tokens": args.summary_tokens},
        "parallel": {"chunk_tokens": args.chunk_tokens, "max_chunk_summary_tokens": per_chunk},
    }
    results: dict[str, dict[str, Any]] = {}
    service_args = {"replicas": {MODEL: {"min": args.replicas, "max": args.replicas, "initial": args.replicas}}}
    service = LocalService(args.port, service_args, quiet=quiet)
    with service, httpx.Client(base_url=service.url, timeout=900) as client:
        coordinator = serve.get_deployment_handle("Coordinator", app_name=APP_NAME)
        for name, options in runs.items():
            coordinator.reset_prefix_cache.remote(MODEL).result()
            say(f"{name} compaction over HTTP (fresh prefix caches)")
            began = time.perf_counter()
            results[name] = compact(client, {"model": MODEL, "messages": messages, "variant": args.variant, **options})
            say(f"{name} done in {time.perf_counter() - began:.1f} s")
    rows = [row(name, result["stats"]) for name, result in results.items()]
    print(table(rows, list(rows[0])))
    for name, result in results.items():
        print(f"\n{name}: {len(messages)} messages -> {len(result['messages'])}; summary begins:")
        print(first_lines(result["summary"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversation", type=Path, default=LOCOMO_PATH, help="LoCoMo JSON or a messages JSON")
    parser.add_argument("--sample-id", default=None, help="LoCoMo sample (default: the first)")
    parser.add_argument("--history-tokens", type=int, default=3072, help="Use the first messages up to this size")
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--summary-tokens", type=int, default=256, help="Total summary budget of each run")
    parser.add_argument("--variant", default="default", choices=VARIANTS)
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the service on 127.0.0.1")
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        choices=range(1, 9),
        metavar="1..8",
        help="Model replicas (one compaction pins to one replica; each more adds ~30 s of start-up on 2 cores)",
    )
    parser.add_argument("--verbose", action="store_true", help="show Ray's and vLLM's logs too (or VERBOSE=1)")
    args = parser.parse_args(argv)
    from serving.local import hush, verbose_requested

    quiet = not verbose_requested(args.verbose)
    if quiet:
        hush()
    logging.getLogger("httpx").setLevel(logging.WARNING)
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
